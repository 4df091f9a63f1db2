"""The CPU tier's plain index (`CPUStore`) without Ray: budget, batches, pins, leases, touches."""

from __future__ import annotations

import pytest
from raykv_testing import FakeRef, byte_meta, chunk_key

from raykv.payload import PayloadMeta
from raykv.tiers.cpu import CPUStore

CHUNK = 1000  # bytes per chunk in these tests


key = chunk_key


def meta(nbytes: int = CHUNK) -> PayloadMeta:
    return byte_meta(nbytes)


def put(store: CPUStore, ids: list[int], name: str = "b", **kw) -> dict:
    """Allocate and commit one batch holding chunks `ids` (no waiting, all or nothing)."""
    keys = [key(i) for i in ids if key(i) not in store]
    n, evicted = store.allocate([CHUNK] * len(keys), partial=False)
    assert n == len(keys), "test setup: no room"
    return store.commit(FakeRef(name), keys, [meta()] * n, reserved=n * CHUNK, **kw)


def test_commit_indexes_chunks_of_one_batch_with_their_positions():
    store = CPUStore(10 * CHUNK)
    refs = put(store, [0, 1, 2])
    assert [refs[key(i)].index for i in range(3)] == [0, 1, 2]
    assert len({id(c.ref) for c in refs.values()}) == 1
    assert store.used_bytes == store.live_bytes == 3 * CHUNK
    assert store.reserved_bytes == 0 and store.stats()["batches"] == 1


def test_second_put_of_a_key_keeps_the_first():
    store = CPUStore(10 * CHUNK)
    first = put(store, [0])[key(0)]
    again = store.commit(FakeRef("again"), [key(0)], [meta()])
    assert again == {} and store.chunk_refs([key(0)]) == [first]
    assert store.used_bytes == CHUNK


def test_batch_bytes_stay_charged_until_its_last_chunk_is_evicted():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1, 2], "a")
    store.remove([key(1), key(2)])
    assert store.live_bytes == CHUNK and store.used_bytes == 3 * CHUNK  # physical
    assert store.stats()["fragmentation"] == pytest.approx(2 / 3)
    store.remove([key(0)])
    assert store.used_bytes == 0 and store.stats()["batches"] == 0


def test_eviction_frees_room_by_policy_and_reports_victims():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1], "a")
    put(store, [2, 3], "b")
    n, evicted = store.allocate([2 * CHUNK], partial=False)
    assert n == 1
    # Batch "a" was inserted first; deeper chunk 1 goes before its prefix 0.
    assert evicted == [key(1), key(0)]
    assert store.used_bytes + store.reserved_bytes == 4 * CHUNK


def test_pinned_entries_are_never_evicted():
    store = CPUStore(3 * CHUNK)
    put(store, [0, 1, 2])
    assert store.pin("L1", [key(0), key(1), key(2)]) == 3
    n, evicted = store.allocate([CHUNK], partial=False)
    assert n == 0 and evicted == []
    assert all(k in store for k in map(key, range(3)))
    store.unpin("L1")
    n, evicted = store.allocate([CHUNK], partial=False)
    assert n == 1 and evicted  # now it fits


def test_partial_allocation_takes_the_longest_prefix_that_fits():
    store = CPUStore(5 * CHUNK)
    put(store, [0, 1, 2])
    store.pin("L", [key(0), key(1), key(2)])
    n, _ = store.allocate([CHUNK, CHUNK, CHUNK], partial=True)
    assert n == 2 and store.reserved_bytes == 2 * CHUNK


def test_request_larger_than_capacity_evicts_nothing():
    store = CPUStore(3 * CHUNK)
    put(store, [0])
    n, evicted = store.allocate([4 * CHUNK], partial=True)
    assert n == 0 and evicted == [] and key(0) in store


def test_a_lease_pins_until_its_deadline():
    now = [0.0]
    store = CPUStore(2 * CHUNK, lease_secs=10, clock=lambda: now[0])
    put(store, [0, 1])
    store.pin("dead-client", [key(0), key(1)])
    now[0] = 9.9
    assert store.expire_leases() == [] and store.pins(key(0)) == 1
    now[0] = 10.0
    assert store.expire_leases() == ["dead-client"]
    assert store.pins(key(0)) == 0 and store.stats()["leases"] == 0


def test_unpin_after_evict_and_readd_does_not_unpin_the_new_entry():
    store = CPUStore(4 * CHUNK)
    put(store, [0])
    store.pin("L", [key(0)])
    store.remove([key(0)])
    put(store, [0], "again")
    store.pin("M", [key(0)])
    store.unpin("L")
    assert store.pins(key(0)) == 1


def test_commit_with_lookup_id_pins_the_new_entries():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1], lookup_id="prefetch")
    assert store.pins(key(0)) == store.pins(key(1)) == 1
    assert store.unpin("prefetch") == 2


def test_prefix_closed_touch_evicts_deeper_chunks_first():
    """After touching a request's hits, its chunks leave deepest first: the cache stays
    prefix-closed (every cached chunk's parent is cached)."""
    store = CPUStore(6 * CHUNK)
    for i in range(6):  # one chunk per batch, inserted in order 0..5
        put(store, [i], f"b{i}")
    store.touch([key(0), key(1), key(2)])  # request hit chunks 0..2
    evicted = []
    for n in range(1, 7):
        _, ev = store.make_room(n * CHUNK)  # one more chunk each round
        evicted += ev
        remaining = [i for i in range(6) if key(i) in store]
        hit_chain = [i for i in remaining if i <= 2]
        assert hit_chain == list(range(len(hit_chain)))  # prefix of 0..2 survives
    assert evicted == [key(i) for i in (3, 4, 5, 2, 1, 0)]


def test_clear_empties_everything_and_lets_each_batch_go_once():
    released = []
    store = CPUStore(4 * CHUNK, on_release=lambda ref, n: released.append((ref.name, n)))
    put(store, [0, 1], "a")
    put(store, [2], "b")
    store.pin("L", [key(0)])
    store.clear()
    assert len(store) == 0 and store.used_bytes == 0 and store.stats()["leases"] == 0
    assert store.unpin("L") == 0
    assert sorted(released) == [("a", 2 * CHUNK), ("b", CHUNK)]  # the handout hold's cue


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "sieve", "lfu"])
def test_budget_holds_under_churn_with_any_policy(policy):
    store = CPUStore(8 * CHUNK, policy)
    for r in range(50):
        ids = [100 * r + j for j in range(3)]
        n, _ = store.allocate([CHUNK] * 3, partial=False)
        assert n == 3
        store.commit(FakeRef(str(r)), [key(i) for i in ids], [meta()] * 3, reserved=3 * CHUNK)
        assert store.used_bytes <= store.capacity
        assert store.live_bytes <= store.used_bytes


# ----- pins that race their unpin (the manager sends both without waiting) -----


def test_a_pin_arriving_after_its_unpin_leaves_no_lease():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1])
    assert store.unpin("late") == 0  # the release overtook the pin
    assert store.pin("late", [key(0), key(1)]) == 0
    assert store.pins(key(0)) == 0 and store.stats()["leases"] == 0
    # a prefetch's pinning commit that lands after its release pins nothing either
    put(store, [2], lookup_id="late")
    assert store.pins(key(2)) == 0 and store.stats()["leases"] == 0


def test_closed_lookup_ids_are_forgotten_after_their_retention():
    now = [0.0]
    store = CPUStore(4 * CHUNK, lease_secs=10, clock=lambda: now[0])
    put(store, [0])
    store.unpin("a")
    now[0] = 5.0
    store.unpin("b")
    now[0] = 10.0
    store.expire_leases()
    assert not store.is_closed("a") and store.is_closed("b")
    assert store.pin("a", [key(0)]) == 1  # long forgotten: an ordinary pin again
    now[0] = 15.0
    store.expire_leases()  # "b" forgotten; "a" pinned until 20
    assert store.stats()["closed_lookups"] == 0 and store.pins(key(0)) == 1
    now[0] = 20.0
    assert store.expire_leases() == ["a"]  # expired, and closed again
    assert store.is_closed("a") and store.pins(key(0)) == 0


# ----- pressure with partly pinned batches: memory is charged per batch -----


def test_siblings_of_a_pinned_chunk_are_not_evicted_for_nothing():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1], "a")
    put(store, [2, 3], "b")
    store.pin("L", [key(0)])
    store.pin("M", [key(2)])
    # Evicting 1 and 3 would free no byte (their batches stay alive): evict nothing.
    n, evicted = store.allocate([CHUNK], partial=False)
    assert (n, evicted) == (0, [])
    n, evicted = store.allocate([CHUNK], partial=True)
    assert (n, evicted) == (0, [])
    assert all(k in store for k in map(key, range(4)))
    assert store.stats()["pinned_bytes"] == 4 * CHUNK


def test_pressure_evicts_only_unpinned_batches():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1], "a")  # oldest
    put(store, [2, 3], "b")
    store.pin("L", [key(0)])
    n, evicted = store.allocate([2 * CHUNK], partial=False)
    # LRU would pick 1 first, but its batch is pinned through 0: batch b goes.
    assert n == 1 and evicted == [key(3), key(2)]
    assert key(1) in store and store.used_bytes + store.reserved_bytes == 4 * CHUNK
    store.unpin("L")
    assert store.pinned_bytes == 0


def test_partial_allocation_evicts_only_for_what_it_takes():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1], "a")
    put(store, [2], "b")
    put(store, [3], "c")
    store.pin("L", [key(1)])
    n, evicted = store.allocate([CHUNK, CHUNK, CHUNK], partial=True)
    assert n == 2 and sorted(evicted) == [key(2), key(3)] and key(0) in store


def test_removing_a_pinned_chunk_releases_its_batch_bytes():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1])
    store.pin("L", [key(0)])
    store.remove([key(0), key(1)])
    assert store.used_bytes == 0 and store.pinned_bytes == 0
    store.unpin("L")
    assert store.pinned_bytes == 0 and store.allocate([4 * CHUNK], partial=False)[0] == 1


# ----- accounting -----


def test_a_key_repeated_in_one_commit_is_indexed_once_and_its_batch_can_go():
    store = CPUStore(4 * CHUNK)
    n, _ = store.allocate([CHUNK, CHUNK], partial=False)
    added = store.commit(
        FakeRef("dup"),
        [key(0), key(0)],
        [meta(), meta()],
        batch_bytes=2 * CHUNK,
        reserved=2 * CHUNK,
    )
    assert list(added) == [key(0)] and added[key(0)].index == 0
    assert store.used_bytes == 2 * CHUNK  # the physical size given
    store.remove([key(0)])
    assert store.used_bytes == 0 and store.stats()["batches"] == 0


# ----- the actor's put logic, run without Ray (its class unwrapped, ray.put stubbed) -----


def _bare_actor(monkeypatch, capacity: int):
    from raykv.actors import cpu_store as cs

    monkeypatch.setattr(cs, "object_store_bytes", lambda: None)  # no ray.nodes()
    cls = cs.CPUStoreActor.__ray_metadata__.modified_class
    return cs, cls(capacity, "lru", blocking_timeout_secs=0.05, pin_lease_secs=60)


def _put_by_value(actor, ids: list[int]):
    import asyncio

    import numpy as np

    async def run():
        batch = asyncio.get_running_loop().create_future()
        batch.set_result([np.zeros(CHUNK, dtype=np.uint8) for _ in ids])
        return await actor.put([key(i) for i in ids], [meta()] * len(ids), [batch])

    return asyncio.run(run())


def test_a_failed_reput_still_reports_its_evictions_and_releases_its_room(monkeypatch):
    cs, actor = _bare_actor(monkeypatch, 2 * CHUNK)
    store = actor._store
    put(store, [0, 1])  # an unpinned batch that must go to make room

    def refuse(value):
        raise MemoryError("object store full")

    monkeypatch.setattr(cs.ray, "put", refuse)
    ack = _put_by_value(actor, [5, 6])
    assert sorted(ack.evicted) == [key(0), key(1)]  # the manager must drop these
    assert ack.skipped == [key(5), key(6)] and ack.accepted == []
    assert store.reserved_bytes == 0 and store.used_bytes == 0 and len(store) == 0


def test_put_accepts_what_it_committed_and_charges_the_object_size(monkeypatch):
    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef("own copy"))
    ack = _put_by_value(actor, [0, 1, 0])  # a repeated key is cached once
    assert ack.accepted == [key(0), key(1)] and ack.refs[key(0)].index == 0
    assert actor._store.used_bytes == 2 * CHUNK and actor._store.reserved_bytes == 0


def test_a_put_waiting_for_room_proceeds_when_another_puts_reservation_ends(monkeypatch):
    """A put that found the room reserved by another put in flight waits; that put's
    commit makes its bytes evictable and must wake the waiter (it slept out its whole
    `blocking_timeout_secs`: the commit evicted nothing, and only evictions woke it)."""
    import asyncio
    import threading
    import time

    import numpy as np

    cs, actor = _bare_actor(monkeypatch, 3 * CHUNK)
    actor._timeout = 5.0
    from raykv.actors import common

    monkeypatch.setattr(common, "THREAD_PUT_BYTES", 0)  # every ray.put on a thread
    first_in = threading.Event()

    def slow_put(value):
        first_in.set()
        time.sleep(0.3)  # the first put holds its reservation meanwhile
        return FakeRef("own copy")

    monkeypatch.setattr(cs.ray, "put", slow_put)

    async def put_ids(ids):
        batch = asyncio.get_running_loop().create_future()
        batch.set_result([np.zeros(CHUNK, dtype=np.uint8) for _ in ids])
        return await actor.put([key(i) for i in ids], [meta()] * len(ids), [batch])

    async def run():
        first = asyncio.create_task(put_ids([0, 1]))
        while not first_in.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        second = await put_ids([2, 3])
        return await first, second, time.monotonic() - t0

    first, second, waited = asyncio.run(run())
    assert first.accepted == [key(0), key(1)] and second.accepted == [key(2), key(3)]
    assert waited < 2.0, f"the second put slept {waited:.1f} s"


def _slow_puts(monkeypatch, cs, seconds: float):
    """Every ray.put runs on a thread and takes `seconds`; the event is set at its start."""
    import threading
    import time

    from raykv.actors import common

    monkeypatch.setattr(common, "THREAD_PUT_BYTES", 0)
    started = threading.Event()

    def slow_put(value):
        started.set()
        time.sleep(seconds)
        return FakeRef(f"own copy of {len(value)}")

    monkeypatch.setattr(cs.ray, "put", slow_put)
    return started


def _during_a_slow_put(monkeypatch, actor, cs, ids, then):
    """Put `ids` with a ray.put that takes 0.2 s; once it runs, await `then()`. (The
    put's ack, what `then` returned.)"""
    import asyncio

    started = _slow_puts(monkeypatch, cs, 0.2)

    async def run():
        put = asyncio.create_task(_put_ids(actor, ids))
        while not started.is_set():
            await asyncio.sleep(0.01)
        meanwhile = await then()
        return await put, meanwhile

    return asyncio.run(run())


async def _put_ids(actor, ids):
    import asyncio

    import numpy as np

    batch = asyncio.get_running_loop().create_future()
    batch.set_result([np.zeros(CHUNK, dtype=np.uint8) for _ in ids])
    return await actor.put([key(i) for i in ids], [meta()] * len(ids), [batch])


def test_concurrent_puts_of_a_shared_prefix_copy_and_charge_it_once(monkeypatch):
    """Two requests storing one new system prompt at once: the second copied and charged
    the shared chunks again (its object's bytes counted until its last chunk went)."""
    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    first, second = _during_a_slow_put(
        monkeypatch, actor, cs, [0, 1], lambda: _put_ids(actor, [0, 1, 2])
    )
    store = actor._store
    assert first.accepted == [key(0), key(1)] and second.accepted == [key(2)]
    assert set(second.present) == {key(0), key(1)}
    assert store.used_bytes == store.live_bytes == 3 * CHUNK and store.reserved_bytes == 0


def test_a_put_in_flight_keeps_its_prefix_from_other_puts_evictions(monkeypatch):
    """While a put's copy ran, another put could evict the prefix it was adding to: its
    new chunk then entered with no parent, dead weight until evicted."""
    cs, actor = _bare_actor(monkeypatch, 3 * CHUNK)
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef("own copy"))
    put(actor._store, [0], "a")  # the older: LRU's first victim
    put(actor._store, [9], "other")
    first, second = _during_a_slow_put(monkeypatch, actor, cs, [0, 1], lambda: _put_ids(actor, [5]))
    assert first.accepted == [key(1)] and second.accepted == [key(5)]
    assert second.evicted == [key(9)] and key(0) in actor._store
    assert not actor._store._held


def test_a_put_that_cannot_fit_takes_what_fits_at_once(monkeypatch):
    """More than the tier can ever hold: it waited out `blocking_timeout_secs` first."""
    import asyncio
    import time

    cs, actor = _bare_actor(monkeypatch, 2 * CHUNK)
    actor._timeout = 5.0
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef("own copy"))
    t0 = time.monotonic()
    ack = asyncio.run(_put_ids(actor, [0, 1, 2]))
    assert time.monotonic() - t0 < 1.0
    assert ack.accepted == [key(0), key(1)] and ack.skipped == [key(2)]


def test_a_key_removed_while_its_put_copies_is_not_cached(monkeypatch):
    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    ack, _ = _during_a_slow_put(monkeypatch, actor, cs, [0, 1], lambda: actor.remove([key(1)]))
    store = actor._store
    assert ack.accepted == [key(0)] and key(1) not in ack.present and key(1) not in store
    assert store.reserved_bytes == 0 and store.live_bytes == CHUNK
    assert not actor._copying and not actor._cancelled


def test_a_key_removed_while_a_peer_copy_runs_is_not_cached(monkeypatch):
    import asyncio

    import numpy as np

    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    started = _slow_puts(monkeypatch, cs, 0.2)

    async def run():
        peer = asyncio.get_running_loop().create_future()
        peer.set_result([np.zeros(CHUNK, np.uint8), np.zeros(CHUNK, np.uint8)])
        keys = [key(0), key(1)]
        adopt = asyncio.create_task(actor.adopt(keys, [meta()] * 2, [(peer, 0), (peer, 1)]))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await actor.remove([key(0)])
        return await adopt

    ack = asyncio.run(run())
    assert ack.accepted == [key(1)] and key(0) not in actor._store
    assert actor._store.chunk_refs([key(1)])[0].index == 1  # its place in the copy


# ----- payloads whose size is not their meta's (#13 defect 4) -----


def test_put_skips_arrays_whose_size_is_not_their_metas_and_caches_the_rest(monkeypatch):
    import asyncio

    import numpy as np

    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef("own copy"))
    arrays = [np.zeros(CHUNK, np.uint8), np.zeros(CHUNK // 2, np.uint8), "not an array"]

    async def run():
        batch = asyncio.get_running_loop().create_future()
        batch.set_result(arrays)
        return await actor.put([key(0), key(1), key(2)], [meta()] * 3, [batch])

    ack = asyncio.run(run())
    assert ack.accepted == [key(0)] and ack.skipped == [key(1), key(2)]
    assert key(1) not in actor._store and key(2) not in actor._store
    assert actor._store.used_bytes == CHUNK and actor._store.reserved_bytes == 0
    assert actor._store.stats()["skipped"] == 2


def test_put_with_fewer_metas_than_keys_skips_the_unmatched_keys(monkeypatch):
    import asyncio

    import numpy as np

    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef("own copy"))

    async def run():
        batch = asyncio.get_running_loop().create_future()
        batch.set_result([np.zeros(CHUNK, np.uint8)] * 2)
        return await actor.put([key(0), key(1)], [meta()], [batch])

    ack = asyncio.run(run())
    assert ack.accepted == [key(0)] and ack.skipped == [key(1)]


class _FakeSource:
    """`get_batch.options(num_returns=2).remote(keys)` answering two ready futures."""

    def __init__(self, metas, arrays) -> None:
        self.answer = (metas, arrays)
        self.get_batch = self

    def options(self, **_):
        return self

    def remote(self, keys):
        import asyncio

        loop = asyncio.get_running_loop()
        futures = [loop.create_future(), loop.create_future()]
        for fut, value in zip(futures, self.answer, strict=True):
            fut.set_result(value)
        return futures


def test_pull_treats_a_wrong_sized_array_as_a_miss_and_caches_the_rest(monkeypatch):
    import asyncio

    import numpy as np

    cs, actor = _bare_actor(monkeypatch, 8 * CHUNK)
    monkeypatch.setattr(cs.ray, "put", lambda value: FakeRef("own copy"))
    source = _FakeSource([meta()] * 3, [np.zeros(CHUNK, np.uint8), np.zeros(7, np.uint8), None])
    keys = [key(0), key(1), key(2)]
    ack = asyncio.run(actor.pull(source, keys))
    assert ack.accepted == [key(0)] and set(ack.refs) == {key(0)}
    assert ack.missing == [key(1), key(2)] and ack.skipped == [key(1), key(2)]
    # A source object holding bad arrays is not kept: the store keeps a copy of the good.
    assert actor._store.used_bytes == CHUNK and actor._store.stats()["skipped"] == 2


def test_a_chain_held_by_a_put_in_flight_is_spared_until_dropped():
    """Another put does not wait for a held chain (two puts could wait for each other's
    for the whole blocking timeout): it takes what fits at once."""
    store = CPUStore(2 * CHUNK)
    put(store, [0], "a")
    held = store.hold_chain([key(0), key(7)])  # key 7: not cached, nothing to hold
    assert store.allocate([2 * CHUNK], partial=False) == (0, [])
    assert not store.could_fit(2 * CHUNK)
    store.clear()
    assert not store._held  # a cleared tier holds nothing for anyone
    put(store, [0], "a")
    held = store.hold_chain([key(0)])
    store.drop_chain(held)
    assert store.allocate([2 * CHUNK], partial=False) == (1, [key(0)])
    assert not store._held
