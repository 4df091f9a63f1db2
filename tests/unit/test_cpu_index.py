"""The CPU tier's plain index (`CPUStore`) without Ray: budget, batches, pins, leases, touches."""

from __future__ import annotations

import pytest

from raykv.actors.cpu_store import CPUStore
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta

CHUNK = 1000  # bytes per chunk in these tests


def key(i: int) -> CacheKey:
    return CacheKey("m", 1, 0, f"{i:032x}", "bfloat16")


def meta(nbytes: int = CHUNK) -> PayloadMeta:
    return PayloadMeta("uint8", (2, 1, 1, nbytes // 2))


class FakeRef:
    """Stands in for an ObjectRef."""

    def __init__(self, name: str) -> None:
        self.name = name


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


def test_clear_empties_everything():
    store = CPUStore(4 * CHUNK)
    put(store, [0, 1])
    store.pin("L", [key(0)])
    store.clear()
    assert len(store) == 0 and store.used_bytes == 0 and store.stats()["leases"] == 0
    assert store.unpin("L") == 0


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
