"""CPUStoreActor on a real Ray: ownership, byte-exact reads, pressure, leases, pulls."""

from __future__ import annotations

import asyncio
import functools
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
import ray
import raykv_testing
from raykv_testing import byte_meta, chunk_key

from raykv.actors.cpu_store import CPUStoreActor
from raykv.actors.peers import read_peer
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta

pytestmark = pytest.mark.usefixtures("ray_session")
# Workers cannot import test modules: ship this module's actors and helpers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(raykv_testing)  # its factories travel with us too

NBYTES = 64 << 10


key = functools.partial(chunk_key, model="cpu-test")


def payload(k: CacheKey, nbytes: int = NBYTES) -> np.ndarray:
    """The bytes of a chunk are a function of its key, so every hit can be checked."""
    return np.random.default_rng(int(k.chunk_hash[-15:], 16)).integers(
        0, 256, nbytes, dtype=np.uint8
    )


def meta(nbytes: int = NBYTES) -> PayloadMeta:
    return byte_meta(nbytes)


def read(chunks) -> list[np.ndarray]:
    refs = list({c.ref for c in chunks})
    values = dict(zip(refs, ray.get(refs), strict=True))
    return [values[c.ref][c.index] for c in chunks]


def assert_bytes(keys, chunks) -> None:
    assert len(chunks) == len(keys)
    for k, arr in zip(keys, read(chunks), strict=True):
        assert np.array_equal(arr, payload(k)), f"wrong bytes for {k}"


@pytest.fixture
def store():
    handle = CPUStoreActor.options(num_cpus=0).remote(
        8 * NBYTES, "lru", blocking_timeout_secs=0.5, pin_lease_secs=60
    )
    yield handle
    ray.kill(handle)


def put(handle, ids: list[int], **kw):
    keys = [key(i) for i in ids]
    ref = ray.put([payload(k) for k in keys])
    return ray.get(handle.put.remote(keys, [meta()] * len(keys), [ref], **kw))


@ray.remote(num_cpus=0)
class Writer:
    """A client that stores a batch and then goes away."""

    def store(self, handle, ids: list[int]):
        return put(handle, ids)


@ray.remote(num_cpus=0)
class Producer:
    """Stands in for a GPU worker or lower tier: `get_batch` with two returns."""

    @ray.method(num_returns=2)
    def get_batch(self, keys):
        return [meta() for _ in keys], [payload(k) for k in keys]

    def peer_read(self, keys):
        """A peer manager's read: one object of ours holding every chunk."""
        return _peer_reply(keys, [payload(k) for k in keys])


def _peer_reply(keys, arrays):
    """`(metas, objects, places)` as `StorageManager.peer_read` answers: one object."""
    return [meta() for _ in keys], [ray.put(arrays)], [(0, i) for i in range(len(keys))]


def test_put_reads_back_byte_for_byte_and_first_put_wins(store):
    ack = put(store, [0, 1, 2])
    assert ack.accepted == [key(0), key(1), key(2)]
    assert_bytes(ack.accepted, [ack.refs[k] for k in ack.accepted])
    # One re-put object per request, not one per chunk.
    assert len({c.ref for c in ack.refs.values()}) == 1
    again = put(store, [2, 3])
    assert again.present == [key(2)] and again.accepted == [key(3)]
    assert again.refs[key(2)] == ack.refs[key(2)]


def test_data_outlives_the_writer(store):
    writer = Writer.remote()
    ray.get(writer.store.remote(store, [10, 11]))
    ray.kill(writer)
    time.sleep(0.5)
    refs = ray.get(store.chunk_refs.remote([key(10), key(11)]))
    assert_bytes([key(10), key(11)], refs)


def test_pulled_data_is_owned_by_the_store_and_outlives_the_producer(store):
    producer = Producer.remote()
    ack = ray.get(store.pull.remote(producer, [key(20), key(21)]))
    assert ack.accepted == [key(20), key(21)]
    ray.kill(producer)
    time.sleep(0.5)
    assert_bytes([key(20), key(21)], ray.get(store.chunk_refs.remote([key(20), key(21)])))


def peer_pull(store, peer, keys: list[CacheKey]) -> tuple[Any, Any]:
    """What a manager does with a peer's chunks: `read_peer` (served from the peer's
    objects), then its CPU store's `adopt` of what was served. (read ack, adopt ack)."""
    ack, metas = asyncio.run(read_peer(peer, keys))
    if not ack.refs:
        return ack, None
    where = [(c.ref, c.index) for c in ack.refs.values()]
    return ack, ray.get(store.adopt.remote(list(ack.refs), metas, where))


def test_a_peer_read_serves_the_peers_object_and_adopt_caches_a_copy_of_the_new_chunks(store):
    producer = Producer.remote()
    try:
        put(store, [30])
        keys = [key(30), key(31), key(32)]
        ack, metas = asyncio.run(read_peer(producer, keys))
        # Served from the peer's one object, nothing cached by the read.
        assert not ack.missing and len({c.ref for c in ack.refs.values()}) == 1
        assert_bytes(keys, [ack.refs[k] for k in keys])
        where = [(c.ref, c.index) for c in ack.refs.values()]
        copied = ray.get(store.adopt.remote(keys, metas, where))
        assert copied.accepted == [key(31), key(32)] and copied.present == [key(30)]
        stats = ray.get(store.stats.remote())
        assert stats["reserved_bytes"] == 0
        # The copy holds the two new chunks (2 x 64 KiB charged), not the whole reply.
        assert stats["used_bytes"] == 3 * NBYTES
        ray.kill(producer)  # the owner of the peer's object: our copy outlives it
        time.sleep(0.5)
        assert_bytes(keys, ray.get(store.chunk_refs.remote(keys)))
    finally:
        ray.kill(producer)


def test_a_chunk_another_adopt_is_still_copying_is_not_copied_twice(store):
    producer = Producer.remote()
    try:
        keys = [key(33), key(34)]
        ack, metas = asyncio.run(read_peer(producer, keys))
        where = [(c.ref, c.index) for c in ack.refs.values()]
        acks = ray.get([store.adopt.remote(keys, metas, where) for _ in range(2)])
        # One copy, whichever adopt came first: the other one left the keys to it.
        assert sorted(len(a.accepted) for a in acks) == [0, 2]
        assert ray.get(store.stats.remote())["used_bytes"] == 2 * NBYTES
    finally:
        ray.kill(producer)


class _Fragile:
    """Pickles once: after one round trip it refuses to be pickled again."""

    nbytes = NBYTES  # the size its meta declares: it passes the store's size check

    def __init__(self) -> None:
        self.copied = False

    def __getstate__(self) -> dict:
        if self.copied:
            raise TypeError("this object cannot be pickled twice")
        return {"copied": True}


class _Unreadable:
    """Pickles, but cannot be unpickled: a source object nobody can read."""

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("this object cannot be read")


@ray.remote(num_cpus=0)
class OddProducer:
    """A peer whose metas are fine but whose arrays are `kind` objects."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def peer_read(self, keys):
        cls = _Fragile if self.kind == "fragile" else _Unreadable
        return _peer_reply(keys, [cls() for _ in keys])


def _odd_peer_pull(store, kind: str, keys: list[CacheKey]) -> tuple[Any, Any, dict]:
    """`peer_pull` of `keys` from an `OddProducer(kind)`: (read ack, adopt ack, stats)."""
    producer = OddProducer.remote(kind)
    try:
        ack, copied = peer_pull(store, producer, keys)
        return ack, copied, ray.get(store.stats.remote())
    finally:
        ray.kill(producer)


def test_a_peer_read_whose_object_is_unreadable_is_a_miss(store):
    keys = [key(40), key(41)]
    ack, copied, stats = _odd_peer_pull(store, "unreadable", keys)
    assert ack.missing == keys and not ack.refs and copied is None
    assert stats["entries"] == 0 and stats["reserved_bytes"] == 0


def test_a_peer_read_whose_copy_fails_serves_the_peers_object_uncached(store):
    keys = [key(50), key(51)]
    ack, copied, _ = _odd_peer_pull(store, "fragile", keys)
    assert not ack.missing and set(ack.refs) == set(keys)
    assert copied.skipped == keys and not copied.accepted and not copied.refs
    stats = ray.get(store.stats.remote())
    assert stats["entries"] == 0 and stats["reserved_bytes"] == 0
    assert stats["used_bytes"] == 0


def test_all_pinned_put_gives_up_after_the_timeout_and_evicts_nothing(store):
    put(store, list(range(8)))
    assert ray.get(store.pin.remote("L", [key(i) for i in range(8)])) == 8
    t0 = time.monotonic()
    ack = put(store, [100, 101])
    took = time.monotonic() - t0
    assert ack.accepted == [] and ack.skipped == [key(100), key(101)] and ack.evicted == []
    assert 0.4 < took < 3.0
    assert ray.get(store.contains.remote([key(i) for i in range(8)])) == [True] * 8
    assert ray.get(store.stats.remote())["skipped"] == 2


def test_a_waiting_put_proceeds_when_an_unpin_frees_room(store):
    put(store, list(range(8)))
    ray.get(store.pin.remote("L", [key(i) for i in range(8)]))
    keys = [key(200)]
    ref = ray.put([payload(keys[0])])
    pending = store.put.remote(keys, [meta()], [ref])
    time.sleep(0.1)
    ray.get(store.unpin.remote("L"))  # async actor: served while the put waits
    ack = ray.get(pending)
    # The 8 chunks share one batch object: its bytes come back only when all 8 go.
    assert ack.accepted == keys and len(ack.evicted) == 8


def test_a_lease_releases_pins_of_a_client_that_never_comes_back():
    handle = CPUStoreActor.options(num_cpus=0).remote(
        4 * NBYTES, "lru", blocking_timeout_secs=0.2, pin_lease_secs=0.4
    )
    try:
        put(handle, [0, 1, 2, 3])
        ray.get(handle.pin.remote(uuid.uuid4().hex, [key(i) for i in range(4)]))
        time.sleep(1.0)
        ack = put(handle, [50])
        assert ack.accepted == [key(50)]
        assert ray.get(handle.stats.remote())["expired_leases"] == 1
    finally:
        ray.kill(handle)


def test_too_small_object_store_is_reported():
    handle = CPUStoreActor.options(num_cpus=0).remote(8 << 30, "lru")
    try:
        stats = ray.get(handle.stats.remote())
        assert stats["object_store_ok"] is False
    finally:
        ray.kill(handle)


@ray.remote(num_cpus=0)
class SmallProducer:
    """Chunks of 8 KiB: a 4-chunk reply is a task return Ray keeps inline (< 100 KiB)."""

    @ray.method(num_returns=2)
    def get_batch(self, keys):
        return [meta(8 << 10) for _ in keys], [payload(k, 8 << 10) for k in keys]


def _rss_bytes(handle) -> int:
    pid = int(ray._private.state.actors(handle._actor_id.hex())["Pid"])
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_served_but_not_cached_pulls_do_not_leak_memory() -> None:
    """Regression: a small reply handed out uncached used to stay in the store's heap
    forever (Ray 2.60; see `HandoutHold`): +32 KiB a pull, ~47 MiB over this test."""
    handle = CPUStoreActor.options(num_cpus=0).remote(16 << 10, "lru")  # nothing fits
    source = SmallProducer.remote()
    try:
        ack = ray.get(handle.pull.remote(source, [key(10**6 + i) for i in range(4)]))
        assert ack.skipped and len(ack.refs) == 4  # served, not cached
        assert all(a.nbytes == 8 << 10 for a in read(list(ack.refs.values())))
        before = _rss_bytes(handle)
        for n in range(1500):
            keys = [key(n * 4 + i) for i in range(4)]
            ack = ray.get(handle.pull.remote(source, keys))
            assert len(ack.refs) == 4 and not ack.accepted
        grown = _rss_bytes(handle) - before
        assert grown < 30 << 20, f"CPU store RSS grew {grown / 2**20:.1f} MiB over 1500 pulls"
    finally:
        ray.kill(handle)
        ray.kill(source)


@ray.remote(num_cpus=0)
class LyingProducer:
    """A source whose second chunk is half the size its meta declares."""

    def _arrays(self, keys):
        return [payload(k, NBYTES // 2 if i == 1 else NBYTES) for i, k in enumerate(keys)]

    @ray.method(num_returns=2)
    def get_batch(self, keys):
        return [meta() for _ in keys], self._arrays(keys)

    def peer_read(self, keys):
        return _peer_reply(keys, self._arrays(keys))


def test_a_put_of_arrays_of_another_size_than_their_meta_skips_them(store):
    """Regression (#13 defect 4): they were cached at the declared size and every later
    read of them raised in the app."""
    keys = [key(60), key(61), key(62)]
    arrays = [payload(keys[0]), payload(keys[1], NBYTES // 2), payload(keys[2], 2 * NBYTES)]
    ack = ray.get(store.put.remote(keys, [meta()] * 3, [ray.put(arrays)]))
    assert ack.accepted == [key(60)] and ack.skipped == [key(61), key(62)]
    assert ray.get(store.contains.remote(keys)) == [True, False, False]
    assert_bytes([key(60)], [ack.refs[key(60)]])
    stats = ray.get(store.stats.remote())
    assert stats["used_bytes"] == NBYTES and stats["skipped"] == 2
    assert put(store, [63]).accepted == [key(63)]  # the actor carries on


@pytest.mark.parametrize("peer", [False, True])
def test_a_pulled_array_of_another_size_than_its_meta_is_a_miss(store, peer):
    producer = LyingProducer.remote()
    try:
        keys = [key(70), key(71), key(72)]
        if peer:  # a peer's chunks are served by the read and cached by the adopt
            read, ack = peer_pull(store, producer, keys)
            assert read.missing == [key(71)] and set(read.refs) == {key(70), key(72)}
        else:
            ack = ray.get(store.pull.remote(producer, keys))
            assert ack.missing == [key(71)] and ack.skipped == [key(71)]
            assert set(ack.refs) == {key(70), key(72)}
        assert ack.accepted == [key(70), key(72)]
        ray.kill(producer)
        assert_bytes([key(70), key(72)], [ack.refs[key(70)], ack.refs[key(72)]])
        stats = ray.get(store.stats.remote())
        assert stats["used_bytes"] == 2 * NBYTES and stats["entries"] == 2
    finally:
        ray.kill(producer)
