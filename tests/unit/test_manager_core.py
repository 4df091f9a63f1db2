"""The storage manager's core (`raykv.actors.manager_core.ManagerCore`) on its own event
loop, against fake tiers: no Ray cluster. The disk tier is the real actor shell's class
(`DiskStoreActor`'s body) around a real `DiskStore` in a temp directory; a fake handle
turns `handle.method.remote(...)` into a call answered with an already-resolved future,
as Ray's actor handles answer with awaitable refs. What a put writes, a lookup finds, a
prefetch pins and a get serves, in prefix order, with every miss a miss."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from raykv_testing import seeded_chunk

from raykv.actors import disk_store, tierset
from raykv.actors.disk_store import DiskStoreActor
from raykv.actors.manager_core import ManagerCore
from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError
from raykv.keys import ChunkSpan, KeyMaker
from raykv.wire import PackedSpans, RetrieveResult, TailCandidates

C = 16  # chunk tokens


class _Method:
    def __init__(self, fn: Any, returns: int = 1) -> None:
        self._fn, self._returns = fn, returns

    def options(self, num_returns: int = 1, **_: Any) -> _Method:
        return _Method(self._fn, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        value = self._fn(*args, **kwargs)
        values = value if self._returns > 1 else (value,)
        futures = []
        for v in values:
            fut = loop.create_future()
            fut.set_result(v)
            futures.append(fut)
        return tuple(futures) if self._returns > 1 else futures[0]


class FakeHandle:
    """`handle.method.remote(...)` on a plain object, answered with resolved futures."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


@pytest.fixture
def disk_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RayKVConfig:
    cfg = RayKVConfig(
        namespace="t-core",
        chunk_size=C,
        local_cpu=False,
        local_disk=str(tmp_path),
        max_local_disk_size=0.01,
        kv_dtype="bfloat16",
    )
    shell = DiskStoreActor.__ray_metadata__.modified_class(cfg)
    monkeypatch.setattr(
        tierset, "get_or_create_tiers", lambda config, node: {"disk": FakeHandle(shell)}
    )
    monkeypatch.setattr(tierset.HandoutHold, "hold", lambda self, ref, nbytes: None)
    # The fake object store: a put's batch `[value]` resolves to its value, as
    # `ray.get(ref)` of the client's batch object would.
    monkeypatch.setattr(disk_store, "resolve_batch", lambda batch: batch[0])
    return cfg


def run(coro_fn: Any) -> Any:
    async def main() -> Any:
        return await coro_fn()

    return asyncio.run(main())


async def stored(cfg: RayKVConfig, spans: list, chunks: list) -> ManagerCore:
    """A manager over `cfg` holding `chunks` (seeded (meta, array) pairs) under `spans`."""
    core = ManagerCore(cfg)
    await core.put(spans, [m for m, _ in chunks], [[a for _, a in chunks]])
    await core.flush(10)
    return core


def test_put_then_lookup_prefetch_and_get_serve_the_stored_prefix(disk_only: RayKVConfig):
    spans = KeyMaker.from_config(disk_only).keys(list(range(3 * C)))
    chunks = [seeded_chunk(i) for i in range(3)]
    metas = [m for m, _ in chunks]
    arrays = [a for _, a in chunks]

    async def scenario() -> tuple:
        core = ManagerCore(disk_only)
        put = await core.put(spans[:2], metas[:2], [arrays[:2]])  # the first two chunks
        await core.flush(10)
        found = await core.lookup(spans)
        await core.prefetch("req-1", spans)
        ready = await core.wait("req-1", 5, sources=True)
        wire = await core.get(spans, "req-1")
        return put, found, ready, RetrieveResult.of(wire)

    put, found, ready, result = run(scenario)
    assert put.stored == 0  # no CPU tier: the chunks went to disk in the background
    assert found == 2 * C  # a prefix: chunk 3 was never stored
    assert ready == (2 * C, [("disk", 2 * C)])  # found on disk (what vLLM's stats show)
    assert [c.meta for c in result.chunks] == metas[:2]
    for chunk, want in zip(result.chunks, arrays[:2], strict=True):
        got = chunk.ref.result()[chunk.index]  # the fake's "object": the disk's reply
        assert np.array_equal(got, want)


def test_a_flush_that_times_out_leaves_the_background_writes_running(disk_only):
    """`flush` waits for the lower-tier writes' acks; one that gives up must not cancel
    them (a cancelled ack never reaches the index: keys on disk it would not list)."""
    landed: list[str] = []

    async def ack_later() -> None:
        await asyncio.sleep(0.3)
        landed.append("ack")

    async def scenario() -> tuple[bool, bool]:
        core = ManagerCore(disk_only)
        await core.flush(10)  # started
        core._t.spawn(ack_later(), name="raykv-put-test")
        early = await core.flush(0.02)
        await asyncio.sleep(0.5)
        return early, await core.flush(10)

    early, later = run(scenario)
    assert (early, later, landed) == (False, True, ["ack"])


def test_a_get_or_unpin_that_overtakes_its_prefetch_leaves_no_open_lookup(disk_only):
    """Calls to the threaded manager may run out of order: a client's unpin (or get) of
    a lookup id whose prefetch has not arrived yet ends that lookup all the same, so the
    prefetch that comes later opens and pins nothing (it held chunks for the whole pin
    lease)."""
    spans = KeyMaker.from_config(disk_only).keys(list(range(2 * C)))
    chunks = [seeded_chunk(i) for i in range(2)]

    async def scenario() -> tuple:
        core = await stored(disk_only, spans, chunks)
        await core.unpin("late-prefetch")
        await core.prefetch("late-prefetch", spans)
        await core.get(spans, "late-fetch")
        fetched = await core.fetch("late-fetch", spans, 5)
        await core.prefetch("in-order", spans)  # a lookup in order still opens and loads
        opened = set(core._index.lookups)
        ready = await core.wait("in-order", 5)
        return fetched, opened, ready

    fetched, opened, ready = run(scenario)
    assert fetched == (0, []) and opened == {"in-order"} and ready == 2 * C


def test_a_chunk_gone_from_disk_ends_the_prefix_there_never_wrong_bytes(disk_only, tmp_path):
    spans = KeyMaker.from_config(disk_only).keys(list(range(3 * C)))
    chunks = [seeded_chunk(i) for i in range(3)]

    async def scenario() -> tuple:
        core = await stored(disk_only, spans, chunks)
        for path in tmp_path.rglob(f"*{spans[1].key.chunk_hash}*.rkv"):
            path.write_bytes(b"junk")  # chunk 2's file is damaged behind the index's back
        wire = await core.get(spans)
        return RetrieveResult.of(wire)

    result = run(scenario)
    assert len(result.chunks) == 1  # chunk 1 served; chunk 2 is a miss, so is chunk 3
    assert np.array_equal(result.chunks[0].ref.result()[0], chunks[0][1])


def test_a_fetch_extends_its_whole_chunks_by_a_partial_chunk_from_the_candidates(disk_only):
    """`save_unfull_chunk` without the vLLM scheduler's view: the lookup sends candidate
    partial chunks, the manager takes the longest held right after the whole chunks
    found, loads it with them, and a get serves it."""
    maker = KeyMaker.from_config(disk_only)
    whole = maker.keys_from_hashes([b"h1", b"h2", b"h3"], [C, 2 * C, 3 * C])
    tail, other = maker.keys_from_hashes([b"t1", b"t2"], [2 * C + 8, 2 * C + 12])
    tail, other = ChunkSpan(2 * C, tail.end, tail.key), ChunkSpan(2 * C, other.end, other.key)
    chunks = [seeded_chunk(i) for i in range(3)]

    async def scenario() -> tuple:
        core = ManagerCore(disk_only)
        stored = [*whole[:2], tail]  # chunk 3 was never stored; a partial chunk after 2
        await core.put(stored, [m for m, _ in chunks], [[a for _, a in chunks]])
        await core.flush(10)
        model, world, _, dtype = maker.identity  # longest first: `other` is not held
        hashes = [other.key.chunk_hash, tail.key.chunk_hash]
        sent = TailCandidates(model, world, dtype, [2 * C] * 2, [other.end, tail.end], hashes)
        found = await core.fetch("req-t", PackedSpans.of(whole).wire(), 5, None, sent.wire())
        plain = await core.fetch("req-p", PackedSpans.of(whole).wire(), 5)
        wire = await core.get([*whole[:2], tail], "req-t")
        return found, plain, RetrieveResult.of(wire)

    found, plain, result = run(scenario)
    assert found == (2 * C + 8, [("disk", 2 * C + 8)])
    assert plain == (2 * C, [("disk", 2 * C)])  # no candidates: whole chunks only
    assert len(result.chunks) == 3 and result.hit_tokens == 2 * C + 8
    for chunk, (_, want) in zip(result.chunks, chunks, strict=True):
        assert np.array_equal(chunk.ref.result()[chunk.index], want)


def test_a_direct_fetch_leaves_a_disk_prefix_to_the_caller_unread_and_unpinned(
    disk_only, monkeypatch
):
    """`fetch(direct=True)` (a vLLM worker that reads this node's disk files itself): a
    prefix found on disk is its hit at once, without the disk tier reading a byte; the
    lookup is closed (nothing pinned) and the chunks are touched in the disk's policy.
    Without `direct`, the same fetch reads them (the promotion the reader skips)."""
    spans = KeyMaker.from_config(disk_only).keys(list(range(3 * C)))
    chunks = [seeded_chunk(i) for i in range(3)]
    reads: list[int] = []
    touched: list[list] = []

    async def scenario() -> tuple:
        core = await stored(disk_only, spans, chunks)
        shell = core._t.handles["disk"]._obj
        get_batch, touch = shell.get_batch, shell.touch
        monkeypatch.setattr(
            shell, "get_batch", lambda keys: reads.append(len(keys)) or get_batch(keys)
        )
        monkeypatch.setattr(shell, "touch", lambda keys: touched.append(keys) or touch(keys))
        direct = await core.fetch("req-d", spans, 5, None, None, True)
        still_open = "req-d" in core._index.lookups
        hits = shell.stats()["hits"]
        promoted = await core.fetch("req-p", spans, 5)
        return direct, still_open, hits, promoted

    direct, still_open, hits, promoted = run(scenario)
    assert direct == (3 * C, [("disk", 3 * C)]) and not still_open
    assert touched == [[s.key for s in spans]] and hits == 3
    assert promoted == (3 * C, [("disk", 3 * C)]) and reads == [3]


def test_chunks_a_client_read_itself_are_touched_and_its_gone_files_dropped(disk_only):
    """`read_directly` (a vLLM worker that read disk files without a manager lookup, or
    found one gone or corrupt): without a CPU tier the chunks read are touched in the
    disk tier's policy; a file reported bad leaves the index and the tier, so a later
    put writes it again instead of taking it as held."""
    spans = KeyMaker.from_config(disk_only).keys(list(range(2 * C)))
    chunks = [seeded_chunk(i) for i in range(2)]

    async def scenario() -> tuple:
        core = await stored(disk_only, spans, chunks)
        shell = core._t.handles["disk"]._obj
        await core.read_directly([spans[0].key], [spans[1].key])
        return set(await core.indexed_keys("disk")), shell.keys(), shell.stats()["hits"]

    indexed, held, hits = run(scenario)
    assert indexed == set(held) == {spans[0].key} and hits == 1


def test_a_fetch_with_malformed_candidates_is_refused(disk_only):
    whole = KeyMaker.from_config(disk_only).keys(list(range(2 * C)))

    async def scenario() -> Any:
        return await ManagerCore(disk_only).fetch("req-b", whole, 5, None, ([0], whole, 3))

    with pytest.raises(InvalidInputError, match="tails"):
        run(scenario)
    model, world, _, dtype = whole[0].key.identity
    other = TailCandidates(model, world + 1, dtype, [C], [C + 8], ["0" * 32]).wire()

    async def another_world() -> Any:
        return await ManagerCore(disk_only).fetch("req-w", whole, 5, None, other)

    with pytest.raises(InvalidInputError, match="another model, world size or dtype"):
        run(another_world)


def test_a_background_loop_that_raises_is_started_again(monkeypatch):
    """The manager's loops (tier health checks, lease expiry, controller reports) run
    under `supervised`: one that raised used to stop for good, silently."""
    from raykv.actors import common

    monkeypatch.setattr(common, "LOOP_RESTART_SECS", 0.0)
    runs: list[int] = []

    async def loop() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("a GCS hiccup")

    run(lambda: common.supervised("test loop", loop))
    assert len(runs) == 3


def test_a_tier_that_cannot_be_re_created_stays_down_and_the_manager_serves(disk_only, monkeypatch):
    """Re-creating a dead tier's actor can fail (the GCS away, a name taken by another
    class): the tier stays down until the next health check tries again; nothing raises
    into the request or the loop that noticed."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the GCS is away")

    spans = KeyMaker.from_config(disk_only).keys(list(range(C)))

    async def scenario() -> tuple:
        core = ManagerCore(disk_only)
        await core.flush(1)
        monkeypatch.setattr(tierset, "create_tier", refuse)
        core._t.tier_died("disk")
        core._t.tier_died("disk")  # noticed twice: re-created once
        await asyncio.sleep(0.2)  # the re-creation (on a thread) failed meanwhile
        return "disk" in core._index.down, await core.lookup(spans), core._t._recreating

    down, hit, recreating = run(scenario)
    assert (down, hit, recreating) == (True, 0, set())


def test_a_lookup_over_two_ranks_stays_open_until_each_rank_read_its_chunks(disk_only):
    """The scheduler of a TP=2 engine looks up both ranks' keys under one id; each rank's
    worker then reads its own under that id. The first read must not end the lookup (the
    other rank would read without its pins), the second does."""
    cfg = disk_only.replace(world_size=2)
    tokens = list(range(2 * C))
    rank_spans = [KeyMaker.from_config(cfg, worker_id=r).keys(tokens) for r in (0, 1)]
    both = [s for pair in zip(*rank_spans, strict=True) for s in pair]  # as rank_spans sends
    chunks = [seeded_chunk(i) for i in range(2)]

    async def scenario() -> tuple:
        core = await stored(cfg, rank_spans[0], chunks)
        await core.put(rank_spans[1], [m for m, _ in chunks], [[a for _, a in chunks]])
        await core.flush(10)
        await core.prefetch("tp", both)
        await core.wait("tp", 5)
        first = RetrieveResult.of(await core.get(rank_spans[0], "tp"))
        open_after_first = "tp" in core._index.lookups
        second = RetrieveResult.of(await core.get(rank_spans[1], "tp"))
        return len(first.chunks), open_after_first, len(second.chunks), set(core._index.lookups)

    assert run(scenario) == (2, True, 2, set())


def test_a_start_up_that_raised_is_not_started_and_runs_again(disk_only):
    """A start-up (the index rebuilt from the tiers) that raised leaves the manager not
    started, so its fast paths do not answer from an index never rebuilt; the next call
    starts it again. The background loops run from the first try."""
    calls: list[str] = []

    async def scenario() -> tuple:
        core = ManagerCore(disk_only)
        real = core._t.resync

        async def flaky(tier: str) -> None:
            calls.append(tier)
            if len(calls) == 1:
                raise RuntimeError("the GCS is away")
            await real(tier)

        core._t.resync = flaky  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await core._ready()
        first = (core.started, core._t.loops_spawned)
        await core._ready()
        return first, core.started

    assert run(scenario) == ((False, True), True)


def test_a_peer_that_comes_back_short_has_only_its_gap_read_from_the_remote(disk_only):
    """A get's segments [peer a..b), [remote b..n) are pulled at once; when the peer
    serves less, only its gap is asked of the remote (what follows came already), and
    the get goes on with the remote segment's chunks."""
    from raykv.wire import TIER_REMOTE, CPUAck, PeerTier

    keys = [s.key for s in KeyMaker.from_config(disk_only).keys(list(range(5 * C)))]
    pulls: list[tuple[str, list]] = []

    async def pull(tier: Any, wanted: list, _why: Any) -> CPUAck:
        pulls.append((str(tier), list(wanted)))
        served = wanted[:1] if isinstance(tier, PeerTier) else wanted
        return CPUAck("", refs={k: f"chunk-{keys.index(k)}" for k in served})

    async def scenario() -> RetrieveResult:
        core = ManagerCore(disk_only)

        async def locate(wanted: list, ahead: bool = False) -> tuple[PeerTier, int]:
            return PeerTier("mgr-b"), 2

        core._t.locate_peer = locate
        core._peer_tier_on = lambda: True
        core._index.up = lambda tier: tier == TIER_REMOTE
        core._t.pull = pull
        result = RetrieveResult()
        await core._get_lower(keys, 1, result)
        return result

    result = run(scenario)
    assert pulls == [
        ("peer:mgr-b", keys[1:3]),
        (TIER_REMOTE, keys[3:]),
        (TIER_REMOTE, keys[2:3]),  # the peer's gap, not keys[2:] again
    ]
    assert result.chunks == [f"chunk-{i}" for i in range(1, 5)]
    assert result.tiers == ["peer", "remote", "remote", "remote"]


def test_only_a_lookup_that_pulls_asks_a_peer_ahead(disk_only: RayKVConfig):
    """A count-only lookup never pulls, so it must not ask a peer ahead (the answer kept
    for its pull would hold the peer's objects); a prefetch's and a get's lookups do."""
    spans = KeyMaker.from_config(disk_only).keys(list(range(2 * C)))
    asked: list[tuple[str, bool]] = []

    async def scenario() -> None:
        core = ManagerCore(disk_only)
        core._peer_tier_on = lambda: True

        def recorder(call: str) -> Any:
            async def locate(keys: list, ahead: bool = False) -> None:
                asked.append((call, ahead))

            return locate

        for call, go in (
            ("lookup", lambda: core.lookup(spans)),
            ("fetch", lambda: core.fetch("l1", spans)),
            ("get", lambda: core.get(spans)),
        ):
            core._t.locate_peer = recorder(call)
            await go()

    run(scenario)
    assert asked == [("lookup", False), ("fetch", True), ("get", True)]


def test_a_peer_read_is_answered_on_the_calling_thread_unless_chunks_need_gathering(
    disk_only: RayKVConfig,
):
    """Whole batch objects (the chunks wanted are at least half of each) go as they are,
    from the Ray thread; a chunk that is a small part of its batch needs a new object,
    which only the loop can make."""
    from types import SimpleNamespace

    from raykv_testing import byte_meta

    from raykv.wire import ChunkRef

    keys = [s.key for s in KeyMaker.from_config(disk_only).keys(list(range(3 * C)))]
    meta = byte_meta(8)
    whole, big = object(), object()
    cpu = {
        keys[0]: ChunkRef(whole, 0, meta, batch_nbytes=16),
        keys[1]: ChunkRef(whole, 1, meta, batch_nbytes=16),
        keys[2]: ChunkRef(big, 5, meta, batch_nbytes=80),
    }

    async def scenario() -> tuple:
        core = ManagerCore(disk_only)
        core._index = SimpleNamespace(cpu=cpu)
        core._started = asyncio.get_running_loop().create_future()
        core._started.set_result(None)
        return core.try_peer_read(keys[:2]), core.try_peer_read(keys)

    (metas, objects, places), gathered = run(scenario)
    assert objects == [whole] and places == [(0, 0), (0, 1)] and metas == [meta, meta]
    assert gathered is None
