"""StorageManager over real tiers: the DESIGN.md semantics of store, lookup, prefetch,
retrieve, pressure, restarts and lazy touch. Every hit is checked byte for byte."""

from __future__ import annotations

import socket
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import ray
from ray.util import list_named_actors

from raykv.actors.factory import shutdown_namespace
from raykv.actors.storage_manager import get_or_create_manager
from raykv.config import RayKVConfig
from raykv.keys import ChunkSpan, KeyMaker
from raykv.payload import PayloadMeta
from raykv.wire import RetrieveResult

pytestmark = pytest.mark.usefixtures("ray_session")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHUNK_TOKENS = 16
NBYTES = 32 << 10  # bytes per chunk


def payload(key) -> np.ndarray:
    """A chunk's bytes are a function of its key, so every hit can be verified."""
    return np.random.default_rng(int(key.chunk_hash[-15:], 16)).integers(
        0, 256, NBYTES, dtype=np.uint8
    )


META = PayloadMeta("uint8", (2, 1, CHUNK_TOKENS, NBYTES // (2 * CHUNK_TOKENS)))


def request(seed: int, n_chunks: int) -> list[ChunkSpan]:
    tokens = list(range(seed * 100_000, seed * 100_000 + n_chunks * CHUNK_TOKENS))
    return KeyMaker(chunk_size=CHUNK_TOKENS, kv_dtype="uint8").keys(tokens)


def put(manager, spans: list[ChunkSpan]):
    keys = [s.key for s in spans]
    ref = ray.put([payload(k) for k in keys])
    return ray.get(manager.put.remote(keys, [META] * len(keys), [ref]))


def read(chunks) -> list[np.ndarray]:
    refs = list({c.ref for c in chunks})
    values = dict(zip(refs, ray.get(refs), strict=True))
    return [values[c.ref][c.index] for c in chunks]


def check_bytes(spans, result, hits: int | None = None) -> None:
    """The bytes of every hit; and that `hits` chunks (default: all of `spans`) were hit."""
    assert result.hit_chunks == (len(spans) if hits is None else hits)
    for span, arr in zip(spans, read(result.chunks), strict=False):
        assert np.array_equal(arr, payload(span.key)), f"wrong bytes for chunk {span}"


def tokens(n: int) -> int:
    return n * CHUNK_TOKENS


def build_manager(namespaces: list[str], directory, **overrides):
    """A manager in a namespace of its own (and its own disk directory)."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    namespaces.append(ns)
    fields = {
        "namespace": ns,
        "max_local_cpu_size": 16 * NBYTES / 2**30,
        "local_disk": str(directory / ns),
        "max_local_disk_size": 0.25,
        "blocking_timeout_secs": 0.5,
        "lookup_timeout_ms": 1000,
    }
    fields.update(overrides)
    manager = get_or_create_manager(RayKVConfig.load(**fields))
    ray.get(manager.stats.remote())  # started, index built
    return manager


@pytest.fixture(scope="module")
def shared_manager(ray_session, tmp_path_factory):
    """One manager (16-chunk CPU tier + disk) for the module: actors take seconds to start."""
    namespaces: list[str] = []
    yield build_manager(namespaces, tmp_path_factory.mktemp("disk"))
    for ns in namespaces:
        shutdown_namespace(ns)


@pytest.fixture
def m(shared_manager):
    """The shared manager, emptied before each test."""
    ray.get(shared_manager.flush.remote(30))
    ray.get(shared_manager.clear.remote())
    return shared_manager


@pytest.fixture
def make_manager(tmp_path):
    """Build a manager with its own configuration; torn down after the test."""
    namespaces: list[str] = []
    yield lambda **overrides: build_manager(namespaces, tmp_path, **overrides)
    for ns in namespaces:
        shutdown_namespace(ns)


def test_prefix_is_stitched_across_tiers(m):
    spans = request(1, 5)
    keys = [s.key for s in spans]
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.get(m.remove.remote(keys[3:], ["cpu"]))  # chunks 0-2 only in CPU
    ray.get(m.remove.remote(keys[:3], ["disk"]))  # chunks 3-4 only on disk
    assert ray.get(m.lookup.remote(spans)) == tokens(5)
    assert ray.get(m.lookup.remote(spans, search_range=["disk"])) == 0
    assert ray.get(m.lookup.remote(spans, search_range=["cpu"])) == tokens(3)
    result = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert result.hit_tokens == tokens(5)
    assert result.tiers == ["cpu"] * 3 + ["disk"] * 2
    check_bytes(spans, result)


def test_a_hole_in_the_middle_ends_the_prefix(m):
    spans = request(2, 5)
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.get(m.remove.remote([spans[2].key]))  # from every tier
    assert ray.get(m.lookup.remote(spans)) == tokens(2)
    result = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert result.hit_chunks == 2 and result.mask(5) == [True, True, False, False, False]
    check_bytes(spans, result, hits=2)


def test_a_disk_only_prefix_is_read_and_promoted_into_cpu(m):
    spans = request(3, 4)
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.get(m.remove.remote(spans, ["cpu"]))
    assert ray.get(m.lookup.remote(spans, search_range=["cpu"])) == 0
    first = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert first.tiers == ["disk"] * 4
    check_bytes(spans, first)
    assert ray.get(m.lookup.remote(spans, search_range=["cpu"])) == tokens(4)
    second = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert second.tiers == ["cpu"] * 4
    check_bytes(spans, second)


def test_prefetch_loads_lower_tiers_into_cpu_and_get_serves_it(m):
    spans = request(4, 6)
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.get(m.remove.remote(spans[2:], ["cpu"]))
    ray.get(m.prefetch.remote("p1", spans))  # returns at once
    assert ray.get(m.wait.remote("p1")) == tokens(6)
    assert ray.get(m.lookup.remote(spans, search_range=["cpu"])) == tokens(6)
    result = RetrieveResult.of(ray.get(m.get.remote(spans, "p1")))
    assert result.hit_tokens == tokens(6)
    check_bytes(spans, result)
    # get released its pins (the release is sent without waiting: poll)
    deadline = time.monotonic() + 10
    while ray.get(m.stats.remote())["tiers"]["cpu"]["leases"]:
        assert time.monotonic() < deadline, "the get did not release its pins"
        time.sleep(0.05)
    t0 = time.monotonic()
    assert ray.get(m.wait.remote("unknown", 0.2)) == 0  # waits for a prefetch, briefly
    assert time.monotonic() - t0 < 2.0


def test_a_wait_that_overtakes_its_prefetch_waits_for_it(m):
    spans = request(12, 3)
    put(m, spans)
    pending = m.wait.remote("overtaken")  # the client sends prefetch without waiting
    time.sleep(0.2)
    ray.get(m.prefetch.remote("overtaken", spans))
    assert ray.get(pending) == tokens(3)
    check_bytes(spans, RetrieveResult.of(ray.get(m.get.remote(spans, "overtaken"))))


def test_a_failed_tier_load_shortens_the_prefix_and_corrects_the_index(m):
    spans = request(5, 4)
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.get(m.remove.remote(spans, ["cpu"]))
    disk = ray.get(m.tier_handles.remote())["disk"]
    ray.get(disk.remove.remote([spans[2].key]))  # behind the manager's back: stale index
    assert ray.get(m.lookup.remote(spans)) == tokens(4)  # the index still believes it
    ray.get(m.prefetch.remote("p2", spans))
    assert ray.get(m.wait.remote("p2")) == tokens(2)
    result = RetrieveResult.of(ray.get(m.get.remote(spans, "p2")))
    assert result.hit_tokens == tokens(2)
    check_bytes(spans, result, hits=2)
    assert ray.get(m.lookup.remote(spans)) == tokens(2)  # corrected
    assert ray.get(m.stats.remote())["stale_positives"] >= 1


def test_pinned_chunks_are_never_evicted_and_a_full_put_gives_up(m):
    pinned, other = request(6, 16), request(7, 4)  # 16 chunks fill the CPU tier
    put(m, pinned)
    assert ray.get(m.lookup.remote(pinned, pin=True, lookup_id="L")) == tokens(16)
    t0 = time.monotonic()
    res = put(m, other)
    took = time.monotonic() - t0
    assert 0.4 < took < 3.0  # it waited about blocking_timeout_secs (0.5 s) for room
    assert (res.stored, res.skipped) == (0, 4)
    assert ray.get(m.lookup.remote(pinned, search_range=["cpu"])) == tokens(16)
    # A read of the other request is served from disk without waiting for room.
    assert ray.get(m.flush.remote(30))
    t0 = time.monotonic()
    result = RetrieveResult.of(ray.get(m.get.remote(other)))
    assert time.monotonic() - t0 < 1.5
    assert result.hit_tokens == tokens(4) and result.tiers == ["disk"] * 4
    check_bytes(other, result)
    # The get of the pinned lookup releases it: now the other request fits.
    check_bytes(pinned, RetrieveResult.of(ray.get(m.get.remote(pinned, "L"))))
    assert put(m, other).stored == 4


def test_a_gets_touch_reaches_the_cpu_store_before_a_later_put_evicts(m):
    """Request ends (unpin + touch) go to the CPU store batched; a put right after a get
    must still find the get's hits touched, so LRU pressure evicts the other request."""
    read_again, idle, new = request(30, 8), request(31, 8), request(32, 4)
    put(m, read_again)
    put(m, idle)  # 16 chunks: the CPU tier is full, read_again is the least recent
    check_bytes(read_again, RetrieveResult.of(ray.get(m.get.remote(read_again))))
    assert put(m, new).stored == 4
    cpu = ray.get(m.tier_handles.remote())["cpu"]
    assert all(ray.get(cpu.contains.remote([s.key for s in read_again])))
    assert not all(ray.get(cpu.contains.remote([s.key for s in idle])))


def test_a_gets_pins_are_released_without_a_later_call(m):
    """The batched release is sent on its own within its window, not only when another
    call to the CPU store pushes it out."""
    spans = request(33, 4)
    put(m, spans)
    assert ray.get(m.lookup.remote(spans, pin=True, lookup_id="P")) == tokens(4)
    cpu = ray.get(m.tier_handles.remote())["cpu"]
    assert ray.get(cpu.stats.remote())["pinned_entries"] == 4
    check_bytes(spans, RetrieveResult.of(ray.get(m.get.remote(spans, "P"))))
    deadline = time.monotonic() + 5
    while ray.get(cpu.stats.remote())["pinned_entries"]:
        assert time.monotonic() < deadline, "the get never released its pins"
        time.sleep(0.01)


@ray.remote(num_cpus=0)
class Client:
    """A separate process that uses the cache and then dies."""

    def store(self, manager, spans):
        return put(manager, spans)

    def pin(self, manager, spans, lookup_id):
        return ray.get(manager.lookup.remote(spans, pin=True, lookup_id=lookup_id))


def test_data_stays_readable_after_the_writer_exits(m):
    spans = request(9, 3)
    writer = Client.remote()
    assert ray.get(writer.store.remote(m, spans)).stored == 3
    ray.kill(writer)
    time.sleep(0.5)
    result = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert result.tiers == ["cpu"] * 3
    check_bytes(spans, result)


def test_a_lease_releases_the_pins_of_a_dead_client(make_manager):
    m = make_manager(max_local_cpu_size=4 * NBYTES / 2**30, pin_lease_secs=0.5, local_disk=None)
    pinned, other = request(10, 4), request(11, 4)
    put(m, pinned)
    client = Client.remote()
    assert ray.get(client.pin.remote(m, pinned, "dead")) == tokens(4)
    ray.kill(client)
    deadline = time.monotonic() + 20
    # Both the CPUStore's lease and the manager's record of the lookup must expire.
    while True:
        stats = ray.get(m.stats.remote())
        if not stats["tiers"]["cpu"]["leases"] and not stats["open_lookups"]:
            break
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    assert put(m, other).stored == 4


class _ManagerView:
    """What `CPUView` reads of a client (`KVCache.cpu_events` / `cpu_keys`), straight from
    the manager actor."""

    def __init__(self, manager) -> None:
        self.m = manager

    def cpu_events(self, cursor, identity, tiers=None):
        args = (cursor, identity) if tiers is None else (cursor, identity, tiers)
        return ray.get(self.m.cpu_events.remote(*args))

    def cpu_keys(self, identity, tier="cpu"):
        return ray.get(self.m.cpu_keys.remote(identity, tier))


def test_the_vllm_cpu_view_follows_the_cpu_tier_through_puts_and_evictions(make_manager):
    from raykv.integrations.vllm_view import CPUView

    m = make_manager(max_local_cpu_size=4 * NBYTES / 2**30, local_disk=None)
    first, second = request(40, 4), request(41, 4)
    put(m, first)
    identity = first[0].key.identity
    hashes = [s.key.chunk_hash for s in first]
    assert sorted(ray.get(m.cpu_keys.remote(identity))) == sorted(hashes)
    assert ray.get(m.cpu_keys.remote(("another-model", 1, 0, "uint8"))) == []
    view = CPUView(_ManagerView(m), identity, poll_s=0.01, idle_poll_s=0.01)

    def settles(chunk_hashes, n):
        deadline = time.monotonic() + 20
        while view.prefix(chunk_hashes) != n:
            assert time.monotonic() < deadline, f"the view never saw {n} chunks"
            time.sleep(0.02)

    try:
        settles(hashes, 4)  # from the snapshot
        put(m, second)  # evicts the first request from the 4-chunk tier
        settles([s.key.chunk_hash for s in second], 4)  # from the events
        settles(hashes, 0)
        assert ray.get(m.lookup.remote(first)) == 0  # what the manager says too
    finally:
        view.close()


def test_a_cpu_and_disk_view_sees_a_chunk_evicted_from_cpu_still_on_disk(make_manager):
    from raykv.integrations.vllm_view import CPUView

    m = make_manager(max_local_cpu_size=4 * NBYTES / 2**30)  # and a disk tier
    first, second = request(42, 4), request(43, 4)
    put(m, first)
    assert ray.get(m.flush.remote(30))  # on disk too
    identity = first[0].key.identity
    hashes = [s.key.chunk_hash for s in first]
    assert sorted(ray.get(m.cpu_keys.remote(identity, "disk"))) == sorted(hashes)
    view = CPUView(_ManagerView(m), identity, ("cpu", "disk"), poll_s=0.01, idle_poll_s=0.01)
    deadline = time.monotonic() + 20
    try:
        while view.locate(hashes) != ["cpu"] * 4:
            assert time.monotonic() < deadline, view.locate(hashes)
            time.sleep(0.02)
        put(m, second)  # evicts the first request from the 4-chunk CPU tier
        while view.locate(hashes) != ["disk"] * 4:
            assert time.monotonic() < deadline, view.locate(hashes)
            time.sleep(0.02)
        resyncs = view.resyncs
        time.sleep(0.5)  # ~50 polls: events, not snapshots, while nothing is lost
        assert view.resyncs == resyncs
    finally:
        view.close()


def test_lazy_prefix_closed_touch_keeps_the_cache_prefix_closed(m):
    """Every cached chunk's parent is cached, under churn with reads in between."""
    requests = [request(20 + r, 4) for r in range(10)]  # 40 chunks through 16 slots
    rng = np.random.default_rng(0)
    cpu = ray.get(m.tier_handles.remote())["cpu"]
    for i, spans in enumerate(requests):
        put(m, spans)
        for j in rng.choice(i + 1, size=2):  # re-read some earlier requests
            wanted = requests[j][: rng.integers(1, 5)]
            res = RetrieveResult.of(ray.get(m.get.remote(wanted)))
            # an evicted chunk's disk write may still be running: a shorter hit is fine
            assert res.hit_chunks >= 1
            check_bytes(wanted, res, hits=res.hit_chunks)
        for earlier in requests[: i + 1]:
            held = ray.get(cpu.contains.remote([s.key for s in earlier]))
            n = held.index(False) if False in held else len(held)
            assert not any(held[n:]), f"chunk cached without its parent: {held}"
    assert ray.get(cpu.stats.remote())["evictions"] > 0


def test_stats_report_tiers_and_hit_rate(m):
    spans = request(31, 2)
    put(m, spans)
    before = ray.get(m.stats.remote())
    ray.get(m.lookup.remote(spans))
    ray.get(m.lookup.remote(request(32, 2)))
    stats = ray.get(m.stats.remote())
    hits = stats["hit_tokens"] - before["hit_tokens"]
    misses = stats["miss_tokens"] - before["miss_tokens"]
    assert hits == misses == tokens(2) and 0 < stats["hit_rate"] <= 1
    assert stats["tiers"]["cpu"]["entries"] == 2
    assert {"used_bytes", "capacity_bytes", "evictions"} <= set(stats["tiers"]["cpu"])
    ray.get(m.clear.remote())
    assert ray.get(m.lookup.remote(spans)) == 0


def test_a_killed_cpu_store_restarts_and_the_manager_serves_from_disk(m):
    spans = request(8, 4)
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    before = ray.get(m.incarnations.remote())["cpu"]
    cpu = ray.get(m.tier_handles.remote())["cpu"]
    ray.kill(cpu, no_restart=False)
    # ray.kill is asynchronous: wait until the store has really restarted (a client only
    # learns of it when a read fails with OwnerDiedError, i.e. after the death).
    deadline = time.monotonic() + 30
    while True:
        try:
            if ray.get(cpu.incarnation.remote(), timeout=10) != before:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the CPUStore did not restart"
        time.sleep(0.1)
    # A client whose read failed with OwnerDiedError asks again with check_cpu=True.
    result = RetrieveResult.of(ray.get(m.get.remote(spans, check_cpu=True)))
    assert result.hit_tokens == tokens(4) and result.tiers == ["disk"] * 4
    check_bytes(spans, result)
    assert ray.get(m.incarnations.remote())["cpu"] != before
    again = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert again.tiers == ["cpu"] * 4  # promoted into the restarted CPUStore
    check_bytes(spans, again)


def test_manager_restart_rebuilds_its_index_from_the_tiers(m):
    spans = request(30, 3)
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.kill(m, no_restart=False)
    deadline = time.monotonic() + 30
    while True:
        try:
            n = ray.get(m.lookup.remote(spans), timeout=10)
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert n == tokens(3)
    result = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert result.hit_tokens == tokens(3)
    check_bytes(spans, result)


def test_three_tier_prefix_with_a_redis_remote_written_by_others(make_manager, redis_server):
    m = make_manager(remote_url=redis_server.url)
    spans = request(40, 6)
    keys = [s.key for s in spans]
    put(m, spans)
    assert ray.get(m.flush.remote(30))
    ray.get(m.remove.remote(keys[2:], ["cpu"]))
    ray.get(m.remove.remote(keys[:2] + keys[4:], ["disk"]))
    ray.get(m.remove.remote(keys[:4], ["remote"]))
    assert ray.get(m.lookup.remote(spans)) == tokens(6)
    assert ray.get(m.lookup.remote(spans, search_range=["disk", "remote"])) == 0
    result = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert result.tiers == ["cpu"] * 2 + ["disk"] * 2 + ["remote"] * 2
    check_bytes(spans, result)

    # Another instance wrote these to the shared remote: no index knows them.
    others = request(41, 3)
    remote = ray.get(m.tier_handles.remote())["remote"]
    ref = ray.put([payload(s.key) for s in others])
    ray.get(remote.put.remote([s.key for s in others], [META] * 3, [ref]))
    assert ray.get(m.lookup.remote(others)) == tokens(3)
    found = RetrieveResult.of(ray.get(m.get.remote(others)))
    assert found.tiers == ["remote"] * 3
    check_bytes(others, found)

    # An unreachable remote costs misses within the lookup timeout, never an error.
    redis_server.stop()
    t0 = time.monotonic()
    assert ray.get(m.lookup.remote(request(42, 3))) == 0
    assert time.monotonic() - t0 < 3.0
    assert ray.get(m.stats.remote())["remote_errors"] >= 1  # the manager's own probe failed
    assert ray.get(m.lookup.remote(spans)) == tokens(6)  # now all in CPU


def test_a_ray_remote_is_probed_from_the_managers_thread_and_a_dead_one_costs_misses(
    make_manager,
):
    """A `ray://` server is asked from the Ray thread that serves the lookup (no event
    loop hop): keys only it holds are found; once it is dead, lookups stay bounded
    misses, counted in `remote_errors`."""
    name = f"kv-{uuid.uuid4().hex[:8]}"
    m = make_manager(remote_url=f"ray://{name}", local_disk=None, lookup_timeout_ms=1000)
    ray.get(m.lookup.remote(request(79, 1)))  # the first probe creates the server
    (ns,) = [a["namespace"] for a in list_named_actors(all_namespaces=True) if a["name"] == name]
    server = ray.get_actor(name, namespace=ns)
    try:
        spans = request(80, 2)
        put(m, spans)
        assert ray.get(m.lookup.remote(spans + request(81, 1))) == tokens(2)  # probe made
        for seed in (82, 83):  # written by another instance: only the server knows them
            others = request(seed, 3)
            ref = ray.put([payload(s.key) for s in others])
            ray.get(server.put.remote([s.key for s in others], [META] * 3, [ref]))
            assert ray.get(m.lookup.remote(others)) == tokens(3)
        check_bytes(others, RetrieveResult.of(ray.get(m.get.remote(others))))
        errors = ray.get(m.stats.remote())["remote_errors"]
        ray.kill(server, no_restart=True)
        for seed in (84, 85, 86):
            t0 = time.monotonic()
            assert ray.get(m.lookup.remote(spans + request(seed, 2)), timeout=3.0) == tokens(2)
            assert time.monotonic() - t0 < 2.0
        assert ray.get(m.stats.remote())["remote_errors"] > errors
    finally:
        ray.kill(server)


def test_without_a_cpu_tier_lower_tier_hits_are_served(make_manager):
    m = make_manager(local_cpu=False)
    spans = request(60, 4)
    assert put(m, spans).stored == 0
    assert ray.get(m.flush.remote(30))
    assert ray.get(m.lookup.remote(spans)) == tokens(4)
    result = RetrieveResult.of(ray.get(m.get.remote(spans)))
    assert result.tiers == ["disk"] * 4
    check_bytes(spans, result)
    ray.get(m.prefetch.remote("no-cpu", spans))
    assert ray.get(m.wait.remote("no-cpu")) == tokens(4)
    check_bytes(spans, RetrieveResult.of(ray.get(m.get.remote(spans, "no-cpu"))))
    assert ray.get(m.stats.remote())["open_lookups"] == 0


@pytest.fixture
def blackhole():
    """A TCP server on loopback that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    server.settimeout(0.1)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stop.set()
    thread.join(5)
    for conn in conns:
        conn.close()
    server.close()


def test_a_blackholed_remote_still_gives_cpu_hits_within_the_clients_timeout(
    make_manager, blackhole
):
    m = make_manager(remote_url=blackhole, local_disk=None, lookup_timeout_ms=1000)
    spans = request(70, 4)
    assert put(m, spans).stored == 4
    longer = spans + request(71, 2)  # the last two: no index knows them, the remote is asked
    end = time.monotonic() + 4.0  # longer than the remote's back-off windows
    while time.monotonic() < end:
        t0 = time.monotonic()
        assert ray.get(m.lookup.remote(longer), timeout=1.0) == tokens(4)  # the client's budget
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.3)
    result = RetrieveResult.of(ray.get(m.get.remote(longer), timeout=4.0))
    check_bytes(spans, result)
