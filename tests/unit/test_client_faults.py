"""A client's faults: a read bounded by a timeout (`KVCache.get_chunks(timeout=...)`,
the vLLM connector's in-step loads) that the object store does not answer in time is a
miss at once, not retried as a read of a restarted CPU store is; a pinned lookup whose
call failed or timed out is unpinned (the manager may still pin it). No Ray cluster."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from raykv.client import kvcache
from raykv.client.kvcache import KVCache


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
    assert client._read_attempt(kvcache._BY_REF, ["ref"], 0.05) == (None, None)
    assert timeouts == [0.05]


def test_a_read_of_a_restarted_store_is_retried_once_with_a_check() -> None:
    client, _ = bare_client(RayActorError())
    assert client._read_attempt(kvcache._BY_REF, ["ref"], 0.05) == (None, kvcache._CHECKED)


@pytest.mark.parametrize("left", [5.0, -1.0])
def test_a_deadline_bounds_each_call_and_leaves_a_ready_answer_a_millisecond(left) -> None:
    client, _ = bare_client(GetTimeoutError("slow"))
    got = client._left(time.monotonic() + left)
    assert (got <= left) if left > 0 else got == 1e-3
    assert client._left(None) == 12.0


def faulty_client() -> tuple[KVCache, list]:
    """A client whose manager calls all fail (`_call` answers their default)."""
    client = object.__new__(KVCache)
    client.config = SimpleNamespace(lookup_timeout_ms=3000)
    client._probe = None
    client._settle = lambda: None  # type: ignore[method-assign]
    client._packed = lambda spans: b"packed"  # type: ignore[method-assign]
    client._call = lambda method, *a, timeout, default: default  # type: ignore[method-assign]
    unpinned: list = []
    client.unpin = lambda lookup_id, wait=True: unpinned.append((lookup_id, wait))  # type: ignore[method-assign]
    return client, unpinned


def test_a_pinned_fetch_that_fails_is_unpinned_without_waiting() -> None:
    client, unpinned = faulty_client()
    assert client.fetch_spans(["span"], "lookup-1", timeout=1.0) == (0, [])
    assert unpinned == [("lookup-1", False)]


def test_a_pinned_lookup_that_fails_is_unpinned_and_an_unpinned_one_is_not() -> None:
    client, unpinned = faulty_client()
    assert client._lookup(["span"], True, "lookup-2") == 0
    assert client._lookup(["span"], False, None) == 0
    assert unpinned == [("lookup-2", False)]
