"""A client's faults: a read bounded by a timeout (`KVCache.get_chunks(timeout=...)`,
the vLLM connector's in-step loads) that the object store does not answer in time is a
miss at once, not retried as a read of a restarted CPU store is; a pinned lookup whose
call failed or timed out is unpinned (the manager may still pin it). No Ray cluster."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from raykv.client import reads
from raykv.client.kvcache import KVCache
from raykv.client.pins import PinBook
from raykv.errors import InvalidInputError
from raykv.keys import KeyMaker


def bare_client(raises: BaseException) -> tuple[KVCache, list]:
    client = object.__new__(KVCache)
    client.config = SimpleNamespace(lookup_timeout_ms=3000)
    client._reads = None
    timeouts: list = []

    def read(refs: list, timeout: float | None = None) -> list:
        timeouts.append(timeout)
        raise raises

    client._read = read  # type: ignore[method-assign]
    return client, timeouts


def test_a_read_that_times_out_is_a_miss_and_not_retried() -> None:
    client, timeouts = bare_client(GetTimeoutError("slow"))
    assert client._read_attempt(reads.BY_REF, ["ref"], 0.05) == (None, None)
    assert timeouts == [0.05]


def test_a_read_of_a_restarted_store_is_retried_once_with_a_check() -> None:
    client, _ = bare_client(RayActorError())
    assert client._read_attempt(reads.BY_REF, ["ref"], 0.05) == (None, reads.CHECKED)


@pytest.mark.parametrize("left", [5.0, -1.0])
def test_a_deadline_bounds_each_call_and_leaves_a_ready_answer_a_millisecond(left) -> None:
    client, _ = bare_client(GetTimeoutError("slow"))
    got = client._left(time.monotonic() + left)
    assert (got <= left) if left > 0 else got == 1e-3
    assert client._left(None) == 12.0


SPANS = KeyMaker(chunk_size=4, model_name="m").keys(list(range(8)))


def faulty_client() -> tuple[KVCache, list]:
    """A client whose manager calls all fail (`_call` answers their default)."""
    client = object.__new__(KVCache)
    client.config = SimpleNamespace(lookup_timeout_ms=3000)
    client._probe = None
    client._settle = lambda timeout=None: None  # type: ignore[method-assign]
    client._packed = lambda spans: b"packed"  # type: ignore[method-assign]
    client._call = lambda method, *a, timeout, default: default  # type: ignore[method-assign]
    unpinned: list = []
    client.unpin = lambda lookup_id, wait=True: unpinned.append((lookup_id, wait))  # type: ignore[method-assign]
    return client, unpinned


def test_a_pinned_fetch_that_fails_is_unpinned_without_waiting() -> None:
    client, unpinned = faulty_client()
    assert client.fetch_spans(SPANS, "lookup-1", timeout=1.0) == (0, [])
    assert unpinned == [("lookup-1", False)]


def test_a_pinned_lookup_that_fails_is_unpinned_and_an_unpinned_one_is_not() -> None:
    client, unpinned = faulty_client()
    assert client._lookup(SPANS, True, "lookup-2") == 0
    assert client._lookup(SPANS, False, None) == 0
    assert unpinned == [("lookup-2", False)]


class _Stager:
    """Staged stores still in flight: `drain` records how long it was allowed."""

    pending = 1

    def __init__(self) -> None:
        self.drains: list = []

    def drain(self, timeout: float | None = None) -> bool:
        self.drains.append(timeout)
        return False


def calls_client() -> tuple[KVCache, list]:
    """A client over a manager that answers nothing: `_call` records each call's
    client-side timeout and answers its default."""
    client = object.__new__(KVCache)
    client.config = SimpleNamespace(lookup_timeout_ms=3000, chunk_size=4)
    client._probe, client._reads, client._closed = None, None, False
    client._stager, client._pins = _Stager(), PinBook()
    client._packed = lambda spans: b"packed"  # type: ignore[method-assign]
    # A fault's unpin is sent, not waited for: to no manager here (with a Ray up in this
    # process, as in the full suite, it would reach for one).
    client._manager = SimpleNamespace(unpin=SimpleNamespace(remote=lambda lookup_id: None))
    calls: list = []

    def call(method: str, *args: object, timeout: float | None, default: object) -> object:
        calls.append((method, timeout))
        return default

    client._call = call  # type: ignore[method-assign]
    return client, calls


def test_a_bounded_read_waits_for_staged_stores_no_longer_than_its_bound() -> None:
    """A read with a timeout (an in-step load) first lets this client's staged stores
    reach the manager: that wait took 4 lookup time-outs (12 s), whatever the bound."""
    client, _ = calls_client()
    assert client.get_chunks(SPANS, None, timeout=0.05) == ([], [])
    assert client.fetch_spans(SPANS, "lookup-1", timeout=0.2) == (0, [])
    first, second = client._stager.drains
    assert 0 <= first <= 0.05 and second == 0.2


def test_waits_without_a_timeout_still_give_up_on_a_manager_that_does_not_answer() -> None:
    client, calls = calls_client()
    client._settle = lambda timeout=None: None  # type: ignore[method-assign]
    client.wait("lookup-1")
    client.wait_sources("lookup-1")
    client.fetch_spans(SPANS, "lookup-1")
    client.wait("lookup-1", timeout=1.0)
    assert [t for _, t in calls] == [30.0, 30.0, 30.0, 4.0]


def test_close_sends_its_unpins_without_waiting_for_each() -> None:
    client, calls = calls_client()
    client._stager = None
    unpinned: list = []
    client.unpin = lambda lookup_id, wait=True: unpinned.append((lookup_id, wait))  # type: ignore[method-assign]
    for i in range(3):
        client._pins.open(f"lookup-{i}", SPANS[0].key)
    client.close()
    assert unpinned == [(f"lookup-{i}", False) for i in range(3)] and not calls


@pytest.mark.parametrize("bad", [["span"], [None], "spans", (SPANS[0],)], ids=repr)
def test_spans_that_are_not_a_list_of_keyed_chunk_spans_are_refused(bad) -> None:
    client, calls = calls_client()
    for call in (
        lambda: client.get_chunks(bad),
        lambda: client.prefetch_spans(bad),
        lambda: client.fetch_spans(bad, "lookup-1"),
        lambda: client.put_chunks(bad, [], []),
    ):
        with pytest.raises(InvalidInputError, match="ChunkSpan"):
            call()
    with pytest.raises(InvalidInputError, match="timeout"):
        client.get_chunks(SPANS, None, timeout="1")
    assert not calls


def test_the_pin_book_hands_each_lookup_to_one_retrieve_across_threads() -> None:
    import sys
    import threading

    book, key = PinBook(), SPANS[0].key
    taken: list = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:

        def work(k: int) -> None:
            for i in range(2000):
                book.open(f"{k}-{i}", key)
                taken.append(book.take(SPANS[:1]))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert None not in taken and len(set(taken)) == len(taken) == 8000 and len(book) == 0


def test_a_wait_that_faults_releases_the_prefetchs_pins() -> None:
    """A wait the manager did not answer (in time) is 0 tokens: nothing will retrieve
    that prefetch, so its pins go now, not at the end of their lease."""
    client, _ = calls_client()
    client._settle = lambda timeout=None: None  # type: ignore[method-assign]
    unpinned: list = []
    client.unpin = lambda lookup_id, wait=True: unpinned.append((lookup_id, wait))  # type: ignore[method-assign]
    assert client.wait("lookup-1") == 0 and client.wait_sources("lookup-2") == (0, [])
    assert unpinned == [("lookup-1", False), ("lookup-2", False)]


def test_a_lookup_that_raises_while_the_server_probe_is_out_ends_the_probes_trial() -> None:
    """A manager error between the probe's send and its answer left its half-open trial
    in flight for good: the breaker stayed shut and this process never probed again."""
    from raykv.client.probe import ServerProbe
    from raykv.errors import RayKVError
    from raykv.tiers.breaker import Breaker

    client, _ = faulty_client()
    probe = object.__new__(ServerProbe)
    probe.breaker = Breaker("ray://kv-test")
    probe.breaker.settle(False, ConnectionError("down"))  # open: the next call is a trial
    probe.breaker._retry_at = 0.0
    probe.send = lambda packed: ("ref", probe.breaker.admit())  # type: ignore[method-assign]
    client._probe = probe
    client._send = lambda method, *args: "local"  # type: ignore[method-assign]

    def reply(*args):
        raise RayKVError("the manager refused the lookup")

    client._reply = reply  # type: ignore[method-assign]
    with pytest.raises(RayKVError):
        client._lookup(SPANS, False, None)
    assert probe.breaker.ready()  # the trial ended: the next lookup may try again
