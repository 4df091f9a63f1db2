"""Remote tier logic without Ray: timeouts, back-off and masking (RemoteStore), and the
KVServer's budget and ordering (KVServerState)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from raykv_testing import chunk_key

from raykv.config import RayKVConfig
from raykv.payload import PayloadMeta
from raykv.tiers import breaker
from raykv.tiers import remote as rs
from raykv.tiers.kv_server import KVServerState
from raykv.tiers.remote import RemoteStore
from raykv.wire import PutAck

key = chunk_key


META = PayloadMeta("bfloat16", (2, 1, 4, 8))  # 128 bytes


def data(i: int) -> np.ndarray:
    return np.full(META.nbytes, i, dtype=np.uint8)


class FakeBackend:
    """A back end that hangs, fails or answers, as the test says."""

    scheme = "fake"

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0

    async def _act(self, value: Any) -> Any:
        self.calls += 1
        if self.mode == "hang":
            await asyncio.sleep(60)
        if self.mode == "fail":
            raise ConnectionError("refused by redis://:s3cret@host:1/0")
        return value

    async def put(self, keys, metas, batch, prefix=None) -> PutAck:
        return await self._act(PutAck(accepted=list(keys)))

    async def get_batch(self, keys):
        return await self._act(([META] * len(keys), [data(1)] * len(keys)))

    async def contains(self, keys):
        return await self._act([True] * len(keys))

    async def remove(self, keys):
        return await self._act(len(keys))

    async def keys(self):
        return await self._act([key(1)])

    async def clear(self):
        return await self._act(None)

    async def stats(self):
        return await self._act({"entries": 1})

    async def close(self):
        return None


def store(backend: FakeBackend) -> RemoteStore:
    cfg = RayKVConfig(remote_url="redis://:s3cret@host:1/0", lookup_timeout_ms=100)
    return RemoteStore(cfg, backend=backend)


def test_a_hanging_remote_costs_a_bounded_miss_then_backs_off() -> None:
    backend = FakeBackend()
    s = store(backend)

    async def run() -> None:
        backend.mode = "hang"
        start = time.monotonic()
        assert await s.contains([key(1), key(2)]) == [False, False]
        assert time.monotonic() - start < 0.5  # bounded by lookup_timeout_ms=100
        calls = backend.calls
        start = time.monotonic()
        metas, arrays = await s.get_batch([key(1)])  # inside the back-off window: no call
        assert metas == [None] and arrays[0].size == 0 and backend.calls == calls
        assert time.monotonic() - start < 0.05
        ack = await s.put([key(3)], [META], [data(3)])
        assert ack.skipped == [key(3)] and not ack.accepted
        backend.mode = "ok"
        await asyncio.sleep(breaker.BACKOFF_MIN_S + 0.05)
        assert await s.contains([key(1)]) == [True]  # reconnected
        stats = await s.stats()
        assert stats["healthy"] and stats["errors"] == 1 and stats["skipped_while_down"] == 2

    asyncio.run(run())


def test_an_error_of_a_reachable_server_costs_that_call_and_never_opens_the_breaker() -> None:
    """A full Redis (maxmemory with noeviction) refuses every write: each put opened the
    breaker, and reads Redis would serve missed (chunks the lookup counted as hits)."""
    import redis.exceptions

    backend = FakeBackend()
    cfg = RayKVConfig(remote_url="redis://full-host:1/0", lookup_timeout_ms=100)
    s = RemoteStore(cfg, backend=backend)
    refusals = [
        redis.exceptions.OutOfMemoryError("OOM command not allowed"),
        RuntimeError("the batch's owner died"),
    ]

    async def refuse(keys, metas, batch, prefix=None):
        backend.calls += 1
        raise refusals.pop(0)

    backend.put = refuse

    async def run() -> None:
        for _ in range(2):
            ack = await s.put([key(3)], [META], [data(3)])
            assert ack.skipped == [key(3)] and not ack.accepted
            assert s.breaker.closed
        metas, _ = await s.get_batch([key(1)])
        assert metas == [META] and backend.calls == 3
        stats = await s.stats()
        assert stats["errors"] == stats["refused"] == 2 and stats["skipped_while_down"] == 0

    asyncio.run(run())


def test_which_errors_say_a_remote_cannot_be_reached() -> None:
    import ray.exceptions
    import redis.exceptions

    down = [
        redis.exceptions.ConnectionError("x"),
        redis.exceptions.TimeoutError("x"),
        redis.exceptions.BusyLoadingError("x"),
        ConnectionRefusedError(),
        asyncio.TimeoutError(),
        ray.exceptions.GetTimeoutError(),
        ray.exceptions.ActorDiedError(),
    ]
    up = [redis.exceptions.ResponseError("WRONGTYPE"), redis.exceptions.ReadOnlyError("x")]
    assert all(breaker.is_outage(e) for e in down)
    assert not any(breaker.is_outage(e) for e in up + [ValueError("x")])


def test_failures_never_raise_and_never_show_the_password(caplog, monkeypatch) -> None:
    monkeypatch.setattr(breaker, "BACKOFF_MAX_S", 0.05)
    backend = FakeBackend()
    backend.mode = "fail"
    s = store(backend)

    async def run() -> None:
        assert await s.remove([key(1)]) == 0
        await asyncio.sleep(breaker.BACKOFF_MAX_S + 0.05)
        assert await s.keys() == []
        await asyncio.sleep(breaker.BACKOFF_MAX_S + 0.05)
        await s.clear()
        assert "s3cret" not in repr(s) and "***" in s.url

    with caplog.at_level("DEBUG", logger="raykv"):
        asyncio.run(run())
    assert "failed on remove" in caplog.text and "s3cret" not in caplog.text


def test_unknown_scheme_lists_the_known_ones() -> None:
    from raykv.errors import InvalidInputError
    from raykv.tiers.remote import make_backend

    cfg = RayKVConfig()
    with pytest.raises(InvalidInputError, match="known: ray, redis, rediss"):
        make_backend("memcached://:pw@h:1", cfg, 1.0)


def kv_state(capacity: int) -> KVServerState:
    return KVServerState(capacity, "lru", store=lambda a: a.copy(), load=lambda hs: list(hs))


def test_kv_server_state_keeps_the_first_value_and_evicts_deepest_first() -> None:
    s = kv_state(4 * META.nbytes)
    ack = s.put([key(i) for i in range(4)], [META] * 4, [data(i) for i in range(4)])
    assert ack.accepted == [key(i) for i in range(4)]
    assert s.put([key(0)], [META], [data(99)]).accepted == [key(0)]
    metas, arrays = s.get_batch([key(0), key(7)])
    assert metas == [META, None] and np.array_equal(arrays[0], data(0)) and arrays[1].size == 0
    # one request is ordered deepest first: chunk 3 goes before its prefix
    ack = s.put([key(4)], [META], [data(4)])
    assert ack.evicted == [key(3)]
    assert s.stats()["used_bytes"] == 4 * META.nbytes
    assert s.remove([key(4), key(9)]) == 1 and len(s.keys()) == 3


def test_kv_server_state_keeps_a_later_turns_chain_prefix_closed() -> None:
    """Turn 2 of a conversation stores chunks 2-3 after the prefix 0-1 it hit elsewhere
    (a lookup does not touch the server): the server must neither evict that prefix for
    them nor leave it older than them (it evicted the prefix first, stranding 2-3)."""
    s = kv_state(4 * META.nbytes)
    s.put([key(0), key(1)], [META] * 2, [data(0), data(1)])
    s.put([key(8), key(9)], [META] * 2, [data(8), data(9)])  # another chain, more recent
    ack = s.put([key(2), key(3)], [META] * 2, [data(2), data(3)], prefix=[key(0), key(1)])
    assert ack.accepted == [key(2), key(3)] and sorted(ack.evicted) == [key(8), key(9)]
    ack = s.put([key(5)], [META], [data(5)])  # the chain goes deepest first
    assert ack.evicted == [key(3)]


def test_kv_server_state_skips_what_cannot_fit_and_a_failed_store() -> None:
    s = kv_state(META.nbytes)
    ack = s.put([key(1), key(2)], [META] * 2, [data(1), data(2)])
    assert ack.accepted == [key(1)] and ack.evicted == [] and ack.skipped == [key(2)]

    def broken(_: np.ndarray) -> Any:
        raise MemoryError("object store full")

    s2 = KVServerState(1 << 20, store=broken, load=list)
    assert s2.put([key(1)], [META], [data(1)]).skipped == [key(1)]
    assert s2.stats()["used_bytes"] == 0 and s2.stats()["errors"] == 1


def _unvalidated_meta(dtype: str, shape: tuple[Any, ...]) -> PayloadMeta:
    """A PayloadMeta as unpickling makes it: `__post_init__` never ran (a hostile client)."""
    meta = object.__new__(PayloadMeta)
    for name, value in (("dtype", dtype), ("shape", shape), ("layout", "KV_2LTD")):
        object.__setattr__(meta, name, value)
    return meta


@pytest.mark.parametrize(
    ("meta", "array"),
    [
        (META, data(1)[:-1]),  # one byte short
        (META, np.zeros(META.nbytes + 8, dtype=np.uint8)),  # too long
        (META, list(data(1))),  # not an array
        (META, None),
        (META, np.array([None] * META.nbytes, dtype=object)[: META.nbytes // 8]),  # objects
        (None, data(1)),  # no meta
        ("bfloat16", data(1)),
        (_unvalidated_meta("evil", (2, 1, 4, 8)), data(1)),  # unknown dtype
        (_unvalidated_meta("bfloat16", (2, "x" * 8, 4, 8)), data(1)),  # non-int dims
        (_unvalidated_meta("bfloat16", (2, -1, -4, 8)), np.zeros(64, dtype=np.uint8)),
    ],
    ids=[
        "short",
        "long",
        "list",
        "none",
        "objects",
        "no-meta",
        "str-meta",
        "unknown-dtype",
        "str-dims",
        "negative-dims",
    ],
)
def test_kv_server_state_skips_and_counts_a_chunk_that_disagrees_with_its_meta(
    meta: Any, array: Any
) -> None:
    s = kv_state(1 << 20)
    ack = s.put([key(1), key(2)], [meta, META], [array, data(2)])  # never raises
    assert ack.skipped == [key(1)] and ack.accepted == [key(2)]
    assert s.keys() == [key(2)] and s.stats()["skipped"] == 1
    assert s.stats()["used_bytes"] == META.nbytes


def test_half_open_backoff_lets_one_trial_call_through() -> None:
    backend = FakeBackend()
    s = store(backend)

    async def run() -> None:
        backend.mode = "hang"
        assert await s.contains([key(1)]) == [False]  # fails: the breaker opens
        await asyncio.sleep(breaker.BACKOFF_MIN_S + 0.02)
        calls = backend.calls
        start = time.monotonic()
        # After the window: one trial goes to the (still hanging) server, the rest miss fast.
        trial = asyncio.ensure_future(s.contains([key(1)]))
        await asyncio.sleep(0.01)
        for _ in range(5):
            assert await s.get_batch([key(1)]) == ([None], [rs.EMPTY])
        assert time.monotonic() - start < 0.05 and backend.calls == calls + 1
        assert await trial == [False]  # the trial timed out: a longer window
        assert s.breaker.backoff_s == 2 * breaker.BACKOFF_MIN_S
        backend.mode = "ok"
        await asyncio.sleep(s.breaker.backoff_s + 0.02)
        assert await s.contains([key(1)]) == [True]  # the trial succeeds: closed again
        results = await asyncio.gather(*(s.contains([key(2)]) for _ in range(3)))
        assert results == [[True]] * 3

    asyncio.run(run())


class IdentityBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.run_id = "run-1"

    async def server_id(self) -> str:
        return await self._act(self.run_id)


def test_incarnation_changes_when_the_server_restarts_but_not_while_it_is_down() -> None:
    backend = IdentityBackend()
    s = store(backend)

    async def run() -> None:
        first = await s.identity()
        assert first == await s.identity() and first.endswith(":run-1")
        backend.mode = "fail"
        assert await s.identity() == first  # unreachable: not a restart
        backend.mode = "ok"
        backend.run_id = "run-2"  # restarted, data gone
        await asyncio.sleep(breaker.BACKOFF_MIN_S + 0.02)
        assert await s.identity() != first

    asyncio.run(run())


def test_a_remote_store_never_shows_the_password_in_repr_stats_or_logs(caplog) -> None:
    backend = FakeBackend()
    backend.mode = "fail"  # the back end's error message carries the password
    s = store(backend)

    async def run() -> dict:
        assert await s.contains([key(1)]) == [False]
        await asyncio.sleep(breaker.BACKOFF_MIN_S + 0.02)
        return await s.stats()

    with caplog.at_level("DEBUG", logger="raykv"):
        stats = asyncio.run(run())
    assert "s3cret" not in repr(s) and "s3cret" not in repr(stats)
    assert "***" in stats["url"] and "***" in caplog.text and "s3cret" not in caplog.text


# ----- a real redis-server with many keys, or junk under a chunk's name -----


def _real_store(url: str, **settings: Any) -> RemoteStore:
    return RemoteStore(RayKVConfig(remote_url=url, namespace="big", **settings), timeout_s=0.05)


def test_stats_and_keys_stay_bounded_with_many_keys_on_the_server(redis_server) -> None:
    """200k values: stats counts with DBSIZE (no SCAN), and a resync's listing stops at
    `remote_index_max_keys` and within the time-out (both once took 1-5 s here)."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        for start in range(0, 200_000, 20_000):
            pipe = client.pipeline(transaction=False)
            for i in range(start, start + 20_000):
                pipe.set(f"big:kv:junk-{i}", b"x")
            pipe.execute()
    finally:
        client.close()
    store = _real_store(redis_server.url, remote_index_max_keys=5000)

    async def scenario() -> tuple[float, Any, float, Any]:
        t0 = time.monotonic()
        stats = await store.stats()
        t1 = time.monotonic()
        listed = await store._backend._names(5000, 0.025)
        t2 = time.monotonic()
        await store.close()
        return t1 - t0, stats, t2 - t1, listed

    stats_s, stats, keys_s, listed = asyncio.run(scenario())
    assert stats["healthy"] and stats_s < 0.2
    assert len(listed) <= 5000 + 1000 and keys_s < 0.2  # one SCAN batch past the cap at most


def test_a_huge_junk_value_under_a_chunks_name_is_deleted_after_its_header(redis_server) -> None:
    import redis

    store = _real_store(redis_server.url)
    name = store._backend._name(key(1))
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(name, b"\x00" * (64 << 20))  # 64 MiB that is no record

        async def scenario() -> tuple[float, Any]:
            t0 = time.monotonic()
            metas, _ = await store.get_batch([key(1)])
            elapsed = time.monotonic() - t0
            await store.close()
            return elapsed, metas

        elapsed, metas = asyncio.run(scenario())
        assert metas == [None] and not client.exists(name)  # a miss, and gone
        assert elapsed < 0.05  # only its header was read (a time-out would also say miss)
    finally:
        client.close()


def test_a_big_put_goes_in_pipelines_the_socket_time_out_covers(redis_server) -> None:
    """redis-py bounds the write of a whole pipeline by the socket time-out: a put of
    more bytes than that covers (at the rate a put's own time-out assumes) is sent in
    several pipelines, and every chunk of it is stored."""
    store = _real_store(redis_server.url)  # 50 ms: 2.5 MB a pipeline
    pipelines = []
    real = store._backend._client.pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        pipe = real(*args, **kwargs)
        execute = pipe.execute

        async def counting(*args: Any, **kwargs: Any) -> Any:
            pipelines.append(len(pipe.command_stack))
            return await execute(*args, **kwargs)

        pipe.execute = counting
        return pipe

    store._backend._client.pipeline = counted
    keys = [key(100 + i) for i in range(8)]
    meta = PayloadMeta("bfloat16", (2, 8, 256, 128))  # 1 MiB
    arrays = [np.full(meta.nbytes, i, np.uint8) for i in range(8)]
    metas = [meta] * len(arrays)

    async def scenario() -> tuple[Any, Any]:
        ack = await store.put(keys, metas, arrays)
        got = await store.get_batch(keys)
        await store.close()
        return ack, got

    ack, (got_metas, got_arrays) = asyncio.run(scenario())
    puts = pipelines[:-1]  # the last is get_batch's header pipeline
    assert ack.accepted == keys and puts == [2, 2, 2, 2]  # 1 MiB records, 2.5 MB a pipeline
    assert all(np.array_equal(a, b) for a, b in zip(got_arrays, arrays, strict=True))
