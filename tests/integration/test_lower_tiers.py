"""Contract suite of the lower tiers (disk, ray:// KVServer, redis) on a real Ray, real
files and a real redis-server, plus each tier's failure behaviour."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import raykv_testing
import redis
from raykv_testing import TEST_NAMESPACE, RedisServer, chunk_key, seeded_chunk

from raykv.actors.disk_store import DiskStoreActor
from raykv.actors.kv_server import get_or_create_kv_server
from raykv.actors.remote_store import RemoteStoreActor
from raykv.config import RayKVConfig
from raykv.keys import CacheKey
from raykv.tiers.disk import record_size
from raykv.tiers.remote import RemoteStore

pytestmark = pytest.mark.usefixtures("ray_session")
# Workers cannot import test modules: ship this module's actors and helpers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(raykv_testing)  # its factories travel with us too

TIERS = ["disk", "ray", "redis"]
CAPACITY = 1 << 20
CAPACITY_GB = CAPACITY / (1 << 30)
TIMEOUT_MS = 1000


key = functools.partial(chunk_key, model="tier-test")


chunk = seeded_chunk


def config(**kw: Any) -> RayKVConfig:
    return RayKVConfig(namespace=TEST_NAMESPACE, lookup_timeout_ms=TIMEOUT_MS, **kw)


@dataclass
class Tier:
    kind: str
    handle: Any
    config: RayKVConfig
    server: RedisServer | None = None


def put(handle: Any, ids: list[int], tokens: int = 16, wait: bool = True, data=None):
    """Put chunks as one batch object (as the CPU tier does); wait until they are visible."""
    items = [chunk(i, tokens) for i in ids]
    arrays = data if data is not None else [a for _, a in items]
    metas = [m for m, _ in items]
    ack = ray.get(handle.put.remote([key(i) for i in ids], metas, [ray.put(arrays)]))
    if wait:
        wait_visible(handle, ack.accepted)
    return ack


def wait_visible(handle: Any, keys: list[CacheKey], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not all(ray.get(handle.contains.remote(keys))):
        assert time.monotonic() < deadline, "writes did not become visible"
        time.sleep(0.01)


def get(handle: Any, ids: list[int]):
    metas_ref, arrays_ref = handle.get_batch.options(num_returns=2).remote([key(i) for i in ids])
    return ray.get(metas_ref), ray.get(arrays_ref)


def assert_hits(handle: Any, ids: list[int], tokens: int = 16) -> None:
    metas, arrays = get(handle, ids)
    for i, meta, array in zip(ids, metas, arrays, strict=True):
        want_meta, want = chunk(i, tokens)
        assert meta == want_meta, f"wrong meta for chunk {i}"
        assert array.dtype == np.uint8 and np.array_equal(array, want), f"wrong bytes for {i}"


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=TIERS)
def tier_module(request, tmp_path_factory) -> Any:
    """One actor per tier for the whole module (each actor is a new worker process)."""
    kind = request.param
    server = None
    if kind == "disk":
        directory = str(tmp_path_factory.mktemp("disk"))
        cfg = config(local_disk=directory, max_local_disk_size=CAPACITY_GB)
        handle = DiskStoreActor.remote(cfg)
    elif kind == "ray":
        name = f"kv-test-{uuid.uuid4().hex[:8]}"
        cfg = config(remote_url=f"ray://{name}", max_remote_size=CAPACITY_GB)
        # Start the server first: calls made while it boots would time out (as misses).
        ray.get(get_or_create_kv_server(name, cfg).incarnation.remote())
        handle = RemoteStoreActor.remote(cfg)
    else:
        server = request.getfixturevalue("redis_module")
        cfg = config(remote_url=server.url)
        handle = RemoteStoreActor.remote(cfg)
    yield Tier(kind, handle, cfg, server)
    ray.kill(handle)
    if kind == "ray":
        ray.kill(ray.get_actor(cfg.remote_url[len("ray://") :], namespace=TEST_NAMESPACE))


@pytest.fixture
def tier(tier_module: Tier) -> Tier:
    ray.get(tier_module.handle.clear.remote())
    return tier_module


# ----- the contract, for every tier -----


def test_put_then_get_batch_returns_identical_bytes_and_metas(tier: Tier) -> None:
    ack = put(tier.handle, [1, 2, 3])
    assert ack.accepted == [key(1), key(2), key(3)] and not ack.skipped
    assert ray.get(tier.handle.contains.remote([key(1), key(4), key(3)])) == [True, False, True]
    assert_hits(tier.handle, [3, 1, 2])
    stats = ray.get(tier.handle.stats.remote())
    assert stats["entries"] == 3 and stats["hits"] == 3


def test_missing_keys_give_none_and_empty_arrays(tier: Tier) -> None:
    put(tier.handle, [1])
    metas, arrays = get(tier.handle, [7, 1, 8])
    assert metas[0] is None and metas[2] is None and metas[1] == chunk(1)[0]
    assert arrays[0].size == 0 and arrays[2].size == 0
    assert get(tier.handle, []) == ([], [])


def test_second_put_of_a_key_keeps_the_first(tier: Tier) -> None:
    put(tier.handle, [1])
    other = [chunk(99)[1]]
    ack = put(tier.handle, [1], data=other)
    assert ack.accepted == [key(1)]
    assert_hits(tier.handle, [1])


def test_remove_clear_and_keys(tier: Tier) -> None:
    put(tier.handle, [1, 2, 3, 4])
    assert sorted(ray.get(tier.handle.keys.remote())) == [key(i) for i in (1, 2, 3, 4)]
    assert ray.get(tier.handle.remove.remote([key(1), key(2), key(9)])) == 2
    assert sorted(ray.get(tier.handle.keys.remote())) == [key(3), key(4)]
    assert get(tier.handle, [1])[0] == [None]
    ray.get(tier.handle.clear.remote())
    assert ray.get(tier.handle.keys.remote()) == []
    assert ray.get(tier.handle.contains.remote([key(3)])) == [False]


def test_concurrent_writers_of_one_key_store_it_once(tier: Tier) -> None:
    barrier = threading.Barrier(4)
    acks = []

    def writer() -> None:
        barrier.wait()
        acks.append(put(tier.handle, [5], wait=False))

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.accepted == [key(5)] for a in acks)
    wait_visible(tier.handle, [key(5)])
    assert ray.get(tier.handle.keys.remote()) == [key(5)]
    assert_hits(tier.handle, [5])
    if tier.kind == "disk":
        directory = Path(ray.get(tier.handle.stats.remote())["directory"])
        assert ray.get(tier.handle.flush.remote(5))
        assert [p.name for p in directory.glob("*/*")] == [key(5).to_string() + ".rkv"]


def test_capacity_eviction_returns_evicted_keys_and_respects_the_budget(tier: Tier) -> None:
    if tier.kind == "redis":
        pytest.skip("Redis enforces its own maxmemory; raykv keeps no byte budget for it")
    tokens = 512  # 128 KiB chunks: the 1 MiB budget holds 7 or 8 of them
    evicted: list[CacheKey] = []
    for i in range(12):
        ack = put(tier.handle, [i], tokens=tokens)
        assert ack.accepted == [key(i)]
        evicted += ack.evicted
    stats = ray.get(tier.handle.stats.remote())
    held = ray.get(tier.handle.keys.remote())
    assert stats["used_bytes"] <= stats["capacity_bytes"] == CAPACITY
    assert evicted == [key(i) for i in range(12 - len(held))]  # LRU: oldest first
    assert sorted(held + evicted) == [key(i) for i in range(12)]
    meta = chunk(0, tokens)[0]
    # disk counts whole files (codec header + body); the KVServer counts the bodies it holds
    entry_bytes = record_size(meta, key(0)) if tier.kind == "disk" else meta.nbytes
    assert len(held) == CAPACITY // entry_bytes
    assert stats["evictions"] == len(evicted)
    assert_hits(tier.handle, [11], tokens)
    assert ray.get(tier.handle.contains.remote(evicted)) == [False] * len(evicted)


def test_a_chunk_whose_array_disagrees_with_its_meta_is_skipped(tier: Tier) -> None:
    short = chunk(1)[1][:-2]
    ack = put(tier.handle, [1, 2], data=[short, chunk(2)[1]], wait=False)
    assert ack.skipped == [key(1)] and ack.accepted == [key(2)]
    wait_visible(tier.handle, [key(2)])
    assert ray.get(tier.handle.contains.remote([key(1)])) == [False]
    assert_hits(tier.handle, [2])


def test_incarnation_is_stable_for_one_actor(tier: Tier) -> None:
    first = ray.get(tier.handle.incarnation.remote())
    assert isinstance(first, str) and first == ray.get(tier.handle.incarnation.remote())


# ----- disk tier -----


# Tier-specific tests reuse the module's actor of their tier.
disk_only = pytest.mark.parametrize("tier_module", ["disk"], indirect=True)
redis_only = pytest.mark.parametrize("tier_module", ["redis"], indirect=True)


@pytest.fixture
def disk(tier: Tier) -> Tier:
    return tier


def _disk_path(disk: Tier, i: int) -> Path:
    directory = Path(ray.get(disk.handle.stats.remote())["directory"])
    return directory / key(i).chunk_hash[:2] / (key(i).to_string() + ".rkv")


@disk_only
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_disk_corrupt_or_truncated_file_is_a_miss_and_is_removed(disk: Tier, damage) -> None:
    put(disk.handle, [1, 2])
    path = _disk_path(disk, 1)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:100]
    else:
        raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    metas, arrays = get(disk.handle, [1, 2])
    assert metas[0] is None and arrays[0].size == 0 and metas[1] == chunk(2)[0]
    assert not path.exists()
    assert ray.get(disk.handle.contains.remote([key(1)])) == [False]


@disk_only
def test_disk_restart_on_the_same_directory_serves_the_same_bytes(disk: Tier) -> None:
    put(disk.handle, [1, 2, 3])
    assert ray.get(disk.handle.flush.remote(5))
    reopened = DiskStoreActor.remote(disk.config)  # a restarted actor: a new instance
    try:
        assert ray.get(reopened.incarnation.remote()) != ray.get(disk.handle.incarnation.remote())
        assert sorted(ray.get(reopened.keys.remote())) == [key(1), key(2), key(3)]
        assert_hits(reopened, [1, 2, 3])
    finally:
        ray.kill(reopened)


@disk_only
def test_disk_check_fix_cleans_temp_and_bad_files(disk: Tier) -> None:
    put(disk.handle, [1, 2])
    path = _disk_path(disk, 1)
    temp = path.parent / f".{path.name}.0123abcd.tmp"
    temp.write_bytes(b"half a chunk")
    _disk_path(disk, 2).write_bytes(b"RKVC" + os.urandom(60))
    report = ray.get(disk.handle.check.remote(fix=True))
    assert report["temp_files"] == 1 and report["bad_files"] == 1
    assert not temp.exists() and not _disk_path(disk, 2).exists()
    assert ray.get(disk.handle.keys.remote()) == [key(1)]
    assert_hits(disk.handle, [1])


# ----- ray:// KVServer -----


@ray.remote(num_cpus=0)
class Producer:
    def make(self, ids: list[int]) -> list[ray.ObjectRef]:
        return [ray.put([chunk(i)[1] for i in ids])]


def test_kv_server_owns_what_it_stores_after_the_producer_dies(tmp_path: Path) -> None:
    name = f"kv-own-{uuid.uuid4().hex[:8]}"
    cfg = config(remote_url=f"ray://{name}", max_remote_size=CAPACITY_GB)
    node_id = ray.get_runtime_context().get_node_id()
    server = get_or_create_kv_server(name, cfg, node_id=node_id)
    producer = Producer.remote()
    try:
        batch = ray.get(producer.make.remote([1, 2]))  # owned by the producer
        ack = ray.get(server.put.remote([key(1), key(2)], [chunk(1)[0]] * 2, batch))
        assert ack.accepted == [key(1), key(2)]
        ray.kill(producer)
        time.sleep(0.2)
        assert_hits(server, [1, 2])  # get_batch with num_returns=2, called directly
        same = get_or_create_kv_server(name, cfg)  # get_if_exists: the same detached actor
        assert ray.get(same.incarnation.remote()) == ray.get(server.incarnation.remote())
    finally:
        ray.kill(server)


def test_a_kv_server_killed_for_good_is_created_again_under_a_new_incarnation() -> None:
    """The remote tier kept calling a dead server's handle and reported the old
    incarnation, so no manager resynced: every remote call failed until a restart. Its
    health check (`incarnation`) now finds or creates the server again."""
    name = f"kv-dead-{uuid.uuid4().hex[:8]}"
    cfg = config(remote_url=f"ray://{name}", max_remote_size=CAPACITY_GB)
    ray.get(get_or_create_kv_server(name, cfg).incarnation.remote())
    handle = RemoteStoreActor.remote(cfg)
    try:
        before = ray.get(handle.incarnation.remote())
        put(handle, [1])
        ray.kill(ray.get_actor(name, namespace=TEST_NAMESPACE), no_restart=True)
        deadline, now = time.monotonic() + 60, before
        while now == before and time.monotonic() < deadline:
            time.sleep(0.2)  # the breaker may skip a few checks after the failure
            now = ray.get(handle.incarnation.remote())
        assert now != before and now.split(":")[0] == before.split(":")[0]
        deadline = time.monotonic() + 30
        while not put(handle, [2], wait=False).accepted:  # the breaker's back-off
            assert time.monotonic() < deadline, "the new server never took a put"
            time.sleep(0.2)
        wait_visible(handle, [key(2)])
        assert_hits(handle, [2])
        assert get(handle, [1])[0] == [None]  # what the dead server held died with it
    finally:
        ray.kill(handle)
        try:
            ray.kill(ray.get_actor(name, namespace=TEST_NAMESPACE))
        except ValueError:
            pass


@ray.remote(num_cpus=0)
def _slow_batch(seconds: float, ids: list[int]) -> list[np.ndarray]:
    time.sleep(seconds)
    return [chunk(i)[1] for i in ids]


def test_kv_server_answers_probes_while_every_write_thread_waits_for_a_batch() -> None:
    """Puts block on pulling the writer's batch; a lookup's probe must not wait for them."""
    name = f"kv-starve-{uuid.uuid4().hex[:8]}"
    cfg = config(remote_url=f"ray://{name}", max_remote_size=CAPACITY_GB)
    server = get_or_create_kv_server(name, cfg, node_id=ray.get_runtime_context().get_node_id())
    try:
        ray.get(server.put.remote([key(0)], [chunk(0)[0]], [ray.put([chunk(0)[1]])]))
        # More puts than write threads, each pulling a batch that takes 4 s to exist.
        puts = [
            server.put.remote([key(i)], [chunk(i)[0]], [_slow_batch.remote(4.0, [i])])
            for i in range(1, 11)
        ]
        time.sleep(0.5)  # they are all waiting now
        start = time.monotonic()
        assert ray.get(server.contains.remote([key(0), key(1)]), timeout=10) == [True, False]
        assert time.monotonic() - start < 1.5, "the probe waited for the puts"
        assert all(ack.accepted for ack in ray.get(puts, timeout=30))
    finally:
        ray.kill(server)


# ----- redis -----


def test_redis_stopped_mid_run_gives_quick_misses_then_hits_after_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    handle = RemoteStoreActor.remote(config(remote_url=server.url))
    try:
        put(handle, [1])
        assert_hits(handle, [1])
        first = ray.get(handle.incarnation.remote())
        server.stop()
        assert ray.get(handle.incarnation.remote()) == first  # down is not restarted
        for _ in range(3):
            start = time.monotonic()
            assert ray.get(handle.contains.remote([key(1)])) == [False]
            assert get(handle, [1])[0] == [None]
            assert put(handle, [2], wait=False).skipped == [key(2)]
            assert time.monotonic() - start < TIMEOUT_MS / 1000 * 3
        assert ray.get(handle.stats.remote())["errors"] >= 1
        server.start()  # same port, empty (no persistence)
        started = time.monotonic()
        while not put(handle, [3], wait=False).accepted:
            assert time.monotonic() - started < 5, "no reconnect within 5 s"
            time.sleep(0.1)
        assert_hits(handle, [3])
        assert ray.get(handle.stats.remote())["healthy"]
        # a restarted server (new run_id, data gone): the manager must resync
        assert ray.get(handle.incarnation.remote()) != first
    finally:
        ray.kill(handle)
        server.stop()


@redis_only
def test_redis_corrupt_value_is_a_miss_and_is_deleted(tier: Tier) -> None:
    put(tier.handle, [1, 2, 3])
    client = redis.Redis.from_url(tier.server.url)
    prefix = f"{TEST_NAMESPACE}:kv:"
    client.set(prefix + key(1).to_string(), b"\x80\x04garbage, maybe a pickle")
    client.set(prefix + key(2).to_string(), client.get(prefix + key(3).to_string()))
    metas, arrays = get(tier.handle, [1, 2, 3])
    assert metas[:2] == [None, None] and arrays[0].size == 0 and metas[2] == chunk(3)[0]
    assert client.exists(prefix + key(1).to_string(), prefix + key(2).to_string()) == 0
    client.close()


@redis_only
def test_a_redis_value_of_another_type_is_a_miss_and_is_deleted_the_rest_served(
    tier: Tier,
) -> None:
    """A list under a chunk's name made the batch's pipeline raise (WRONGTYPE): every
    chunk of the batch missed, the breaker opened, and the value stayed."""
    put(tier.handle, [2, 3])
    client = redis.Redis.from_url(tier.server.url)
    name = f"{TEST_NAMESPACE}:kv:" + key(1).to_string()
    client.rpush(name, b"x")
    errors = ray.get(tier.handle.stats.remote())["errors"]
    try:
        metas, _ = get(tier.handle, [1, 2, 3])
        assert metas == [None, chunk(2)[0], chunk(3)[0]]
        assert client.exists(name) == 0
        assert ray.get(tier.handle.stats.remote())["errors"] == errors
    finally:
        client.delete(name)
        client.close()


def test_payload_secret_keys_disk_and_redis_records_and_refuses_planted_ones(
    tmp_path: Path, redis_module: RedisServer
) -> None:
    from raykv.payload import VERSION_KEYED, encode, secret_tag

    secret = "a shared secret for this test"
    namespace = f"mac-{uuid.uuid4().hex[:8]}"  # its own Redis key prefix
    disk_cfg = config(
        local_disk=str(tmp_path), max_local_disk_size=CAPACITY_GB, payload_secret=secret
    )
    redis_cfg = config(remote_url=redis_module.url, payload_secret=secret).replace(
        namespace=namespace
    )
    handles = [DiskStoreActor.remote(disk_cfg), RemoteStoreActor.remote(redis_cfg)]
    client = redis.Redis.from_url(redis_module.url)
    try:
        disk_handle, redis_handle = handles
        for handle in handles:
            put(handle, [1, 2])
            assert_hits(handle, [1, 2])
        disk_dir = Path(ray.get(disk_handle.stats.remote())["directory"])
        disk_file = disk_dir / key(1).chunk_hash[:2] / (key(1).to_string() + ".rkv")
        redis_name = f"{namespace}:kv-{secret_tag(secret)}:{key(1).to_string()}"
        assert disk_file.read_bytes()[4] == VERSION_KEYED
        assert client.get(redis_name)[4] == VERSION_KEYED
        # A writer without the secret plants a valid plain record of key 1 in both.
        meta, _ = chunk(1)
        planted = encode(chunk(99)[1], meta, key(1).to_string()).tobytes()
        disk_file.write_bytes(planted)
        client.set(redis_name, planted)
        for handle in handles:
            metas, arrays = get(handle, [1, 2])
            assert metas[0] is None and arrays[0].size == 0, "a planted record was served"
            assert metas[1] == chunk(2)[0] and np.array_equal(arrays[1], chunk(2)[1])
        # Both delete it: under this secret's own Redis names (no other secret's, and no
        # plain writer's, are there) a record that fails the MAC is corrupt or forged.
        assert not disk_file.exists() and not client.exists(redis_name)
        put(redis_handle, [1])  # and the key is stored again
        assert_hits(redis_handle, [1, 2])
        for handle in handles:
            assert secret not in repr(ray.get(handle.stats.remote()))
    finally:
        client.close()
        for handle in handles:
            ray.kill(handle)


def test_redis_password_is_masked_in_repr_stats_and_logs(tmp_path: Path, caplog) -> None:
    server = RedisServer(tmp_path, password="s3cret")
    server.start()
    handle = RemoteStoreActor.remote(config(remote_url=server.url))
    try:
        put(handle, [1])  # authenticated
        assert_hits(handle, [1])
        stats = ray.get(handle.stats.remote())
        assert "s3cret" not in repr(stats) and "***" in stats["url"]

        async def wrong_password() -> None:
            bad = server.url.replace("s3cret", "wrong-s3cret")
            store = RemoteStore(config(remote_url=bad))
            assert "s3cret" not in repr(store)
            assert await store.contains([key(1)]) == [False]  # auth error: a miss
            await store.close()

        with caplog.at_level(logging.DEBUG, logger="raykv"):
            asyncio.run(wrong_password())
        assert "failed on contains" in caplog.text and "s3cret" not in caplog.text
    finally:
        ray.kill(handle)
        server.stop()
