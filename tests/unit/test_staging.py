"""The staging ring and the background stager (raykv.client.staging), without Ray."""

from __future__ import annotations

import threading
from typing import Any

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


def test_a_region_given_back_early_is_reused_only_after_the_older_ones() -> None:
    """Several threads stage stores: their jobs reach the worker in the order they were
    queued, not the order their regions were taken. A region given back before an older
    one must not let a new region overwrite that older one's bytes (they were stored
    under another request's keys)."""
    ring = StagingRing(4 * ALIGN)
    a = ring.take(2 * ALIGN)
    b = ring.take(2 * ALIGN)
    assert a is not None and b is not None
    a[1][:] = 7
    ring.give_back(b[0])  # the younger one first
    assert ring.take(ALIGN) is None  # its room follows `a`, still in use: no region yet
    assert (a[1] == 7).all() and ring.used == 4 * ALIGN
    ring.give_back(a[0])
    assert ring.used == 0
    with pytest.raises(RuntimeError, match="no staging region"):
        ring.give_back(a[0])  # twice: a bug, said so
    assert ring.take(4 * ALIGN) is not None


def test_stores_staged_from_many_threads_send_their_own_bytes() -> None:
    stager = Stager(8 * ALIGN)
    sent: list[tuple[int, bool]] = []

    def store(value: int) -> None:
        def fill(region: np.ndarray, _offset: int) -> None:
            region[:] = value

        def send(region: np.ndarray, done: Any) -> None:
            sent.append((value, bool((region == value).all())))
            done()

        while not stager.stage(ALIGN * (1 + value % 3), fill, send):
            pass  # the ring is full: try again

    threads = [
        threading.Thread(target=lambda k=k: [store(k * 50 + i) for i in range(50)])
        for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stager.drain(10)
    assert len(sent) == 200 and all(ok for _, ok in sent), [v for v, ok in sent if not ok]
    assert stager.ring.used == 0 and stager.failed == 0


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
