"""StorageManager: the one entry point of the cache, an async Ray actor over the tiers.

One client call per request; every call to a tier is batched. The manager keeps an
index it answers lookups from without asking each tier in turn:

* CPU: key -> `ChunkRef` (refs borrowed from the CPUStore), updated from every put
  and pull reply, evicted keys included. Borrowing keeps an object alive while the
  manager (or a client it handed the ref to) still holds it, so a chunk evicted
  between a lookup and its get is still read correctly.
* disk and remote: sets of keys believed present, updated from `PutAck`s. A stale
  positive costs a miss when a pull finds the key missing, and is corrected then.

Keys that no index knows are asked of the remote tier (other instances may have
written them) in one call bounded by `lookup_timeout_ms`.

Restarts: every CPU reply carries the CPUStore's incarnation, and a background task
polls every tier's `incarnation()`; a change resyncs that tier's index (a restarted
CPUStore lost its objects, a restarted disk tier rebuilt from its files). A
restarted manager rebuilds its whole index from the tiers.

Keys are passed as `ChunkSpan`s (token range + key) so that answers are in tokens:
a hit prefix of n chunks is worth `spans[n-1].end` tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv import metrics
from raykv.actors.base import (
    ACTOR_OPTIONS,
    CONTROLLER_NAME,
    CPU_STORE_NAME,
    DISK_STORE_NAME,
    REMOTE_STORE_NAME,
    STORAGE_MANAGER_NAME,
)
from raykv.actors.common import HandoutHold, node_scoped_name
from raykv.actors.controller import (
    FLUSH_INTERVAL_SECS,
    RESYNC_PERIOD_SECS,
    ControllerReporter,
    get_or_create_controller,
)
from raykv.actors.cpu_store import CPUStoreActor
from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, ChunkSpan
from raykv.payload import PayloadMeta
from raykv.tiers.budget import BoundedKeySet
from raykv.wire import (
    TIER_CPU,
    TIER_DISK,
    TIER_ORDER,
    TIER_REMOTE,
    ChunkRef,
    CPUAck,
    PackedSpans,
    PutAck,
    PutResult,
    RetrieveResult,
)

logger = logging.getLogger(__name__)

# How often the manager asks every tier for its incarnation (restart detection).
RESYNC_INTERVAL_SECS = 1.0
# Bound on control calls (incarnation, keys, stats) to a tier that may be restarting.
CONTROL_TIMEOUT_SECS = 10.0
# The peer tier: another node's CPU tier, found through the KVController. Internally a
# peer segment's tier is "peer:<manager name>" so the pull knows where to fetch from.
TIER_PEER = "peer"
# With the controller on, an empty report (heartbeat) goes out at least this often.
HEARTBEAT_SECS = 1.0
_EMPTY = np.empty(0, dtype=np.uint8)
# A lookup's remote probe gets this share of `lookup_timeout_ms`: the client waits the
# whole timeout for the answer, so on a slow remote the manager must answer first (with
# the CPU/disk part of the prefix) or every CPU hit turns into a client-side miss.
REMOTE_PROBE_SHARE = 0.5
# A pull (promotion into CPU, or a direct read without a CPU tier) is a miss after this
# many lookup timeouts (the client gives a get four).
PULL_TIMEOUT_FACTOR = 2.0
# Background writes in flight per lower tier (`extra_config: max_lower_writes_in_flight`);
# a put finding its tier at the cap skips that tier and counts `raykv_skipped_stores`.
MAX_LOWER_WRITES_IN_FLIGHT = 32
# Keys of the shared remote the manager remembers (`extra_config: remote_index_max_keys`);
# the oldest are forgotten first (the remote may evict them silently anyway).
REMOTE_INDEX_MAX_KEYS = 1 << 20
# `wait` on a lookup id it does not know waits this long for its prefetch (the client
# sends prefetch without waiting, so a wait may overtake it).
WAIT_FOR_PREFETCH_SECS = 1.0


@dataclass(slots=True)
class _Lookup:
    """A lookup with pins or a prefetch in flight, until its get, unpin or lease end."""

    lookup_id: str
    deadline: float
    cpu_incarnation: str | None
    ends: list[int] = field(default_factory=list)
    refs: dict[CacheKey, ChunkRef] = field(default_factory=dict)
    ready: int = 0  # chunks of the prefix ready in CPU
    task: asyncio.Task | None = None
    closed: bool = False


def _kind(tier: str) -> str:
    """The tier name of a plan segment ("peer:<manager>" -> "peer")."""
    return TIER_PEER if tier.startswith(TIER_PEER + ":") else tier


def _tokens(ends: Sequence[int], n: int) -> int:
    return ends[n - 1] if n else 0


def _as_key(item: CacheKey | ChunkSpan) -> CacheKey:
    return item.key if isinstance(item, ChunkSpan) else item


def _split(spans: Sequence[ChunkSpan] | PackedSpans) -> tuple[list[CacheKey], list[int]]:
    if isinstance(spans, PackedSpans):
        return spans.keys(), list(spans.ends)
    try:
        return [s.key for s in spans], [s.end for s in spans]
    except AttributeError:
        raise InvalidInputError(
            "expected a list of ChunkSpan (start, end, key), e.g. from KeyMaker.keys(tokens), "
            "or PackedSpans.of(spans)"
        ) from None


def _remote_backend(url: str | None) -> str:
    return (url or "").partition("://")[0] or "none"


def _here() -> dict[str, Any]:
    """Soft affinity to the calling node, so the tiers sit beside their first user."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
    except Exception:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}


def _actor_options(name: str, namespace: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "get_if_exists": True,
        "lifetime": "detached",
        "num_cpus": 0,
        **ACTOR_OPTIONS,
    }


def _pinned(node_id: str | None) -> dict[str, Any]:
    """Hard affinity to `node_id` (a node-scoped actor), else soft affinity to the caller."""
    if node_id is None:
        return _here()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _scoped(base: str, node_id: str | None) -> str:
    return node_scoped_name(base, node_id) if node_id else base


def get_or_create_tiers(config: RayKVConfig, node_id: str | None = None) -> dict[str, Any]:
    """Create or attach the enabled tier actors of `config`, by name; tier -> handle.

    With `node_id`, the CPU store is node-scoped too (`raykv-cpu-store-<node>`, pinned
    to that node); without, it is the cluster-wide `raykv-cpu-store`.
    """
    ns = config.namespace
    tiers: dict[str, Any] = {}
    if config.local_cpu:
        tiers[TIER_CPU] = CPUStoreActor.options(
            **_actor_options(_scoped(CPU_STORE_NAME, node_id), ns), **_pinned(node_id)
        ).remote(
            config.max_local_cpu_bytes,
            config.policy_for(TIER_CPU),
            blocking_timeout_secs=config.blocking_timeout_secs,
            pin_lease_secs=config.pin_lease_secs,
        )
    if config.local_disk:
        from raykv.actors.disk_store import get_or_create_disk_store

        # Node-scoped, pinned to this node: its directory is local.
        tiers[TIER_DISK] = get_or_create_disk_store(config, node_id)
    if config.remote_url:
        from raykv.actors.remote_store import get_or_create_remote_store

        # This node's connection to the shared remote (the data lives on the remote).
        tiers[TIER_REMOTE] = get_or_create_remote_store(config, node_id)
    return tiers


def get_or_create_manager(config: RayKVConfig, node_id: str | None = None) -> Any:
    """The `StorageManager` of `config.namespace`; it creates or attaches its tiers.

    The manager is detached, so the cache outlives the driver that created it; it
    creates the tier actors itself (on its node), so they do not die with the caller.
    Without `node_id` it is the cluster-wide `raykv-storage-manager`; with one, it is
    that node's manager (`raykv-storage-manager-<node>`, with its own CPU store, both
    pinned to the node): one cache instance per node, peers of each other.
    """
    name = _scoped(STORAGE_MANAGER_NAME, node_id)
    return StorageManager.options(
        **_actor_options(name, config.namespace), **_pinned(node_id)
    ).remote(config, node_id)


def manager_name(node_id: str) -> str:
    """The name of `node_id`'s node-scoped storage manager."""
    return node_scoped_name(STORAGE_MANAGER_NAME, node_id)


def shutdown_manager(namespace: str) -> None:
    """Kill the manager and tier actors of `namespace` (for tests and `raykv` tooling).

    The remote's data (a `ray://` KVServer, a Redis server) is shared and left alone.
    """
    names = [STORAGE_MANAGER_NAME, CPU_STORE_NAME, CONTROLLER_NAME]
    prefixes = (STORAGE_MANAGER_NAME, CPU_STORE_NAME, DISK_STORE_NAME, REMOTE_STORE_NAME)
    names += [
        a["name"]
        for a in _named_actors(namespace)
        if a["name"].startswith(prefixes) and a["name"] not in names
    ]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass


def _named_actors(namespace: str) -> list[dict[str, Any]]:
    try:
        return [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == namespace
        ]
    except Exception:
        return []


@ray.remote
class StorageManager:
    """The cache's single entry point: write-all puts, prefix lookups across tiers,
    prefetch into CPU, and gets that promote lower-tier hits into CPU.

    Every method runs on one event loop (one concurrency group), so prefetch tasks
    can be awaited by `wait` and `get`.
    """

    def __init__(self, config: RayKVConfig, node_id: str | None = None) -> None:
        self._config = config
        self._node_id = node_id
        self._tiers = get_or_create_tiers(config, node_id)
        self._order = [t for t in TIER_ORDER if t in self._tiers]
        self._lower_tiers = [t for t in self._order if t != TIER_CPU]
        self._cpu_handle = self._tiers.get(TIER_CPU)
        self._cpu: dict[CacheKey, ChunkRef] = {}
        extra = config.extra_config
        self._remote_index_max = int(extra.get("remote_index_max_keys", REMOTE_INDEX_MAX_KEYS))
        self._max_writes = int(extra.get("max_lower_writes_in_flight", MAX_LOWER_WRITES_IN_FLIGHT))
        self._lower: dict[str, set[CacheKey] | BoundedKeySet] = {
            t: self._new_lower_index(t) for t in self._lower_tiers
        }
        self._writes_in_flight = {t: 0 for t in self._lower_tiers}
        self._skip_warned_at = 0.0
        self._arrivals: dict[str, asyncio.Event] = {}  # waits that overtook their prefetch
        self._incarnations: dict[str, str | None] = {t: None for t in self._order}
        self._lookups: dict[str, _Lookup] = {}
        self._background: set[asyncio.Task] = set()
        self._started: asyncio.Task | None = None
        self._resyncing: dict[str, asyncio.Task] = {}
        self._lookup_timeout = config.lookup_timeout_ms / 1000
        self._pull_timeout = self._lookup_timeout * PULL_TIMEOUT_FACTOR
        self._lease = config.pin_lease_secs
        self._backend = _remote_backend(config.remote_url)
        self._counts = {
            "lookups": 0,
            "hit_tokens": 0,
            "miss_tokens": 0,
            "retrieved_tokens": 0,
            "puts": 0,
            "remote_errors": 0,
            "stale_positives": 0,
            "resyncs": 0,
            "skipped_lower_writes": 0,
            "pull_timeouts": 0,
        }
        self._tier_hits = {t: 0 for t in self._order}
        self._tier_misses = {t: 0 for t in self._order}
        # The controller and the peer tier (config.enable_controller); instance = node id.
        self._reporter: ControllerReporter | None = None
        self._controller: Any = None
        self._hold = HandoutHold()
        self._peers: dict[str, Any] = {}  # manager name -> handle
        self._peer_instances: dict[str, str] = {}  # manager name -> instance
        self._name = _scoped(STORAGE_MANAGER_NAME, node_id)
        if config.enable_controller:
            self._instance = node_id or ray.get_runtime_context().get_node_id()
            self._reporter = ControllerReporter(self._instance)
            self._controller = get_or_create_controller(config.namespace)
            self._tier_hits[TIER_PEER] = self._tier_misses[TIER_PEER] = 0

    def _new_lower_index(
        self, tier: str, keys: Iterable[CacheKey] = ()
    ) -> set[CacheKey] | BoundedKeySet:
        if tier == TIER_REMOTE:
            return BoundedKeySet(self._remote_index_max, keys)
        return set(keys)

    # ----- start-up, restarts, background tasks -----

    async def _ready(self) -> None:
        """First call after (re)start: rebuild the whole index from the tiers."""
        if self._started is not None and self._started.done():
            return
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._startup())
        await asyncio.shield(self._started)

    async def _startup(self) -> None:
        await asyncio.gather(*(self._resync(t) for t in self._order))
        self._spawn(self._watch_incarnations())
        self._spawn(self._sweep_leases())
        if self._reporter is not None:
            self._spawn(self._report_loop())

    def _spawn(self, coro: Any, name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _resync(self, tier: str) -> None:
        """Rebuild one tier's index from the tier itself."""
        handle = self._tiers[tier]
        try:
            if tier == TIER_CPU:
                inc, snap = await asyncio.wait_for(handle.snapshot.remote(), CONTROL_TIMEOUT_SECS)
                self._cpu = dict(snap)
                for rec in self._lookups.values():
                    if rec.cpu_incarnation != inc:
                        rec.refs.clear()  # objects of a dead CPUStore are gone
                        rec.ready = 0
            else:
                inc_ref, keys_ref = handle.incarnation.remote(), handle.keys.remote()
                inc = await asyncio.wait_for(inc_ref, CONTROL_TIMEOUT_SECS)
                keys = await asyncio.wait_for(keys_ref, CONTROL_TIMEOUT_SECS)
                self._lower[tier] = self._new_lower_index(tier, keys)
        except Exception as exc:
            logger.warning("cannot resync the %s tier index (%s); will retry", tier, exc)
            if tier == TIER_CPU:
                self._cpu.clear()
            return
        if self._reporter is not None:
            self._reporter.lost()  # the controller gets the rebuilt index as a snapshot
        if self._incarnations[tier] is not None:
            logger.info("the %s tier restarted (incarnation %s); index rebuilt", tier, inc[:8])
        self._incarnations[tier] = inc
        self._counts["resyncs"] += 1

    def _schedule_resync(self, tier: str) -> None:
        if tier not in self._resyncing:
            task = self._spawn(self._resync(tier))
            self._resyncing[tier] = task
            task.add_done_callback(lambda _t: self._resyncing.pop(tier, None))

    def _note_cpu(self, incarnation: str) -> bool:
        """True if `incarnation` is the CPUStore we know; else drop the CPU index and resync."""
        if incarnation == self._incarnations.get(TIER_CPU):
            return True
        self._cpu.clear()
        self._schedule_resync(TIER_CPU)
        return False

    async def _check_incarnation(self, tier: str) -> None:
        try:
            inc = await asyncio.wait_for(
                self._tiers[tier].incarnation.remote(), CONTROL_TIMEOUT_SECS
            )
        except Exception as exc:
            logger.debug("incarnation of %s unavailable: %s", tier, exc)
            return
        if inc != self._incarnations[tier]:
            if tier == TIER_CPU:
                self._cpu.clear()
            await self._resync(tier)

    async def _watch_incarnations(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_INTERVAL_SECS)
            await asyncio.gather(*(self._check_incarnation(t) for t in self._order))

    async def _sweep_leases(self) -> None:
        """Release lookups whose client never came back (died, or forgot to get/unpin)."""
        every = min(max(self._lease / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for lookup_id in [k for k, r in self._lookups.items() if r.deadline <= now]:
                logger.info("lookup %s: lease expired, releasing its pins", lookup_id)
                self._close(lookup_id)

    def _close(self, lookup_id: str) -> _Lookup | None:
        rec = self._lookups.pop(lookup_id, None)
        if rec is not None:
            rec.closed = True
            # A prefetch still loading unpins when it finishes (it may pin more first).
            loading = rec.task is not None and not rec.task.done()
            if self._cpu_handle is not None and not loading:
                self._cpu_handle.unpin.remote(lookup_id)
        return rec

    # ----- index walks -----

    def _plan(
        self, keys: list[CacheKey], tiers: Sequence[str]
    ) -> tuple[list[tuple[str, int, int]], int]:
        """Segments (tier, start, stop) of the prefix the indexes know; and its length."""
        segs: list[tuple[str, int, int]] = []
        pos, n = 0, len(keys)
        for tier in tiers:
            index = self._cpu if tier == TIER_CPU else self._lower[tier]
            end = pos
            while end < n and keys[end] in index:
                end += 1
            if end > pos:
                segs.append((tier, pos, end))
                pos = end
        return segs, pos

    async def _probe_remote(self, keys: list[CacheKey]) -> int:
        """How many of `keys` (unknown to every index) the remote tier holds as a prefix."""
        try:
            found = await asyncio.wait_for(
                self._tiers[TIER_REMOTE].contains.remote(keys),
                self._lookup_timeout * REMOTE_PROBE_SHARE,
            )
        except Exception as exc:
            self._remote_error("contains", exc)
            return 0
        n = 0
        while n < len(found) and found[n]:
            n += 1
        self._lower[TIER_REMOTE].update(keys[:n])
        return n

    def _remote_error(self, what: str, exc: BaseException) -> None:
        self._counts["remote_errors"] += 1
        metrics.inc("raykv_remote_errors", backend=self._backend)
        logger.warning("remote %s failed or timed out (%r); counted as misses", what, exc)

    async def _full_plan(
        self, keys: list[CacheKey], tiers: Sequence[str]
    ) -> tuple[list[tuple[str, int, int]], int]:
        segs, n = self._plan(keys, tiers)
        if n < len(keys) and self._peer_tier_on() and tiers is self._order:
            peer = await self._locate_peer(keys[n:])
            if peer is not None:
                segs.append((peer[0], n, n + peer[1]))
                n += peer[1]
        if n < len(keys) and TIER_REMOTE in tiers:
            found = await self._probe_remote(keys[n:])
            if found:
                if segs and segs[-1][0] == TIER_REMOTE:
                    segs[-1] = (TIER_REMOTE, segs[-1][1], n + found)
                else:
                    segs.append((TIER_REMOTE, n, n + found))
                n += found
        return segs, n

    def _tiers_for(self, search_range: Sequence[str] | None) -> list[str]:
        if search_range is None:
            return self._order
        unknown = set(search_range) - set(TIER_ORDER)
        if unknown:
            raise InvalidInputError(
                f"unknown tier(s) {sorted(unknown)} in search_range; allowed: {list(TIER_ORDER)}"
            )
        return [t for t in self._order if t in search_range]

    def _count_lookup(self, segs: list[tuple[str, int, int]], ends: list[int], n: int) -> None:
        hit = _tokens(ends, n)
        miss = _tokens(ends, len(ends)) - hit
        self._counts["lookups"] += 1
        self._counts["hit_tokens"] += hit
        self._counts["miss_tokens"] += miss
        metrics.inc("raykv_lookups")
        metrics.inc("raykv_hit_tokens", hit)
        metrics.inc("raykv_miss_tokens", miss)
        remaining = len(ends)
        for tier, a, b in segs:
            tokens = ends[b - 1] - (ends[a - 1] if a else 0)
            kind = _kind(tier)
            self._tier_hits[kind] += b - a
            self._tier_misses[kind] += remaining - (b - a)
            remaining -= b - a
            metrics.inc("raykv_tier_hit_tokens", tokens, tier=kind)

    # ----- CPU index upkeep -----

    def _apply_cpu(self, ack: CPUAck) -> None:
        if not self._note_cpu(ack.incarnation):
            return
        for key in ack.evicted:
            self._cpu.pop(key, None)
        for key in (*ack.accepted, *ack.present):
            chunk = ack.refs.get(key)
            if chunk is not None:
                self._cpu[key] = chunk
        if self._reporter is not None:
            self._reporter.evicted(TIER_CPU, ack.evicted)
            self._reporter.admitted(TIER_CPU, ack.accepted)

    async def _pull(self, tier: str, keys: list[CacheKey], lookup_id: str | None) -> CPUAck | None:
        """Promote `keys` from a lower tier into CPU (without a CPU tier: serve the tier's
        own reply object); None if that failed or timed out (then they are misses)."""
        peer = tier.partition(":")[2] if _kind(tier) == TIER_PEER else None
        source = self._peers.get(peer) if peer else self._tiers[tier]
        if source is None:
            return None
        try:
            if self._cpu_handle is None:
                ack = await self._read_lower(source, keys)
            else:
                ack = await asyncio.wait_for(
                    self._cpu_handle.pull.remote(source, keys, lookup_id, copy=peer is not None),
                    self._pull_timeout,
                )
        except (asyncio.TimeoutError, TimeoutError):
            self._counts["pull_timeouts"] += 1
            logger.warning(
                "read of %d chunks from %s took over %.1f s; counted as misses",
                len(keys),
                tier,
                self._pull_timeout,
            )
            return None
        except Exception as exc:
            logger.warning("read of %d chunks from %s failed: %s", len(keys), tier, exc)
            return None
        if self._cpu_handle is not None:
            self._apply_cpu(ack)
        if peer and len(ack.missing) == len(keys):
            self._lost_peer(peer)
        if ack.missing and tier in self._lower:
            stale = self._lower[tier].intersection(ack.missing)
            if stale:  # the index believed them present: correct it
                self._lower[tier].difference_update(stale)
                self._counts["stale_positives"] += len(stale)
        if ack.refs and tier in self._lower:
            self._lower[tier].update(ack.refs)
        return ack

    async def _read_lower(self, source: Any, keys: list[CacheKey]) -> CPUAck:
        """Without a CPU tier: read `keys` from `source` (a tier actor's handle) and serve
        its reply object as is.

        The manager calls `get_batch` itself, so it owns the arrays object and hands out
        `ChunkRef`s into it (clients borrow them); nothing is cached.
        """
        metas_ref, arrays_ref = source.get_batch.options(num_returns=2).remote(keys)
        metas = await asyncio.wait_for(metas_ref, self._pull_timeout)
        ack = CPUAck("")
        for i, (key, meta) in enumerate(zip(keys, metas, strict=True)):
            if meta is None:
                ack.missing.append(key)
            else:
                ack.refs[key] = ChunkRef(arrays_ref, i, meta)
        if ack.refs:  # handed out, not kept: hold it past the clients' borrow
            self._hold.hold(arrays_ref, sum(c.meta.nbytes for c in ack.refs.values()))
        return ack

    # ----- public API -----

    async def put(
        self,
        keys: Sequence[CacheKey | ChunkSpan] | PackedSpans,
        metas: Sequence[PayloadMeta],
        batch: list[ray.ObjectRef],
    ) -> PutResult:
        """Write-all: cache `ray.get(batch[0])[i]` under `keys[i]` in CPU (awaited), then
        write it to disk and remote in the background.

        `batch` is a one-element list holding the client's batch ref (a list, so Ray
        passes the ref instead of the value). Returns what the CPU tier did.
        """
        await self._ready()
        t0 = time.perf_counter()
        keys = keys.keys() if isinstance(keys, PackedSpans) else [_as_key(k) for k in keys]
        metas = list(metas)
        if len(keys) != len(metas):
            raise InvalidInputError(f"got {len(keys)} keys but {len(metas)} metas")
        if not isinstance(batch, list) or len(batch) != 1:
            raise InvalidInputError("batch must be a list holding one ObjectRef: [ray.put(arrays)]")
        result = PutResult()
        lower_batch = batch
        if self._cpu_handle is not None:
            try:
                ack = await self._cpu_handle.put.remote(keys, metas, batch)
            except Exception as exc:
                logger.warning("CPU tier put failed (%s); lower tiers still written", exc)
                ack = None
            if ack is not None:
                self._apply_cpu(ack)
                result = PutResult(len(ack.accepted), len(ack.present), len(ack.skipped))
                lower_batch = self._owned_batch(keys, ack) or batch
        self._write_lower(keys, metas, lower_batch)
        self._counts["puts"] += 1
        metrics.observe("raykv_store_latency_ms", (time.perf_counter() - t0) * 1000)
        return result

    def _owned_batch(self, keys: list[CacheKey], ack: CPUAck) -> list[ray.ObjectRef] | None:
        """The CPUStore's copy when it holds exactly `keys` in order: it outlives the writer."""
        if ack.accepted != keys:
            return None
        first = ack.refs[keys[0]].ref
        for i, key in enumerate(keys):
            chunk = ack.refs[key]
            if chunk.index != i or chunk.ref != first:
                return None
        return [first]

    def _write_lower(
        self, keys: list[CacheKey], metas: list[PayloadMeta], batch: list[ray.ObjectRef]
    ) -> None:
        for tier in self._lower_tiers:
            if all(k in self._lower[tier] for k in keys):
                continue
            if self._writes_in_flight[tier] >= self._max_writes:
                self._skip_lower(tier, len(keys))
                continue
            self._writes_in_flight[tier] += 1
            ref = self._tiers[tier].put.remote(keys, metas, batch)
            self._spawn(self._finish_lower_put(tier, ref, keys, metas), name=f"raykv-put-{tier}")

    def _skip_lower(self, tier: str, n: int) -> None:
        """A put finds `tier` with `_max_writes` writes in flight: skip it there."""
        self._counts["skipped_lower_writes"] += n
        metrics.inc("raykv_skipped_stores", n, tier=tier)
        now = time.monotonic()
        if now - self._skip_warned_at > 10.0:
            self._skip_warned_at = now
            logger.warning(
                "%s tier has %d writes in flight: skipping %d chunk(s) there (the tier is slower "
                "than the put rate)",
                tier,
                self._writes_in_flight[tier],
                n,
            )

    async def _finish_lower_put(
        self, tier: str, ref: Any, keys: list[CacheKey], metas: list[PayloadMeta]
    ) -> None:
        try:
            ack: PutAck = await ref
        except Exception as exc:
            if tier == TIER_REMOTE:
                self._remote_error("put", exc)
            else:
                logger.warning("%s put failed: %s", tier, exc)
            return
        finally:
            self._writes_in_flight[tier] -= 1
        index = self._lower[tier]
        index.difference_update(ack.evicted)
        index.update(ack.accepted)
        if self._reporter is not None and tier == TIER_DISK:
            self._reporter.evicted(tier, ack.evicted)
            self._reporter.admitted(tier, ack.accepted)
        # The disk tier counts the bytes it writes itself; the remote tiers do not.
        if ack.accepted and tier != TIER_DISK:
            accepted = set(ack.accepted)
            nbytes = sum(m.nbytes for k, m in zip(keys, metas, strict=True) if k in accepted)
            metrics.inc("raykv_stored_bytes", nbytes, tier=tier)

    async def lookup(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        pin: bool = False,
        search_range: Sequence[str] | None = None,
        lookup_id: str | None = None,
    ) -> int:
        """Prefix tokens available across tiers (CPU, then disk, then remote).

        Each tier serves the longest prefix of the keys left by the tiers before it; a
        miss ends the prefix. With `pin` (needs `lookup_id`) the CPU part stays cached
        until `get(..., lookup_id)`, `unpin(lookup_id)` or the lease ends.
        """
        await self._ready()
        keys, ends = _split(spans)
        tiers = self._tiers_for(search_range)
        segs, n = await self._full_plan(keys, tiers)
        self._count_lookup(segs, ends, n)
        if pin:
            if lookup_id is None:
                raise InvalidInputError("lookup(pin=True) needs a lookup_id to unpin with")
            if segs and segs[0][0] == TIER_CPU:
                self._pin(self._record(lookup_id, ends), keys[: segs[0][2]])
        return _tokens(ends, n)

    def _record(self, lookup_id: str, ends: list[int]) -> _Lookup:
        rec = self._lookups.get(lookup_id)
        if rec is None:
            rec = _Lookup(
                lookup_id,
                time.monotonic() + self._lease,
                self._incarnations.get(TIER_CPU),
                ends,
            )
            self._lookups[lookup_id] = rec
        return rec

    def _pin(self, rec: _Lookup, keys: list[CacheKey]) -> None:
        """Pin CPU hits: the manager holds their refs, the CPUStore is told without waiting
        (the refs keep the data readable even if the message loses a race with an evict;
        a pin that arrives after its unpin is ignored by the CPUStore).

        Nothing to do for a lookup already closed (a get or unpin came while it probed).
        """
        if rec.closed:
            return
        got = 0
        for key in keys:
            chunk = self._cpu.get(key)  # the index may have changed during a probe
            if chunk is None:
                break
            rec.refs[key] = chunk
            got += 1
        rec.ready = max(rec.ready, got)
        if got:
            self._cpu_handle.pin.remote(rec.lookup_id, keys[:got], self._lease)

    async def prefetch(
        self,
        lookup_id: str,
        spans: Sequence[ChunkSpan] | PackedSpans,
        search_range: Sequence[str] | None = None,
    ) -> None:
        """Start loading the prefix of `spans` into CPU and return at once.

        Lower-tier loads run concurrently, one batched pull per tier; the loaded
        chunks are pinned under `lookup_id` until its get or unpin. See `wait`.
        """
        await self._ready()
        keys, ends = _split(spans)
        tiers = self._tiers_for(search_range)
        self._close(lookup_id)
        rec = self._record(lookup_id, ends)
        rec.task = asyncio.get_running_loop().create_task(self._load(rec, keys, tiers))
        arrived = self._arrivals.pop(lookup_id, None)
        if arrived is not None:
            arrived.set()

    async def _load(self, rec: _Lookup, keys: list[CacheKey], tiers: list[str]) -> int:
        t0 = time.perf_counter()
        segs, n = await self._full_plan(keys, tiers)
        self._count_lookup(segs, rec.ends, n)
        if segs and segs[0][0] == TIER_CPU:
            self._pin(rec, keys[: segs[0][2]])
            segs = segs[1:]
        pulls = await asyncio.gather(
            *(self._pull(tier, keys[a:b], rec.lookup_id) for tier, a, b in segs)
        )
        for (_tier, a, b), ack in zip(segs, pulls, strict=True):
            if ack is None:
                break
            got = 0
            for key in keys[a:b]:
                chunk = ack.refs.get(key)
                if chunk is None:
                    break
                rec.refs[key] = chunk
                got += 1
            rec.ready = a + got
            if got < b - a:
                break
        if rec.closed and self._cpu_handle is not None:
            self._cpu_handle.unpin.remote(rec.lookup_id)  # unpinned while loading
        metrics.observe("raykv_prefetch_latency_ms", (time.perf_counter() - t0) * 1000)
        return rec.ready

    async def wait(self, lookup_id: str, timeout: float | None = None) -> int:
        """Prefix tokens of `lookup_id`'s prefetch ready in CPU (0 if unknown).

        Waits for the prefetch to finish, or at most `timeout` seconds and then
        reports what is ready so far. An id not known yet gets up to
        `WAIT_FOR_PREFETCH_SECS` (at most `timeout`) for its prefetch to arrive.
        """
        rec = self._lookups.get(lookup_id)
        if rec is None:
            rec, timeout = await self._await_prefetch(lookup_id, timeout)
            if rec is None:
                return 0
        if rec.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(rec.task), timeout)
            except asyncio.TimeoutError:
                pass
            except Exception as exc:  # a failed load shortens the prefix, never the request
                logger.warning("prefetch %s failed: %s", lookup_id, exc)
        return _tokens(rec.ends, rec.ready)

    async def _await_prefetch(
        self, lookup_id: str, timeout: float | None
    ) -> tuple[_Lookup | None, float | None]:
        """Wait (bounded) for `lookup_id`'s prefetch to arrive; (its record, time left)."""
        budget = WAIT_FOR_PREFETCH_SECS if timeout is None else min(timeout, WAIT_FOR_PREFETCH_SECS)
        if budget <= 0:
            return None, timeout
        arrived = self._arrivals.setdefault(lookup_id, asyncio.Event())
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(arrived.wait(), budget)
        except (asyncio.TimeoutError, TimeoutError):
            if self._arrivals.get(lookup_id) is arrived:
                del self._arrivals[lookup_id]
            return None, timeout
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        return self._lookups.get(lookup_id), left

    async def get(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        lookup_id: str | None = None,
        check_cpu: bool = False,
    ) -> RetrieveResult:
        """The chunks of the longest available prefix, served from CPU.

        Lower-tier hits are promoted into CPU (one pull per tier, concurrently).
        Releases `lookup_id`'s pins and applies this request's hits as one
        prefix-closed touch. Pass `check_cpu=True` after a read failed with
        `OwnerDiedError` (the CPUStore restarted): the manager then confirms the
        CPUStore's incarnation before answering.
        """
        await self._ready()
        t0 = time.perf_counter()
        keys, ends = _split(spans)
        if check_cpu and self._cpu_handle is not None:
            await self._check_incarnation(TIER_CPU)
        rec = self._lookups.pop(lookup_id, None) if lookup_id is not None else None
        if rec is not None:
            rec.closed = True
            if rec.task is not None:
                try:
                    await asyncio.shield(rec.task)
                except Exception as exc:
                    logger.warning("prefetch %s failed: %s", lookup_id, exc)
        held = rec.refs if rec is not None else {}
        result = RetrieveResult()
        n = len(keys)
        i = 0
        while i < n:
            chunk = held.get(keys[i]) or self._cpu.get(keys[i])
            if chunk is None:
                break
            result.chunks.append(chunk)
            result.tiers.append(TIER_CPU)
            i += 1
        if i < n:  # without a CPU tier, lower-tier hits are served without promotion
            await self._get_lower(keys, i, result)
        if self._cpu_handle is not None and (result.chunks or lookup_id is not None):
            touched = [k for k in keys[: len(result.chunks)] if k in self._cpu]
            # Sent after this reply is on its way: the client does not wait for it.
            asyncio.get_running_loop().call_soon(self._release, lookup_id, touched)
        result.hit_tokens = _tokens(ends, len(result.chunks))
        self._counts["retrieved_tokens"] += result.hit_tokens
        metrics.observe("raykv_retrieve_latency_ms", (time.perf_counter() - t0) * 1000)
        return result

    def _release(self, lookup_id: str | None, touched: list[CacheKey]) -> None:
        self._cpu_handle.release.remote(lookup_id, touched)

    async def _get_lower(self, keys: list[CacheKey], start: int, result: RetrieveResult) -> None:
        """Extend `result` from `keys[start:]` with lower-tier hits, promoted into CPU.

        Local lower tiers first (by index), then a peer's CPU tier (if the controller
        knows one), then the shared remote tier for the rest. A peer that comes back
        short leaves the rest to the remote tier.
        """
        segs: list[tuple[str, int, int]] = []
        pos, n = start, len(keys)
        for tier in self._lower_tiers:
            if tier == TIER_REMOTE:
                continue
            end = pos
            while end < n and keys[end] in self._lower[tier]:
                end += 1
            if end > pos:
                segs.append((tier, pos, end))
                pos = end
        if pos < n and self._peer_tier_on():
            peer = await self._locate_peer(keys[pos:])
            if peer is not None:
                segs.append((peer[0], pos, pos + peer[1]))
                pos += peer[1]
        if pos < n and TIER_REMOTE in self._tiers:
            segs.append((TIER_REMOTE, pos, n))  # keys no index knows may be on the remote
        if not segs:
            return
        pulls = await asyncio.gather(*(self._pull(t, keys[a:b], None) for t, a, b in segs))
        for (tier, a, b), ack in zip(segs, pulls, strict=True):
            got = self._extend(result, keys[a:b], ack, _kind(tier))
            if got < b - a:
                if _kind(tier) == TIER_PEER and TIER_REMOTE in self._tiers:
                    ack = await self._pull(TIER_REMOTE, keys[a + got :], None)
                    self._extend(result, keys[a + got :], ack, TIER_REMOTE)
                return

    @staticmethod
    def _extend(result: RetrieveResult, keys: list[CacheKey], ack: CPUAck | None, tier: str) -> int:
        """Append the prefix of `keys` that `ack` served; how many that was."""
        got = 0
        for key in keys if ack is not None else ():
            chunk = ack.refs.get(key)
            if chunk is None:
                break
            result.chunks.append(chunk)
            result.tiers.append(tier)
            got += 1
        return got

    # ----- the controller and the peer tier -----

    def _peer_tier_on(self) -> bool:
        return self._reporter is not None and self._cpu_handle is not None

    async def _locate_peer(self, keys: list[CacheKey]) -> tuple[str, int] | None:
        """("peer:<manager>", chunks) of the peer holding the longest prefix of `keys` in
        its CPU tier, per the controller; None if none (or the controller is away)."""
        try:
            found = await asyncio.wait_for(
                self._controller.locate.remote(keys, [self._instance]), self._lookup_timeout / 2
            )
        except Exception as exc:
            logger.debug("controller locate failed: %s", exc)
            return None
        if not found:
            return None
        instance, name, n = found
        if name not in self._peers:
            try:
                self._peers[name] = ray.get_actor(name, namespace=self._config.namespace)
            except ValueError:
                self._controller.forget.remote(instance)  # that manager is gone
                return None
        self._peer_instances[name] = instance
        return f"{TIER_PEER}:{name}", n

    def _lost_peer(self, name: str) -> None:
        """A peer served none of what the controller listed (dead, or the listing was
        stale): drop our handle and let the controller forget it; a live peer is rebuilt
        from its next heartbeat, which then asks for a resync."""
        self._peers.pop(name, None)
        instance = self._peer_instances.pop(name, None)
        if instance is not None:
            self._controller.forget.remote(instance)

    def _snapshot(self) -> dict[str, list[CacheKey]]:
        snap = {TIER_CPU: list(self._cpu)}
        if TIER_DISK in self._lower:
            snap[TIER_DISK] = list(self._lower[TIER_DISK])
        return snap

    async def _report_loop(self) -> None:
        """Flush admit/evict batches to the controller; resync when it asks (lost batch,
        controller restart), periodically, or when our own index was rebuilt."""
        rep = self._reporter
        info = {"manager": self._name, "node_id": self._node_id}
        last_full = last_sent = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_SECS)
            now = time.monotonic()
            try:
                if rep.needs_resync or now - last_full >= RESYNC_PERIOD_SECS:
                    seq = rep.start_resync()
                    ref = self._controller.resync.remote(
                        self._instance, seq, self._snapshot(), info
                    )
                    await asyncio.wait_for(ref, CONTROL_TIMEOUT_SECS)
                    last_full = last_sent = now
                    continue
                if not rep.pending and now - last_sent < HEARTBEAT_SECS:
                    continue
                while True:
                    batch = rep.take()
                    ref = self._controller.report.remote(
                        self._instance, batch.seq, batch.admitted, batch.evicted
                    )
                    if await asyncio.wait_for(ref, CONTROL_TIMEOUT_SECS):
                        rep.lost()
                        break
                    if not rep.full():
                        break
                last_sent = now
            except Exception as exc:
                logger.debug("controller report failed (%s); will resync", exc)
                rep.lost()

    @ray.method(num_returns=2)
    async def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list]:
        """The peer tier's read (`LowerTier.get_batch`): this node's CPU chunks of `keys`,
        copied into one new object that the caller (another node's CPUStore) owns."""
        await self._ready()
        chunks = [self._cpu.get(k) for k in keys]
        refs = list({c.ref: None for c in chunks if c is not None})
        try:
            values = dict(zip(refs, await asyncio.gather(*refs), strict=True))
        except Exception as exc:  # our CPUStore restarted: misses
            logger.warning("peer read of %d chunks failed: %s", len(refs), exc)
            return [None] * len(keys), [_EMPTY] * len(keys)
        metas = [c.meta if c is not None else None for c in chunks]
        arrays = [values[c.ref][c.index] if c is not None else _EMPTY for c in chunks]
        return metas, arrays

    async def unpin(self, lookup_id: str) -> None:
        """Release the pins of `lookup_id` without reading (the request was dropped)."""
        rec = self._close(lookup_id)
        if rec is None and self._cpu_handle is not None:
            self._cpu_handle.unpin.remote(lookup_id)

    async def remove(
        self, keys: Sequence[CacheKey | ChunkSpan], search_range: Sequence[str] | None = None
    ) -> int:
        """Drop `keys` from the tiers (all, or those in `search_range`); chunks removed."""
        await self._ready()
        keys = [_as_key(k) for k in keys]
        tiers = self._tiers_for(search_range)
        for tier in tiers:
            if tier == TIER_CPU:
                for key in keys:
                    self._cpu.pop(key, None)
            else:
                self._lower[tier].difference_update(keys)
            if self._reporter is not None:
                self._reporter.evicted(tier, keys)
        counts = await asyncio.gather(
            *(self._tiers[t].remove.remote(keys) for t in tiers), return_exceptions=True
        )
        return sum(c for c in counts if isinstance(c, int))

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until background lower-tier writes are acknowledged and the disk tier has
        written them; False on timeout. For tests, benchmarks and orderly shutdowns."""
        await self._ready()
        pending = [t for t in self._background if t.get_name().startswith("raykv-put")]
        try:
            if pending:
                await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout)
            if TIER_DISK in self._tiers:
                return bool(await asyncio.wait_for(self._tiers[TIER_DISK].flush.remote(), timeout))
        except asyncio.TimeoutError:
            return False
        return True

    async def stats(self) -> dict[str, Any]:
        """Per tier: entries, used bytes, capacity, hits/misses, evictions; overall hit rate."""
        await self._ready()
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(self._tiers[t].stats.remote(), CONTROL_TIMEOUT_SECS)
                for t in self._order
            ),
            return_exceptions=True,
        )
        tiers: dict[str, Any] = {}
        for tier, reply in zip(self._order, replies, strict=True):
            info = dict(reply) if isinstance(reply, dict) else {"error": repr(reply)}
            info["index_entries"] = len(self._cpu if tier == TIER_CPU else self._lower[tier])
            info["lookup_hit_chunks"] = self._tier_hits[tier]
            info["lookup_miss_chunks"] = self._tier_misses[tier]
            info["incarnation"] = self._incarnations[tier]
            tiers[tier] = info
        if TIER_PEER in self._tier_hits:
            tiers[TIER_PEER] = {
                "tier": TIER_PEER,
                "lookup_hit_chunks": self._tier_hits[TIER_PEER],
                "lookup_miss_chunks": self._tier_misses[TIER_PEER],
                "peers": sorted(self._peers),
            }
        looked = self._counts["hit_tokens"] + self._counts["miss_tokens"]
        return {
            **self._counts,
            "hit_rate": self._counts["hit_tokens"] / looked if looked else 0.0,
            "open_lookups": len(self._lookups),
            "tiers": tiers,
        }

    async def clear(self) -> None:
        """Empty every tier and the index."""
        await self._ready()
        for lookup_id in list(self._lookups):
            self._close(lookup_id)
        await asyncio.gather(
            *(self._tiers[t].clear.remote() for t in self._order), return_exceptions=True
        )
        self._cpu.clear()
        for index in self._lower.values():
            index.clear()
        if self._reporter is not None:
            self._reporter.lost()

    async def incarnations(self) -> dict[str, str | None]:
        """The incarnation of each tier the index was built from."""
        await self._ready()
        return dict(self._incarnations)

    async def tier_handles(self) -> dict[str, Any]:
        """tier name -> actor handle (for tools and tests)."""
        return dict(self._tiers)
