"""The staging ring and the background stager (raykv.client.staging), without Ray."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from raykv.client.staging import ALIGN, SerialWorker, Stager, StagingRing, copy_buffers


def test_regions_never_overlap_and_come_back_in_order_across_wraps() -> None:
    ring = StagingRing(10 * ALIGN)
    rng = np.random.default_rng(0)
    live: list[tuple[int, np.ndarray, int]] = []  # (token, region, fill value)
    for step in range(2000):
        if live and (rng.random() < 0.5 or len(live) > 6):
            token, region, value = live.pop(0)
            assert (region == value).all(), "a region was overwritten while in use"
            ring.give_back(token)
            continue
        n = int(rng.integers(1, 4 * ALIGN))
        got = ring.take(n)
        if got is None:
            assert live, "an empty ring must take any region that fits its capacity"
            continue
        token, region = got
        assert region.nbytes == n
        region[:] = step % 251
        live.append((token, region, step % 251))
    for token, region, value in live:
        assert (region == value).all()
        ring.give_back(token)
    assert ring.used == 0


def test_a_full_ring_refuses_and_an_oversize_region_never_fits() -> None:
    ring = StagingRing(4 * ALIGN)
    a = ring.take(2 * ALIGN)
    b = ring.take(2 * ALIGN)
    assert a is not None and b is not None
    assert ring.take(1) is None
    ring.give_back(a[0])
    assert ring.take(2 * ALIGN) is not None  # the front is free again
    assert StagingRing(ALIGN).take(ALIGN + 1) is None
    with pytest.raises(ValueError, match="> 0 bytes"):
        StagingRing(0)


def test_regions_must_come_back_oldest_first() -> None:
    ring = StagingRing(4 * ALIGN)
    ring.take(ALIGN)
    b = ring.take(ALIGN)
    with pytest.raises(RuntimeError, match="out of order"):
        ring.give_back(b[0])  # type: ignore[index]


def test_the_stager_sends_in_order_frees_after_the_put_and_drops_when_full() -> None:
    stager = Stager(4 * ALIGN)
    gate = threading.Event()
    sent: list[bytes] = []

    def send(region: np.ndarray, done) -> None:  # noqa: ANN001
        sent.append(region.tobytes())  # the "ray.put": bytes copied out of the ring
        done()
        gate.wait(5)  # the "manager call" is still out; the ring is already free

    payloads = [np.full(2 * ALIGN, i, np.uint8) for i in range(3)]
    for p in payloads[:2]:
        assert stager.stage(p.nbytes, lambda r, _at, p=p: copy_buffers(r, [p]), send)
    for _ in range(500):  # the first store's put is done while its manager call is out
        if sent:
            break
        threading.Event().wait(0.01)
    p = payloads[2]
    assert stager.stage(p.nbytes, lambda r, _at: copy_buffers(r, [p]), send)
    assert stager.pending >= 1
    gate.set()
    assert stager.drain(5)
    assert sent == [p.tobytes() for p in payloads]
    # A store that finds the ring full is dropped and counted; the caller does not wait.
    block = threading.Event()
    stager.stage(4 * ALIGN, lambda r, _at: None, lambda r, done: block.wait(5))
    assert not stager.stage(ALIGN, lambda r, _at: None, send)
    assert stager.stats()["dropped_stores"] == 1
    block.set()
    assert stager.close(5)


def test_a_failing_send_is_counted_and_a_failing_fill_raises_to_the_caller() -> None:
    stager = Stager(4 * ALIGN)

    def boom(region: np.ndarray, done) -> None:  # noqa: ANN001
        raise ConnectionError("object store gone")

    assert stager.stage(ALIGN, lambda r, _at: None, boom)
    assert stager.drain(5) and stager.failed == 1

    def bad_fill(region: np.ndarray, _at: int) -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        stager.stage(ALIGN, bad_fill, boom)
    assert stager.drain(5) and stager.ring.used == 0 and stager.failed == 1
    # The ring is whole again: a store of its full size fits.
    assert stager.stage(4 * ALIGN, lambda r, _at: None, lambda r, done: done())
    assert stager.close(5)


class Job:
    """Records the thread it ran on and its argument (or raises)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self.fail = fail

    def __call__(self, *args: object) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("actor gone")
        self.calls.append(args)


def test_a_serial_worker_runs_jobs_in_order_on_its_own_thread_and_drain_waits_for_them():
    worker, job = SerialWorker("test-notes"), Job()
    for i in range(50):
        worker.submit(lambda i=i: job(i, "x"))
    assert worker.drain(5)
    assert job.calls == [(i, "x") for i in range(50)]
    assert job.threads == {"test-notes"}
    assert worker.close(5)


def test_a_failing_job_is_dropped_and_the_next_ones_still_run():
    worker, bad, good = SerialWorker("test-worker"), Job(fail=True), Job()
    worker.submit(lambda: bad(1))
    worker.submit(lambda: good(2))
    assert worker.drain(5) and good.calls == [(2,)]
    assert worker.close(5)
