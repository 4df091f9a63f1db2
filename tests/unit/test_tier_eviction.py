"""Eviction order in the tiers (no Ray): prefix closure across requests, priorities, and
eviction cost that does not grow with the number of pinned or pending entries (#13)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import numpy as np
import pytest
from raykv_testing import FakeRef, byte_meta

from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.budget import ByteBudgetIndex
from raykv.tiers.cpu import CPUStore
from raykv.tiers.disk import DiskStore, record_size

CHUNK = 1000  # bytes per CPU chunk in these tests


def key(conv: int, depth: int) -> CacheKey:
    return CacheKey("m", 1, 0, f"{conv:016x}{depth:016x}", "bfloat16")


def meta(nbytes: int = CHUNK) -> PayloadMeta:
    return byte_meta(nbytes)


def cached_depths(contains, conv: int, depth: int) -> list[int]:
    return [d for d in range(depth) if contains(key(conv, d))]


def assert_prefixes(contains, depths: dict[int, int]) -> None:
    """Every conversation's cached chunks are 0..m-1 for some m (no orphan)."""
    for conv, depth in depths.items():
        held = cached_depths(contains, conv, depth)
        assert held == list(range(len(held))), f"conversation {conv} holds {held}"


# ----- the CPU tier: the actor's put, run without Ray (class unwrapped, ray.put stubbed) -----


def bare_actor(monkeypatch, capacity: int, policy: str = "lru"):
    from raykv.actors import cpu_store as cs

    monkeypatch.setattr(cs, "object_store_bytes", lambda: None)  # no ray.nodes()
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef())
    cls = cs.CPUStoreActor.__ray_metadata__.modified_class
    return cls(capacity, policy, blocking_timeout_secs=0.01, pin_lease_secs=60)


def actor_put(actor, keys: list[CacheKey], arrays=None, metas=None, **kw):
    async def run():
        batch = asyncio.get_running_loop().create_future()
        batch.set_result(arrays if arrays is not None else [np.zeros(CHUNK, np.uint8)] * len(keys))
        return await actor.put(keys, metas or [meta()] * len(keys), [batch], **kw)

    return asyncio.run(run())


def run_turns(store_turn, retrieve, contains, *, convs: int, turns: int, step: int, seed: int):
    """Chats in random interleaving: a turn of a conversation `k` chunks deep retrieves
    its cached prefix 0..hit-1, then `store_turn(conv, hit, k + step)` stores the chunks
    it lacks up to k+step-1; every conversation's cached chunks must be a prefix after
    every operation."""
    rng = random.Random(seed)
    depth = dict.fromkeys(range(convs), 0)
    order = [c for c in range(convs) for _ in range(turns)]
    rng.shuffle(order)
    for conv in order:
        k = depth[conv]
        hit = len(cached_depths(contains, conv, k))
        if hit:
            retrieve(conv, hit)
        store_turn(conv, hit, k + step)
        depth[conv] = k + step
        assert_prefixes(contains, depth)


@pytest.mark.parametrize("policy", ["lru", "slru"])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_multi_turn_chats_keep_their_prefix_when_the_whole_request_is_sent(
    monkeypatch, policy: str, seed: int
) -> None:
    """Regression (#13): the store after a retrieve inserted the new chunks as more recent
    than the touched prefix, so pressure evicted chunks 0..k first (dead weight)."""
    actor = bare_actor(monkeypatch, 12 * CHUNK, policy)
    store = actor._store

    def store_turn(conv, hit, end):  # the client sends the whole request, prefix included
        actor_put(actor, [key(conv, d) for d in range(end)])

    def retrieve(conv, n):
        asyncio.run(actor.release([(None, [key(conv, d) for d in range(n)])]))

    run_turns(store_turn, retrieve, store.__contains__, convs=4, turns=3, step=4, seed=seed)


def test_cpu_multi_turn_keeps_its_prefix_when_only_new_chunks_and_their_prefix_keys_come(
    monkeypatch,
) -> None:
    """A masked store (vLLM saves only the new chunks) names the request's earlier keys."""
    actor = bare_actor(monkeypatch, 12 * CHUNK)

    def store_turn(conv, hit, end):
        new = [key(conv, d) for d in range(hit, end)]
        actor_put(actor, new, prefix=[key(conv, d) for d in range(hit)])

    def retrieve(conv, n):
        asyncio.run(actor.release([(None, [key(conv, d) for d in range(n)])]))

    run_turns(store_turn, retrieve, actor._store.__contains__, convs=4, turns=3, step=4, seed=7)


def test_cpu_put_does_not_evict_its_own_cached_prefix_to_make_room(monkeypatch) -> None:
    actor = bare_actor(monkeypatch, 6 * CHUNK)
    actor_put(actor, [key(0, d) for d in range(4)])  # the oldest batch in the store
    actor_put(actor, [key(1, 0), key(1, 1)])
    ack = actor_put(actor, [key(0, d) for d in range(6)])  # next turn: 2 new chunks
    assert ack.accepted == [key(0, 4), key(0, 5)]
    assert sorted(ack.evicted) == [key(1, 0), key(1, 1)]
    assert all(key(0, d) in actor._store for d in range(6))


def test_cpu_commit_places_a_chain_deepest_first_new_chunks_inserted_cached_ones_touched():
    store = CPUStore(20 * CHUNK)
    first = [key(0, d) for d in range(3)]
    store.commit(FakeRef(), first, [meta()] * 3)
    store.commit(FakeRef(), [key(9, 0)], [meta()])  # another request, more recent
    new = [key(0, d) for d in range(3, 5)]
    store.commit(FakeRef(), new, [meta()] * 2, chain=first + new)
    _, evicted = store.make_room(20 * CHUNK)
    assert evicted == [key(9, 0), *reversed(first + new)]


# ----- the disk tier -----


def disk_chunk() -> tuple[PayloadMeta, np.ndarray]:
    m = PayloadMeta("bfloat16", (2, 2, 16, 32))
    return m, np.zeros(m.nbytes, dtype=np.uint8)


def disk_put(disk: DiskStore, keys: list[CacheKey], **kw):
    m, a = disk_chunk()
    ack = disk.put(keys, [m] * len(keys), [a] * len(keys), **kw)
    assert disk.flush(5)
    return ack


@pytest.fixture
def small_disk(tmp_path: Path):
    m, _ = disk_chunk()
    disk = DiskStore(tmp_path, 12 * record_size(m, key(0, 0)))
    yield disk
    disk.close()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("read_from_disk", [False, True])
def test_disk_multi_turn_chats_keep_their_prefix(
    small_disk: DiskStore, seed: int, read_from_disk: bool
) -> None:
    """Regression (#13): with the prefix served by CPU (no disk read) the next turn's put
    evicted the conversation's own older prefix files to make room for its new chunks."""
    disk = small_disk

    def store_turn(conv, hit, end):
        disk_put(disk, [key(conv, d) for d in range(end)])

    def retrieve(conv, n):
        if read_from_disk:
            disk.get([key(conv, d) for d in range(n)])

    contains = lambda k: disk.contains([k])[0]  # noqa: E731
    run_turns(store_turn, retrieve, contains, convs=4, turns=3, step=4, seed=seed)


def test_disk_multi_turn_keeps_its_prefix_when_only_new_chunks_and_their_prefix_keys_come(
    small_disk: DiskStore,
) -> None:
    disk = small_disk

    def store_turn(conv, hit, end):
        new = [key(conv, d) for d in range(hit, end)]
        disk_put(disk, new, prefix=[key(conv, d) for d in range(hit)])

    def retrieve(conv, n):
        disk.get([key(conv, d) for d in range(n)])

    contains = lambda k: disk.contains([k])[0]  # noqa: E731
    run_turns(store_turn, retrieve, contains, convs=4, turns=3, step=4, seed=11)


def test_budget_places_a_request_in_request_order_whatever_order_its_writes_finish() -> None:
    index = ByteBudgetIndex(10, "lru")
    keys = ["a", "b", "c"]
    for k in keys:
        assert index.reserve(k, 1)[0]
    index.place(keys)
    assert len(index._policy) == 0  # pending writes are not evictable, not even walked
    for k in reversed(keys):  # the deepest write finishes first
        index.commit(k, 1)
    assert len(index._policy) == 3
    assert [index._evict_one()[0] for _ in keys] == ["c", "b", "a"]


def test_budget_spared_chain_is_not_evicted_for_its_own_new_keys() -> None:
    index = ByteBudgetIndex(3, "lru")
    for k in ("p0", "p1", "other"):
        index.reserve(k, 1)
        index.commit(k, 1)
        index.place([k])
    index.spare(["p0", "p1", "new"])
    fits, victims = index.reserve("new", 1)
    assert fits and victims == [("other", 1)]
    index.commit("new", 1)
    index.place(["p0", "p1", "new"], spared=True)
    assert index._spared == {}
    assert [index._evict_one()[0] for _ in range(3)] == ["new", "p1", "p0"]


def test_budget_chain_naming_a_key_twice_spares_it_only_until_placed() -> None:
    """A put whose chain names a key twice (a prefix overlapping its keys, repeated
    spans) spares it once: once placed, it is evictable again (it stayed spared for
    good, and a disk filled with such keys could never make room)."""
    index = ByteBudgetIndex(2, "lru")
    index.reserve("a", 1)
    index.commit("a", 1)
    index.spare(["a", "a"])
    index.place(["a", "a"], spared=True)
    assert index._spared == {}
    index.reserve("b", 1)
    index.commit("b", 1)
    index.place(["b"])
    assert index.reserve("c", 1) == (True, [("a", 1)])


# ----- priorities -----


def test_cpu_priority_policy_evicts_a_low_priority_chunk_before_an_earlier_high_one(
    monkeypatch,
) -> None:
    actor = bare_actor(monkeypatch, 2 * CHUNK, "priority")
    actor_put(actor, [key(0, 0)], priority=10)
    actor_put(actor, [key(1, 0)], priority=1)  # more recent, but less important
    ack = actor_put(actor, [key(2, 0)], priority=5)
    assert ack.evicted == [key(1, 0)] and key(0, 0) in actor._store


def test_cpu_priority_survives_a_pin_and_unpin() -> None:
    store = CPUStore(2 * CHUNK, "priority")
    store.commit(FakeRef(), [key(0, 0)], [meta()], priority=10)
    store.pin("L", [key(0, 0)])
    store.commit(FakeRef(), [key(1, 0)], [meta()], priority=1)
    store.unpin("L")  # back in the policy: with its priority, not the default
    assert store.make_room(CHUNK) == (True, [key(1, 0)])


def test_disk_priority_policy_evicts_a_low_priority_chunk_before_an_earlier_high_one(
    tmp_path: Path,
) -> None:
    m, _ = disk_chunk()
    disk = DiskStore(tmp_path, 2 * record_size(m, key(0, 0)), policy="priority")
    try:
        disk_put(disk, [key(0, 0)], priority=10)
        disk_put(disk, [key(1, 0)], priority=1)
        ack = disk_put(disk, [key(2, 0)], priority=5)
        assert ack.evicted == [key(1, 0)] and disk.contains([key(0, 0)]) == [True]
    finally:
        disk.close()


def test_an_invalid_priority_is_refused_before_anything_changes(tmp_path: Path) -> None:
    from raykv.errors import InvalidInputError

    store = CPUStore(2 * CHUNK, "priority")
    with pytest.raises(InvalidInputError):
        store.commit(FakeRef(), [key(0, 0)], [meta()], priority=float("nan"))
    assert len(store) == 0 and store.used_bytes == 0


# ----- eviction cost does not depend on how many entries are pinned or pending -----

PINNED = 100_000
VICTIMS = 100


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "sieve"])
def test_eviction_cost_does_not_grow_with_pinned_entries(policy: str) -> None:
    """Regression (#13): evict scanned the pinned keys from the old end for every victim
    (100k oldest pinned: 7.9 ms a victim with LRU, 45 ms with S3-FIFO)."""
    store = CPUStore((PINNED + 2 * VICTIMS) * CHUNK, policy)
    pinned = [key(0, d) for d in range(PINNED)]
    m = meta()
    for i in range(0, PINNED, 1000):  # the oldest entries, in batches of 1000
        store.commit(FakeRef(), pinned[i : i + 1000], [m] * 1000)
    assert store.pin("L", pinned) == PINNED
    for d in range(2 * VICTIMS):  # unpinned, newer, one chunk per batch
        store.commit(FakeRef(), [key(1, d)], [m])
    assert store.free_bytes == 0
    t0 = time.perf_counter()
    fits, evicted = store.make_room(VICTIMS * CHUNK)
    took = time.perf_counter() - t0
    assert fits and len(evicted) == VICTIMS and not set(evicted) & set(pinned[:10])
    assert took < 0.020, f"{policy}: {took * 1000:.1f} ms for {VICTIMS} victims"
    store.unpin("L")  # the pinned entries come back, evictable again
    fits, evicted = store.make_room(store.capacity)
    assert fits and len(store) == 0


def test_budget_eviction_cost_does_not_grow_with_pending_writes() -> None:
    pending = 20_000
    index = ByteBudgetIndex(pending + 2 * VICTIMS, "lru")
    for i in range(pending):  # admitted and placed, their writes still running
        index.reserve(("pending", i), 1)
    index.place([("pending", i) for i in range(pending)])
    for i in range(2 * VICTIMS):
        index.reserve(("done", i), 1)
        index.commit(("done", i), 1)
        index.place([("done", i)])
    t0 = time.perf_counter()
    victims = [index.reserve(("new", i), 1)[1] for i in range(VICTIMS)]
    took = time.perf_counter() - t0
    assert all(len(v) == 1 and v[0][0][0] == "done" for v in victims)
    assert took < 0.020, f"{took * 1000:.1f} ms for {VICTIMS} victims"


def test_unpinned_batches_come_back_as_most_recent_in_request_order() -> None:
    store = CPUStore(10 * CHUNK)
    a = [key(0, d) for d in range(2)]
    b = [key(0, d) for d in range(2, 4)]
    store.commit(FakeRef(), a, [meta()] * 2)
    store.commit(FakeRef(), b, [meta()] * 2, chain=a + b)
    store.commit(FakeRef(), [key(5, 0)], [meta()])
    store.pin("L", a + b)
    store.unpin("L")
    _, evicted = store.make_room(10 * CHUNK)
    assert evicted == [key(5, 0), *reversed(a + b)]
