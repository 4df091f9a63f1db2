"""ManagerCore: the state and logic of the cache's one entry point (`StorageManager`).

All it knows about the tiers lives in one `raykv.tiers.index.PrefixIndex` (plain Python,
unit-tested without Ray); it makes the batched calls to the tier actors and feeds their
replies into the index. One client call per request.

Keys that no index knows are asked of the remote tier (other instances may have written
them) in one call bounded by `lookup_timeout_ms`. A background task polls every tier
once a second: a new incarnation resyncs that tier's index (a restarted CPU store lost
its objects, a restarted disk tier rebuilt from its files), a CPU ack that never arrived
resyncs the CPU index, and a tier whose actor died for good is re-created at once while
the other tiers keep serving. A restarted manager rebuilds its whole index from the tiers.

Keys are passed as `ChunkSpan`s (token range + key) so that answers are in tokens: a hit
prefix of n chunks is worth `spans[n-1].end` tokens.

Its coroutines run on the `StorageManager` actor's event loop; its `try_*` methods run
on the actor's Ray threads under the loop's lock (see `raykv.actors.storage_manager`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from raykv import metrics
from raykv.actors.base import STORAGE_MANAGER_NAME, actor_name
from raykv.actors.common import put_own, supervised
from raykv.actors.peers import ControllerLink, PeerReply, add_gathered, plan_reply
from raykv.actors.tierset import TierSet
from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, ChunkSpan, KeyIdentity, leading
from raykv.payload import PayloadMeta
from raykv.tiers.cpulog import Cursor
from raykv.tiers.index import Lookup, tokens
from raykv.tiers.lease import sweep_forever
from raykv.tiers.lookup import LookupPlan, Need
from raykv.tiers.remote import RemoteStore
from raykv.wire import (
    TIER_CPU,
    TIER_DISK,
    TIER_PEER,
    TIER_REMOTE,
    ChunkRef,
    CPUAck,
    PackedSpans,
    PutResult,
    RetrieveResult,
    TailCandidates,
    as_keys,
    kind,
    split_spans,
)

logger = logging.getLogger(__name__)

# Engine key names `note_engine` remembers per namespace.
MAX_ENGINE_NAMES = 64
# `wait` on a lookup id it does not know waits this long for its prefetch to arrive.
WAIT_FOR_PREFETCH_SECS = 1.0
# What a call given a timeout may take beyond it to answer (its reply on a busy machine).
CONTROL_SLACK_SECS = 5.0


def _failed(task: asyncio.Task) -> bool:
    """Whether a finished task was cancelled or raised."""
    return task.cancelled() or task.exception() is not None


@dataclass(slots=True)
class RemoteProbe:
    """A lookup plan that needs a `ray://` remote, asked from a Ray thread
    (`ManagerCore.try_lookup`): `ask` runs without the manager's lock, `finish_probe`
    under it."""

    store: RemoteStore
    trial: bool
    plan: LookupPlan
    pin: bool
    lookup_id: str | None
    found: list[bool] | None = None
    error: BaseException | None = None

    def ask(self) -> None:
        """Ask the server which keys of the plan's `missing` it holds (blocks, bounded)."""
        try:
            ask = self.store.contains_blocking
            self.found = ask(self.plan.missing, self.store.timeout_s)  # type: ignore[misc]
        except Exception as exc:  # a timeout, a dead server: a miss, counted
            self.error = exc


def _check_pin(pin: bool, lookup_id: str | None) -> None:
    if pin and lookup_id is None:
        raise InvalidInputError("lookup(pin=True) needs a lookup_id to unpin with")


class ManagerCore:
    """The manager's state and logic: write-all puts, prefix lookups across tiers,
    prefetch into CPU, and gets that promote lower-tier hits into CPU.

    Its coroutines run on one event loop (the `StorageManager` actor's), so prefetch
    tasks can be awaited by `wait`/`get`. The `try_*` methods are the same answers made
    synchronously, for a request the index alone can answer; they return None when the
    request needs the loop (a tier call, a prefetch to wait for, start-up).
    """

    def __init__(self, config: RayKVConfig, node_id: str | None = None) -> None:
        self._config = config
        self._node_id = node_id
        self._name = actor_name(STORAGE_MANAGER_NAME, node_id)
        link = None
        if config.enable_controller:
            instance = node_id or ray.get_runtime_context().get_node_id()
            timeout = config.lookup_timeout_ms / 2000
            link = ControllerLink(config.namespace, instance, self._name, node_id, timeout)
        self._t = TierSet(config, node_id, link)
        self._index = self._t.index
        self._link = link
        self._tiers = self._t.handles
        self._arrivals: dict[str, asyncio.Event] = {}  # waits that overtook their prefetch
        self._engines: dict[str, str] = {}  # key model name -> engine layout (note_engine)
        self._started: asyncio.Task | None = None

    # ----- start-up, restarts, background tasks -----

    @property
    def started(self) -> bool:
        """Whether start-up (the index rebuilt from the tiers) has finished, and not by
        raising (then the next call starts it again)."""
        task = self._started
        return task is not None and task.done() and not _failed(task)

    async def _ready(self) -> None:
        """First call after (re)start: rebuild the whole index from the tiers (again
        after a start-up that raised)."""
        started = self._started
        if started is None or (started.done() and _failed(started)):
            self._started = asyncio.get_running_loop().create_task(self._startup())
        if not self._started.done():
            await asyncio.shield(self._started)

    async def _startup(self) -> None:
        try:
            await asyncio.gather(*(self._t.resync(t) for t in self._index.order))
        finally:  # even after a resync that raised: the loops heal it
            if not self._t.loops_spawned:
                self._t.loops_spawned = True
                self._spawn_loops()

    def _spawn_loops(self) -> None:
        """The manager's background loops: tier health checks, lease expiry, reports."""
        t, lease, link = self._t, self._config.pin_lease_secs, self._link
        t.spawn(supervised("tier watch", t.watch))
        t.spawn(supervised("lease sweep", lambda: sweep_forever(lease, self._expire_lookups)))
        if link is not None:
            t.spawn(supervised("controller report", lambda: link.report_loop(t.index.snapshot)))

    def _expire_lookups(self) -> list[str]:
        """Release lookups whose client never came back (died, or forgot to get/unpin)."""
        expired = self._index.expired()
        for lookup_id in expired:
            logger.info("lookup %s: lease expired, releasing its pins", lookup_id)
            self._close(lookup_id)
        return expired

    def _close(self, lookup_id: str, early: bool = False) -> Lookup | None:
        rec = self._index.close(lookup_id, early)
        # A prefetch still loading unpins when it finishes (it may pin more first).
        if rec is not None and self._t.cpu is not None and not rec.loading():
            self._t.cpu.unpin.remote(lookup_id)
        return rec

    # ----- plans and pulls -----

    def _plan(
        self, spans: Sequence[ChunkSpan] | PackedSpans, tiers: Sequence[str], remote: bool = True
    ) -> LookupPlan:
        """A lookup's plan over `tiers` (see `raykv.tiers.lookup`): a peer is asked only
        over all tiers; the remote with `remote`."""
        keys, ends = split_spans(spans)
        return self._plan_keys(keys, ends, tiers, remote)

    def _plan_keys(
        self, keys: list[CacheKey], ends: list[int], tiers: Sequence[str], remote: bool = True
    ) -> LookupPlan:
        """`_plan` of spans already split (a prefetch needed their ends first)."""
        peer = self._peer_tier_on() and tiers is self._index.order
        return LookupPlan.start(self._index, keys, ends, tiers, peer=peer, remote=remote)

    async def _drive(self, plan: LookupPlan, pull: bool = False) -> LookupPlan:
        """The manager loop's driver: every step the plan needs, awaited. `pull`: the
        plan's segments are pulled next (a peer may then be asked ahead)."""
        while (need := plan.need()) is not Need.NOTHING:
            if need is Need.PEER:
                plan.give_peer(await self._t.locate_peer(plan.missing, ahead=pull))
            else:
                found, failed = await self._t.probe_remote(plan.missing)
                self._give_remote(plan, found, failed)
        return plan

    def _give_remote(self, plan: LookupPlan, found: list[bool] | None, failed: bool) -> None:
        if failed:  # counted in raykv_remote_errors by the probe
            self._index.counts["remote_errors"] += 1
        self._index.found_remote(plan.give_remote(found, failed))

    def _count_lookup(self, plan: LookupPlan) -> None:
        hit, miss = plan.finish(self._index)
        metrics.inc("raykv_lookups")
        metrics.inc("raykv_hit_tokens", hit)
        metrics.inc("raykv_miss_tokens", miss)
        for tier, n in plan.tier_tokens():
            metrics.inc("raykv_tier_hit_tokens", n, tier=tier)

    # ----- public API -----

    async def put(
        self,
        keys: Sequence[CacheKey | ChunkSpan] | PackedSpans,
        metas: Sequence[PayloadMeta],
        batch: list[ray.ObjectRef],
        priority: int | None = None,
        prefix: Sequence[CacheKey] | None = None,
    ) -> PutResult:
        """Write-all: cache `ray.get(batch[0])[i]` under `keys[i]` in CPU (awaited), then
        write it to disk and remote in the background.

        `batch` is a one-element list holding the client's batch ref (a list, so Ray
        passes the ref instead of the value). `priority` reaches the tiers' policies (the
        `priority` policy uses it); `prefix` names the request's chunks before `keys`
        (stored earlier), which the tiers keep at least as recent (prefix-closed).
        Returns what the CPU tier did.
        """
        await self._ready()
        t0 = time.perf_counter()
        keys, metas = as_keys(keys), list(metas)
        if len(keys) != len(metas):
            raise InvalidInputError(f"got {len(keys)} keys but {len(metas)} metas")
        if not isinstance(batch, list) or len(batch) != 1:
            raise InvalidInputError("batch must be a list holding one ObjectRef: [ray.put(arrays)]")
        extra: dict[str, Any] = {} if priority is None else {"priority": priority}
        if prefix:  # the request's cached chunks before these: kept at least as recent
            extra["prefix"] = list(prefix)
        result, lower_batch, cpu = PutResult(), batch, self._t.cpu
        if cpu is not None:
            try:
                ack = await cpu.put.remote(keys, metas, batch, **extra)
            except Exception as exc:
                logger.warning("CPU tier put failed (%s); lower tiers still written", exc)
                if isinstance(exc, ActorDiedError):
                    self._t.schedule_check(TIER_CPU)
                ack = None
            if ack is not None:
                self._t.apply_cpu(ack)
                result = PutResult(len(ack.accepted), len(ack.present), len(ack.skipped))
                lower_batch = self._owned_batch(keys, ack) or batch
        self._t.write_lower(keys, metas, lower_batch, extra)
        self._index.counts["puts"] += 1
        metrics.observe("raykv_store_latency_ms", (time.perf_counter() - t0) * 1000)
        return result

    @staticmethod
    def _owned_batch(keys: list[CacheKey], ack: CPUAck) -> list[ray.ObjectRef] | None:
        """The CPU store's copy when it holds exactly `keys` in order: it outlives the writer."""
        if ack.accepted != keys:
            return None
        first = ack.refs[keys[0]].ref
        if any(ack.refs[k].index != i or ack.refs[k].ref != first for i, k in enumerate(keys)):
            return None
        return [first]

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
        _check_pin(pin, lookup_id)
        plan = await self._drive(self._plan(spans, self._index.tiers_for(search_range)))
        return self._finish_lookup(plan, pin, lookup_id)

    async def lookup_local(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        pin: bool = False,
        lookup_id: str | None = None,
    ) -> int:
        """`lookup` without asking the remote server for keys no index knows: for a client
        that asks the `ray://` server itself, at the same time (`client_remote_probe`).

        A lookup that comes back short is counted when that client reports what the
        server held (`note_remote`); a complete one is counted now."""
        await self._ready()
        _check_pin(pin, lookup_id)
        plan = await self._drive(self._plan(spans, self._index.order, remote=False))
        return self._finish_lookup(plan, pin, lookup_id, count=plan.complete)

    def note_remote(
        self, spans: Sequence[ChunkSpan] | PackedSpans, start: int, found: int, failed: bool
    ) -> None:
        """What the remote server held of a `lookup_local` that came back with `start`
        chunks: the `found` chunks after them (now indexed as remote hits, so a `get`
        pulls them from there), or `failed` if the client's probe failed. Counts that
        lookup."""
        keys, ends = split_spans(spans)
        ok = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not (ok(start) and ok(found) and 0 <= start and 0 <= found <= len(keys) - start):
            raise InvalidInputError(
                f"note_remote: start={start!r} and found={found!r} must be ints with "
                f"0 <= start and 0 <= found <= {len(keys)} - start"
            )
        if failed:  # counted in raykv_remote_errors by the client
            self._index.counts["remote_errors"] += 1
        if found and TIER_REMOTE in self._index.lower:  # a manager without one only counts
            self._index.found_remote(keys[start : start + found])
        # Per-tier figures from what the index knows now (a peer's share counts as a miss
        # of the tiers); the totals are the lookup's.
        segs, _ = self._index.plan(keys[: start + found], self._index.order)
        self._count_lookup(LookupPlan(keys, ends, segs, start + found, False, False))

    def try_lookup(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        pin: bool = False,
        search_range: Sequence[str] | None = None,
        lookup_id: str | None = None,
        probe: bool = True,
    ) -> int | RemoteProbe | None:
        """The manager thread's driver: `lookup` from the index alone; or a `RemoteProbe`
        to ask of a `ray://` remote from the calling thread and finish with
        `finish_probe`; or None if the loop must drive the plan (start-up, a peer to
        ask, a Redis remote). Without `probe`, the same for `lookup_local` (never a
        `RemoteProbe`)."""
        if not self.started:
            return None
        _check_pin(pin, lookup_id)
        plan = self._plan(spans, self._index.tiers_for(search_range), remote=probe)
        need = plan.need()
        if need is Need.PEER:
            return None
        if need is Need.REMOTE:
            store = self._t.blocking_probe()
            if store is None:
                return None
            trial = store.admit()
            if trial is not None:
                return RemoteProbe(store, trial, plan, pin, lookup_id)
            plan.give_remote(None)  # the breaker is open: a miss, as the loop would answer
        count = probe or plan.complete  # a short lookup_local is counted by note_remote
        return self._finish_lookup(plan, pin, lookup_id, count=count)

    def finish_probe(self, probe: RemoteProbe) -> int:
        """The end of a lookup whose remote probe ran on a Ray thread (`try_lookup`)."""
        probe.store.settle("contains", probe.trial, probe.error)
        self._give_remote(probe.plan, probe.found, probe.error is not None)
        return self._finish_lookup(probe.plan, probe.pin, probe.lookup_id)

    def _finish_lookup(
        self, plan: LookupPlan, pin: bool, lookup_id: str | None, count: bool = True
    ) -> int:
        if count:
            self._count_lookup(plan)
        if pin and plan.cpu_prefix():
            rec = self._index.record(lookup_id, plan.ends)  # type: ignore[arg-type]
            self._pin(rec, plan.keys[: plan.cpu_prefix()])
        return plan.hit_tokens

    def _pin(self, rec: Lookup, keys: list[CacheKey]) -> None:
        """Pin CPU hits: the index holds their refs, the CPU store is told without waiting
        (the refs keep the data readable even if the message loses a race with an evict;
        a pin that arrives after its unpin is ignored by the CPU store)."""
        got = self._index.pin(rec, keys)
        if got and self._t.cpu is not None:
            self._t.cpu.pin.remote(rec.lookup_id, keys[:got], self._index.leases.secs)

    async def prefetch(
        self,
        lookup_id: str,
        spans: Sequence[ChunkSpan] | PackedSpans,
        search_range: Sequence[str] | None = None,
        tails: Any = None,
        direct: bool = False,
    ) -> None:
        """Start loading the prefix of `spans` into CPU and return at once; the loaded
        chunks are pinned under `lookup_id` until its get or unpin. See `wait`. `tails`
        (`TailCandidates.wire`): candidate partial chunks, one of which may extend the
        prefix past its whole chunks (`LookupPlan.with_tail`). `direct`: the caller
        reads this node's disk files itself, so a prefix that goes on only on disk is
        ready at once, unpinned and touched there (`LookupPlan.direct_disk`)."""
        await self._ready()
        keys, ends = split_spans(spans)
        candidates = TailCandidates.from_wire(tails) if tails is not None else None
        if candidates is not None and keys and keys[0].identity != candidates.identity(0):
            raise InvalidInputError("tails: keyed for another model, world size or dtype")
        tiers = self._index.tiers_for(search_range)
        self._close(lookup_id)
        rec = self._index.record(lookup_id, ends)
        if not rec.closed:  # else its get or unpin came first: nothing to load or pin
            rec.ranks = {k.worker_id for k in keys}
            load = self._load(rec, keys, ends, tiers, candidates, direct)
            rec.task = asyncio.get_running_loop().create_task(load)
        arrived = self._arrivals.pop(lookup_id, None)
        if arrived is not None:
            arrived.set()

    async def _load(
        self,
        rec: Lookup,
        keys: list[CacheKey],
        ends: list[int],
        tiers: list[str],
        tails: TailCandidates | None = None,
        direct: bool = False,
    ) -> int:
        t0 = time.perf_counter()
        plan = await self._drive(self._plan_keys(keys, ends, tiers), pull=True)
        if tails is not None:
            plan = plan.with_tail(self._index, tails, tiers)
            rec.ends = plan.ends
        self._count_lookup(plan)
        rec.sources = plan.sources()
        keys, segs = plan.keys, plan.segs
        disk = plan.direct_disk() if direct else None
        if plan.cpu_prefix():
            self._pin(rec, keys[: plan.cpu_prefix()])
            segs = segs[1:]
        if disk is not None:  # read by the caller from the files: nothing to promote
            segs = []
            if rec.ready == disk[1] and not rec.closed:  # the CPU run all pinned
                rec.ready = disk[2]
                self._t.read_directly(keys[disk[1] : disk[2]])
        pulls = await asyncio.gather(
            *(self._t.pull(tier, keys[a:b], rec.lookup_id) for tier, a, b in segs)
        )
        for (_tier, a, b), ack in zip(segs, pulls, strict=True):
            if ack is None or not self._index.take_loaded(rec, keys[a:b], a, ack):
                break
        if rec.closed and self._t.cpu is not None:
            self._t.cpu.unpin.remote(rec.lookup_id)  # unpinned while loading
        metrics.observe("raykv_prefetch_latency_ms", (time.perf_counter() - t0) * 1000)
        return rec.ready

    async def wait(
        self, lookup_id: str, timeout: float | None = None, sources: bool = False
    ) -> int | tuple[int, list[tuple[str, int]]]:
        """Prefix tokens of `lookup_id`'s prefetch ready in CPU (0 if unknown).

        Waits for the prefetch to finish, or at most `timeout` seconds and then reports
        what is ready so far. An id not known yet gets up to `WAIT_FOR_PREFETCH_SECS`
        (at most `timeout`) for its prefetch to arrive. With `sources`, also where the
        prefix was found: `[(tier kind, prefix tokens up to the end of its run), ...]`.
        """
        n = await self._wait(lookup_id, timeout)
        if not sources:
            return n
        rec = self._index.lookups.get(lookup_id)
        return n, list(rec.sources) if rec is not None else []

    async def fetch(
        self,
        lookup_id: str,
        spans: Sequence[ChunkSpan] | PackedSpans,
        timeout: float | None = None,
        search_range: Sequence[str] | None = None,
        tails: Any = None,
        direct: bool = False,
    ) -> tuple[int, list[tuple[str, int]]]:
        """`prefetch`, then `wait(sources=True)`, in one call: a pinned lookup that
        promotes what it finds below CPU (the vLLM connector's; `direct`: see
        `prefetch`). A lookup with nothing pinned by then is closed (no pins to release;
        a load still running drops what it brings)."""
        await self.prefetch(lookup_id, spans, search_range, tails, direct)
        rec = self._index.lookups.get(lookup_id)
        if rec is None:  # ended by an unpin that came first
            return 0, []
        n, sources = await self.wait(lookup_id, timeout, sources=True)  # type: ignore[misc]
        if n == 0 or not rec.refs:
            self._close(lookup_id)
        return n, sources

    async def _wait(self, lookup_id: str, timeout: float | None) -> int:
        rec = self._index.lookups.get(lookup_id)
        if rec is None:
            budget = (
                WAIT_FOR_PREFETCH_SECS if timeout is None else min(timeout, WAIT_FOR_PREFETCH_SECS)
            )
            arrived = self._arrivals.setdefault(lookup_id, asyncio.Event())
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(arrived.wait(), max(budget, 0.0))
            except (asyncio.TimeoutError, TimeoutError):
                if self._arrivals.get(lookup_id) is arrived:
                    del self._arrivals[lookup_id]
                return 0
            timeout = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
            rec = self._index.lookups.get(lookup_id)
            if rec is None:
                return 0
        if rec.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(rec.task), timeout)
            except asyncio.TimeoutError:
                pass
            except Exception as exc:  # a failed load shortens the prefix, never the request
                logger.warning("prefetch %s failed: %s", lookup_id, exc)
        return tokens(rec.ends, rec.ready)

    async def get(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        lookup_id: str | None = None,
        check_cpu: bool = False,
        ids: bool = False,
    ) -> tuple:
        """The chunks of the longest available prefix, served from CPU, as the plain tuple
        `RetrieveResult.wire()` (read it with `RetrieveResult.of`: a plain tuple costs the
        caller ~0.1-0.25 ms less per call than a pickled object).

        Lower-tier hits are promoted into CPU (one pull per tier, concurrently).
        Releases `lookup_id`'s pins and applies this request's hits as one prefix-closed
        touch. Pass `check_cpu=True` after a read failed with `OwnerDiedError` (the CPU
        store restarted or died): the manager then checks the CPU store before answering.
        With `ids`, batches are named by object id instead of ref (`RetrieveResult.wire`).
        """
        await self._ready()
        t0 = time.perf_counter()
        keys, ends = split_spans(spans)
        if check_cpu and TIER_CPU in self._tiers:
            await self._t.check(TIER_CPU)
        rec, last = self._index.read(lookup_id, keys) if lookup_id is not None else (None, True)
        if rec is not None and rec.task is not None:
            try:
                await asyncio.shield(rec.task)
            except Exception as exc:
                logger.warning("prefetch %s failed: %s", lookup_id, exc)
        result = self._index.collect(keys, rec.refs if rec is not None else {})
        if len(result.chunks) < len(keys):  # lower-tier hits, promoted into CPU
            await self._get_lower(keys, len(result.chunks), result)
        return self._finish_get(keys, ends, lookup_id if last else None, result, t0, ids)

    def try_get(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        lookup_id: str | None = None,
        ids: bool = False,
    ) -> tuple | None:
        """`get` from CPU alone, or None if it needs the loop: a prefetch still loading,
        or a miss that a lower tier, a peer or the remote might extend."""
        if not self.started:
            return None
        t0 = time.perf_counter()
        keys, ends = split_spans(spans)
        rec = self._index.lookups.get(lookup_id) if lookup_id is not None else None
        if rec is not None and rec.task is not None and not rec.task.done():
            return None
        result = self._index.collect(keys, rec.refs if rec is not None else {})
        if len(result.chunks) < len(keys) and self._may_extend_get(keys, len(result.chunks)):
            return None
        last = self._index.read(lookup_id, keys)[1] if lookup_id is not None else True
        return self._finish_get(keys, ends, lookup_id if last else None, result, t0, ids)

    def _may_extend_get(self, keys: list[CacheKey], start: int) -> bool:
        """Whether `_get_lower` could add chunks after `keys[:start]`."""
        segs, _ = self._index.local_lower_plan(keys, start)
        return bool(segs) or self._peer_tier_on() or self._index.up(TIER_REMOTE)

    def _finish_get(
        self,
        keys: list[CacheKey],
        ends: list[int],
        lookup_id: str | None,
        result: RetrieveResult,
        t0: float,
        ids: bool,
    ) -> tuple:
        if TIER_CPU in self._tiers and (result.chunks or lookup_id is not None):
            touched = [k for k in keys[: len(result.chunks)] if k in self._index.cpu]
            self._t.queue_release(lookup_id, touched)  # batched; the client does not wait
        result.hit_tokens = tokens(ends, len(result.chunks))
        self._index.counts["retrieved_tokens"] += result.hit_tokens
        metrics.observe("raykv_retrieve_latency_ms", (time.perf_counter() - t0) * 1000)
        return result.wire(ids)

    async def _get_lower(self, keys: list[CacheKey], start: int, result: RetrieveResult) -> None:
        """Extend `result` from `keys[start:]`: local lower tiers first (by index), then a
        peer's CPU tier (if the controller knows one), then the shared remote tier for the
        rest. A peer that comes back short leaves the rest to the remote tier."""
        segs, pos = self._index.local_lower_plan(keys, start)
        n = len(keys)
        if pos < n and self._peer_tier_on():
            peer = await self._t.locate_peer(keys[pos:], ahead=True)
            if peer is not None:
                segs.append((peer[0], pos, pos + peer[1]))
                pos += peer[1]
        if pos < n and self._index.up(TIER_REMOTE):
            segs.append((TIER_REMOTE, pos, n))  # keys no index knows may be on the remote
        pulls = await asyncio.gather(*(self._t.pull(t, keys[a:b], None) for t, a, b in segs))
        for (tier, a, b), ack in zip(segs, pulls, strict=True):
            got = self._extend(result, keys[a:b], ack, kind(tier))
            if got < b - a:
                if kind(tier) == TIER_PEER and self._index.up(TIER_REMOTE):
                    gap = keys[a + got : b]  # what follows it was pulled from the remote
                    ack = await self._t.pull(TIER_REMOTE, gap, None)
                    if self._extend(result, gap, ack, TIER_REMOTE) == len(gap):
                        continue
                return

    @staticmethod
    def _extend(result: RetrieveResult, keys: list[CacheKey], ack: CPUAck | None, tier: str) -> int:
        """Append the prefix of `keys` that `ack` served; how many that was."""
        got = leading(keys, 0, ack.refs) if ack is not None else 0
        result.chunks.extend(ack.refs[k] for k in keys[:got])
        result.tiers.extend([tier] * got)
        return got

    # ----- the peer tier -----

    def _peer_tier_on(self) -> bool:
        return self._link is not None and self._t.cpu is not None

    def try_peer_read(self, keys: list[CacheKey]) -> PeerReply | None:
        """`peer_read` on the calling Ray thread, or None if it needs the loop (start-up,
        or chunks to gather into a new object)."""
        if not self.started:
            return None
        reply, rest = plan_reply([self._index.cpu.get(k) for k in keys])
        return None if rest else reply

    async def peer_read(self, keys: list[CacheKey]) -> PeerReply:
        """The peer tier's read, for another node's manager (`raykv.actors.peers`):
        `(metas, objects, places)` for `keys` from this node's CPU tier (`plan_reply`:
        whole batch objects as they are, other chunks gathered into one new object). The
        reader's CPU store copies what it keeps into its own object store (it cannot own
        another node's objects)."""
        await self._ready()
        chunks = [self._index.cpu.get(k) for k in keys]
        reply, rest = plan_reply(chunks)
        if rest:
            try:
                gathered = await self._gather([chunks[i] for i in rest])  # type: ignore[misc]
            except Exception as exc:  # our CPU store restarted: those are misses
                logger.warning("peer read of %d chunks failed: %s", len(rest), exc)
                gathered = None
            add_gathered(reply, rest, gathered)
        return reply

    @staticmethod
    async def _gather(chunks: list[ChunkRef]) -> ray.ObjectRef:
        """One new object (owned here) holding `chunks`' arrays, in order."""
        refs = list({c.ref: None for c in chunks})
        values = dict(zip(refs, await asyncio.gather(*refs), strict=True))
        arrays = [values[c.ref][c.index] for c in chunks]
        return await put_own(arrays, sum(c.meta.nbytes for c in chunks))

    def cpu_events(
        self, cursor: Cursor | None, identity: KeyIdentity, tiers: Sequence[str] | None = None
    ) -> tuple[Cursor, list | None]:
        """What entered and left the CPU tier since `cursor` for the keys of `identity`
        (`CPULog.since`): the vLLM connector's KV events poll it. With `tiers` (CPU and
        disk), those tiers' events (`CPULog.since_tiers`): its CPU view does."""
        if tiers is None:
            return self._t.cpu_log.since(cursor, identity)
        return self._t.cpu_log.since_tiers(cursor, identity, tiers)

    def cpu_keys(self, identity: KeyIdentity, tier: str = TIER_CPU) -> list[str]:
        """The chunk hashes of `identity`'s keys that `tier` (CPU or disk) holds now: the
        snapshot the vLLM connector's CPU view starts from when the log cannot say what
        changed."""
        if tier not in (TIER_CPU, TIER_DISK) or tier not in self._tiers:
            return []
        want = tuple(identity)
        return [k[3] for k in self._index.held(tier) if (k[0], k[1], k[2], k[4]) == want]

    async def unpin(self, lookup_id: str) -> None:
        """Release the pins of `lookup_id` without reading (the request was dropped)."""
        if self._close(lookup_id, early=True) is None and self._t.cpu is not None:
            self._t.cpu.unpin.remote(lookup_id)

    async def remove(
        self, keys: Sequence[CacheKey | ChunkSpan], search_range: Sequence[str] | None = None
    ) -> int:
        """Drop `keys` from the tiers (all, or those in `search_range`); chunks removed."""
        await self._ready()
        keys = as_keys(keys)
        tiers = self._index.tiers_for(search_range)
        self._index.remove(keys, tiers)
        self._t.flush_releases()  # touches queued before this removal reach the store first
        counts = await asyncio.gather(
            *(self._tiers[t].remove.remote(keys) for t in tiers), return_exceptions=True
        )
        return sum(c for c in counts if isinstance(c, int))

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until background lower-tier writes are acknowledged and the disk tier has
        written them; False on timeout. For tests, benchmarks and orderly shutdowns."""
        await self._ready()
        t0 = time.monotonic()
        pending = self._t.pending_writes()
        if pending:  # waited for, never cancelled: their acks must still reach the index
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                return False
        if TIER_DISK not in self._tiers:
            return True
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        try:  # the disk actor gives up at `left` too: none of its threads waits on
            ref = self._tiers[TIER_DISK].flush.remote(left)
            slack = None if left is None else left + CONTROL_SLACK_SECS
            return bool(await asyncio.wait_for(ref, slack))
        except asyncio.TimeoutError:
            return False

    async def note_engine(self, model_name: str, layout: str) -> dict[str, str]:
        """Record that an engine keyed as `model_name` (its layout in words) uses this
        namespace; the other key names of the same model (before `~`): engines of another
        layout (TP, backend, block size...), e.g. a cache-warming job, whose chunks the
        caller can never hit. The last `MAX_ENGINE_NAMES` are kept."""
        if not (isinstance(model_name, str) and isinstance(layout, str)):
            raise InvalidInputError("note_engine takes a key model name and a layout string")
        self._engines.pop(model_name, None)
        self._engines[model_name] = layout[:500]
        while len(self._engines) > MAX_ENGINE_NAMES:
            self._engines.pop(next(iter(self._engines)))
        model, engines = model_name.partition("~")[0], self._engines.items()
        return {n: t for n, t in engines if n != model_name and n.partition("~")[0] == model}

    async def stats(self) -> dict[str, Any]:
        """Per tier: entries, used bytes, capacity, hits/misses, evictions; overall hit rate."""
        await self._ready()
        return await self._t.stats()

    async def clear(self) -> None:
        """Empty every tier and the index."""
        await self._ready()
        for lookup_id in self._index.clear():
            if self._t.cpu is not None:
                self._t.cpu.unpin.remote(lookup_id)
        await asyncio.gather(
            *(self._tiers[t].clear.remote() for t in self._index.order), return_exceptions=True
        )
        self._index.clear()

    async def incarnations(self) -> dict[str, str | None]:
        """The incarnation of each tier the index was built from."""
        await self._ready()
        return dict(self._index.incarnations)

    async def indexed_keys(self, tier: str) -> list[CacheKey]:
        """The keys the index says `tier` holds, to check it against the tier's own `keys()`
        (tools and tests; a remote tier's index is a bounded sample)."""
        await self._ready()
        if tier not in self._index.order:
            raise InvalidInputError(f"tier {tier!r} is not enabled; enabled: {self._index.order}")
        return list(self._index.held(tier))

    async def read_directly(self, keys: list[CacheKey], bad: Sequence[CacheKey] = ()) -> None:
        """A client read `keys` from the disk files itself, unasked (a vLLM hit from the
        scheduler's view): promoted or touched as after a direct lookup. The files of
        `bad` it found gone or corrupt: dropped from the disk tier, as its own read would."""
        await self._ready()
        if TIER_DISK in self._tiers and keys:
            self._t.read_directly(list(keys))
        if TIER_DISK in self._tiers and bad:
            await self.remove(list(bad), [TIER_DISK])

    async def tier_handles(self) -> dict[str, Any]:
        """tier name -> actor handle (for tools and tests)."""
        return dict(self._tiers)


__all__ = ["ManagerCore", "RemoteProbe", "WAIT_FOR_PREFETCH_SECS"]
