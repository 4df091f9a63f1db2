"""What the vLLM connector's scheduler side sends its workers each engine step (the loads
and saves of the step: vLLM pickles the metadata to every worker), what it keeps of each
request and load, what it tells vLLM's stats of a hit (the tiers it came from), and who
filled a hit (`Fillers`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from raykv import metrics
from raykv.tiers.budget import BoundedKeySet
from raykv.wire import TIER_CPU, TIER_DISK

try:  # vLLM >= 0.30: the connector's hits are split by tier in vLLM's own stats
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - depends on the vLLM version
    CacheHitSource = None  # type: ignore[assignment,misc]

_HIT_SOURCES: dict[str, Any] = (
    {}
    if CacheHitSource is None
    else {
        "cpu": CacheHitSource.HOST,
        "disk": CacheHitSource.DISK,
        "peer": CacheHitSource.P2P,
        "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
    }
)


@dataclass(slots=True)
class LoadSpec:
    """Copy tokens [start, end) of a request from raykv into its blocks.

    `hashes` are vLLM's block hashes at the ends of the chunks holding them (chunk i ends at
    token (i + 1) * chunk_size; the last at `tail` when that is a partial chunk: `chunk_ends`),
    `block_ids` the request's blocks from token 0. `sync`: copy before this step's forward pass
    (else on the loader thread). `lookup_id` names the lookup whose pins the read releases
    (None: nothing pinned, the scheduler's CPU view answered, or the hit is read from the disk
    files alone). `direct_from`: the token where the hit's run on this node's disk tier starts,
    whose chunks the worker reads from the files itself (`disk_direct_reads`; None: every chunk
    comes from the manager's `get`); `unasked`: no lookup told the manager of that run (the
    scheduler's view answered), so the worker does, to have them promoted or touched."""

    req_id: str
    lookup_id: str | None
    hashes: list[bytes]
    start: int
    end: int
    block_ids: list[int]
    sync: bool
    tail: int = 0
    direct_from: int | None = None
    unasked: bool = False


@dataclass(slots=True)
class SaveSpec:
    """Store the chunks of tokens [start, end) of a request (`start` chunk-aligned, `end`
    too unless it is `tail`: a prompt's partial last chunk, `save_unfull_chunk`);
    `hashes` key every chunk of [0, end)."""

    req_id: str
    hashes: list[bytes]
    start: int
    end: int
    block_ids: list[int]
    tail: int = 0


def in_step_blocks(loads: list[LoadSpec], block: int) -> set[int]:
    """The blocks that the in-step (`sync`) loads of a step write."""
    return {b for spec in loads if spec.sync for b in spec.block_ids[spec.start // block :]}


def chunk_ends(n: int, chunk: int, tail: int = 0) -> list[int]:
    """Where each of `n` chunks from token 0 ends: at multiples of `chunk`, the last at
    `tail` when it is a partial chunk (`tail` > 0)."""
    ends = [(i + 1) * chunk for i in range(n)]
    if tail and ends:
        ends[-1] = tail
    return ends


@dataclass(slots=True)
class RequestState:
    """The scheduler's view of one request."""

    request: Any  # vLLM's Request: its tokens and block hashes grow as it decodes
    lookup_id: str
    preemptions: int
    lookup: Future | None = None  # the lookup in flight
    deadline: float = 0.0  # when an unanswered lookup counts as a miss
    hit: int = 0  # prefix tokens raykv holds (not a chunk multiple: ends in a partial chunk)
    pinned: bool = False  # the manager holds a lookup record (pins) under lookup_id
    local: int = 0  # tokens vLLM's own prefix cache supplied (block-aligned)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # tokens [0, saved) are in raykv (whole chunks)
    sync_load: bool = False  # its load is copied in its step (sync mode, or a small hit)
    sources: list[tuple[str, int]] = field(default_factory=list)  # where raykv found it
    lower: bool = False  # answered from the view with chunks on disk: loaded async
    tail_saved: bool = False  # its prompt's partial last chunk was planned for saving
    load_planned: bool = False  # a load of its hit was sent to the workers
    # Tokens computed once its answered hit is loaded (0: none pending). A request
    # scheduled with fewer had a load fail part-way: vLLM recomputes from the first
    # failed block, and those chunks (missing from raykv) are saved again.
    expect: int = 0


@dataclass(slots=True)
class LoadProgress:
    """How far an async load got: written by its loader thread after each copy, read by
    `get_finished` (which waits for a load about to end: `load_wait_ms`)."""

    start: int  # tokens [start, end) to load
    end: int
    began: float = 0.0  # perf_counter when its read began (0: not yet)
    done: int = 0  # the token the blocks written so far reach (<= start: none yet)
    at: float = 0.0  # perf_counter of the last copy

    def eta(self, now: float) -> float | None:
        """Seconds until the load ends at its rate so far; None before its first copy."""
        if self.done <= self.start or self.at <= self.began:
            return None
        rate = (self.done - self.start) / (self.at - self.began)
        return max(0.0, (self.end - self.done) / rate - (now - self.at))


@dataclass(slots=True)
class WorkerLoad:
    """An asynchronous load on a worker: its spec, its loader thread's future (the block
    ids it could not write), a flag that stops it at the next chunk, and its progress."""

    spec: LoadSpec
    future: Future
    stop: threading.Event
    progress: LoadProgress


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    """What the workers load and save in one engine step, and the blocks the step may
    write (`writes`: those allocated to the requests it schedules; a deferred save copy
    that reads one of them ends before the step runs, `WorkerSide.handle_preemptions`)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    writes: set[int] = field(default_factory=set)


def direct_start(sources: list[tuple[str, int]], world_size: int = 1) -> int | None:
    """Where a hit's disk run starts (a token) when its `sources` are a CPU run, or none,
    then one disk run: the shape a direct lookup answers without promoting
    (`LookupPlan.direct_disk`) and that the worker then reads from the files; else None.
    With several ranks only a hit wholly on disk (a CPU run's end in tokens does not say
    whether it ended inside a chunk, on one rank's key: the manager promotes such hits)."""
    if not sources or sources[-1][0] != TIER_DISK or len(sources) > 2:
        return None
    if len(sources) == 1:
        return 0
    return sources[0][1] if sources[0][0] == TIER_CPU and world_size == 1 else None


def hit_source_split(sources: list[tuple[str, int]], start: int, end: int) -> dict[Any, int]:
    """Tokens [start, end) of a hit by vLLM's `CacheHitSource`, from a lookup's `sources`
    (`[(tier, prefix tokens up to the end of its run), ...]`): CPU -> host, disk -> disk,
    a peer's CPU -> p2p, the remote store -> external_unspecified. Tokens no source
    covers (never expected) count as external_unspecified: said, not guessed."""
    other = CacheHitSource.EXTERNAL_UNSPECIFIED
    split: dict[Any, int] = {}
    low = 0
    for tier, high in sources:
        n = min(end, high) - max(start, low)
        if n > 0:
            source = _HIT_SOURCES.get(tier, other)
            split[source] = split.get(source, 0) + n
        low = high
    rest = end - start - sum(split.values())
    if rest > 0:
        split[other] = split.get(other, 0) + rest
    return split


# Chunks an engine remembers having saved, to tell its own fills from other engines'.
FILLERS_MAX_CHUNKS = 1 << 16


class Fillers:
    """Which engine filled the chunks of a raykv hit: this one (it planned their save:
    its own prefix cache forgot them) or another (a replica beside it, a restarted engine,
    a warming job): what a shared tier gives that a bigger private pool cannot.

    Counts hit tokens in `here` / `elsewhere` and the metric `raykv_hit_tokens_by_filler`
    (tag `filler`: this_engine / another_engine). Remembers the last `max_chunks` chunk
    hashes this engine saved; a chunk saved before that counts as another engine's."""

    def __init__(self, chunk: int, max_chunks: int = FILLERS_MAX_CHUNKS) -> None:
        self.chunk = chunk
        self._saved = BoundedKeySet(max_chunks)
        self.here = 0
        self.elsewhere = 0

    def saved(self, hashes: list[bytes]) -> None:
        """This engine planned the save of the chunks keyed `hashes`."""
        self._saved.update(hashes)

    def hit(self, hashes: list[bytes], start: int, end: int) -> None:
        """Tokens [start, end) were a raykv hit; `hashes` key the chunks from token 0."""
        here = 0
        for i in range(start // self.chunk, min(len(hashes), -(-end // self.chunk))):
            lo, hi = max(start, i * self.chunk), min(end, (i + 1) * self.chunk)
            if hashes[i] in self._saved:
                here += hi - lo
        elsewhere = end - start - here
        self.here += here
        self.elsewhere += elsewhere
        if here:
            metrics.inc("raykv_hit_tokens_by_filler", here, filler="this_engine")
        if elsewhere:
            metrics.inc("raykv_hit_tokens_by_filler", elsewhere, filler="another_engine")


# The connector's counters (attribute -> metric, tags), exported once a step: what an
# operator reads to see whether raykv delays requests (a lookup not back in its step
# costs the request one engine step; a wait for a load, another) and whether its loads
# fail (each failed token is recomputed). The scheduler's, then the workers'.
COUNTER_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "lookups": ("raykv_connector_lookups", {"outcome": "sent"}),
    "lookups_not_back_in_step": ("raykv_connector_lookups", {"outcome": "not_back_in_step"}),
    "lookups_timed_out": ("raykv_connector_lookups", {"outcome": "timed_out"}),
    "lookups_from_view": ("raykv_connector_lookups", {"outcome": "from_view"}),
    "lookups_refused": ("raykv_connector_lookups", {"outcome": "refused"}),
    "waits_for_lookup": ("raykv_connector_waits", {"reason": "lookup"}),
    "waits_for_load": ("raykv_connector_waits", {"reason": "load"}),
    "async_loads": ("raykv_connector_loads", {"mode": "async"}),
    "small_sync_loads": ("raykv_connector_loads", {"mode": "in_step"}),
    "loads_failed_whole": ("raykv_connector_loads", {"mode": "recomputed"}),
}
WORKER_COUNTER_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "loaded_tokens": ("raykv_connector_load_tokens", {"result": "loaded"}),
    "failed_tokens": ("raykv_connector_load_tokens", {"result": "failed"}),
    "waits_for_gather": ("raykv_connector_waits", {"reason": "save_copy"}),
    "load_waits": ("raykv_connector_waits", {"reason": "ending_load"}),
}


class CounterExport:
    """Hands the growth of an object's counters (`COUNTER_METRICS` or another such map) to
    raykv's metrics: one comparison per counter a step, a metric call only for one that
    moved."""

    def __init__(self, counters: dict[str, tuple[str, dict[str, str]]] = COUNTER_METRICS) -> None:
        self._counters = counters
        self._last = dict.fromkeys(counters, 0)

    def export(self, owner: object) -> None:
        last = self._last
        for attr, (name, tags) in self._counters.items():
            now = getattr(owner, attr)
            if now != last[attr]:
                metrics.inc(name, now - last[attr], **tags)
                last[attr] = now


__all__ = [
    "COUNTER_METRICS",
    "CacheHitSource",
    "CounterExport",
    "Fillers",
    "LoadSpec",
    "RayKVConnectorMetadata",
    "RequestState",
    "SaveSpec",
    "WORKER_COUNTER_METRICS",
    "LoadProgress",
    "WorkerLoad",
    "chunk_ends",
    "hit_source_split",
    "in_step_blocks",
]
