"""The scheduler's copy of which chunks raykv's CPU tier holds (`lookup_view`).

vLLM asks the connector how much of a new request raykv holds inside its scheduler loop,
with the engine stopped. A lookup is a manager round trip (1-3 ms on a quiet machine);
on a loaded CPU engine it is seldom back within the step's `lookup_wait_ms`, and a
request whose lookup is not back waits a whole engine step (often another request's
prefill): measured, 0.5-0.75 steps per request in `bench_serving --quick`.

When this node's tiers are the only places a chunk can be (no remote or peer tier) and
the engine has one rank, the scheduler answers from local sets of this engine's chunk
hashes in the CPU tier (and the disk tier, `tiers`) instead: no round trip, no wait. A
hit found on disk is loaded on the loader thread (which reads the files itself,
`disk_direct_reads`, or whose read promotes it). A
thread keeps the sets: a snapshot of each tier (`KVCache.cpu_keys`) at start and
whenever the manager's event log cannot say what changed, then the log's admissions and
evictions (`KVCache.cpu_events`), polled every `POLL_S` while the engine is busy.

The set trails the tier by up to one poll, and errs either way at a cost in time, never
in data: a chunk admitted since the last poll is computed instead of loaded, and one
evicted since fails its load, which vLLM recomputes (`kv_load_failure_policy=
"recompute"`). Such a read takes no pins: the worker reads what the tier holds when it
loads. The scheduler sends a lookup as before when the set cannot be trusted: not known
yet (or a poll failed), not brought up to date within `STALE_S`, the engine's first
request after an idle spell (which wakes the poller), or a request whose first missing
chunk this engine is saving right now (a request that repeats a prefix it just stored).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from raykv import metrics
from raykv.wire import TIER_CPU

logger = logging.getLogger(__name__)

# While the engine is busy: how stale the set may be. Each poll is a manager call from
# the scheduler's process (its GIL, its core): 20 a second cost prefix repetition up to
# 8 % of its inter-token p50 on a 2-core machine, 5 a second did not (docs/BENCHMARKS.md).
POLL_S = 0.2
IDLE_POLL_S = 1.0  # after IDLE_AFTER_S without a request
IDLE_AFTER_S = 5.0
STALE_S = 1.0  # a set last brought up to date longer ago than this is not used
SAVING_S = 2.0  # a chunk this engine saves is looked up, not guessed, this long at most
MAX_SAVING = 65536


class CPUView:
    """This engine's chunk hashes in raykv's CPU tier (and disk tier: `tiers`), kept by a
    polling thread."""

    def __init__(
        self,
        kv: Any,
        identity: tuple[str, int, int, str],
        tiers: tuple[str, ...] = (TIER_CPU,),
        *,
        poll_s: float = POLL_S,
        idle_poll_s: float = IDLE_POLL_S,
        stale_s: float = STALE_S,
        saving_s: float = SAVING_S,
    ) -> None:
        self._kv = kv
        self._identity = identity  # `CacheKey.identity` of this engine's keys
        self._tiers = tiers  # in lookup order: a chunk in the first is read from there
        self._poll_s = poll_s
        self._idle_poll_s = idle_poll_s
        self._stale_s = stale_s
        self._saving_s = saving_s
        # Each tier's chunk hashes; None: not known (not synced yet, or a poll failed).
        self._held: dict[str, set[str]] | None = None
        self._cursor: tuple[str, int, int] | None = None
        self._polled_at = 0.0  # when the set was last brought up to date
        self._busy_until = 0.0
        # Chunks this engine is saving, not yet seen admitted: chunk hash -> when planned.
        self._saving: dict[str, float] = {}
        self._saving_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.resyncs = 0  # snapshots taken (start, a lost log, after a failed poll)
        self._poll()
        self._thread = threading.Thread(target=self._run, name="raykv-cpu-view", daemon=True)
        self._thread.start()

    def prefix(self, chunk_hashes: list[str]) -> int | None:
        """How many leading chunks of `chunk_hashes` the tiers hold (`locate`)."""
        where = self.locate(chunk_hashes)
        return None if where is None else len(where)

    def locate(self, chunk_hashes: list[str]) -> list[str] | None:
        """The tier of each leading chunk of `chunk_hashes` the tiers hold, in runs as the
        manager reads them; None when the sets are not known or not fresh (after an idle spell:
        the call wakes the poller, and the next requests find them fresh), or when the
        first chunk missing is one this engine is saving right now."""
        now = time.monotonic()
        idle, self._busy_until = now > self._busy_until, now + IDLE_AFTER_S
        held = self._held  # one read: the poller may swap in new sets
        if held is None or idle or now - self._polled_at > self._stale_s:
            self._wake.set()
            return None
        sets = [(tier, held[tier]) for tier in self._tiers]
        # As the manager reads (`PrefixIndex.plan`): a run from the first tier, then one
        # from the next, never back: a chunk only an earlier tier holds ends the prefix.
        where: list[str] = []
        i = 0
        for h in chunk_hashes:
            while i < len(sets) and h not in sets[i][1]:
                i += 1
            if i == len(sets):
                break
            where.append(sets[i][0])
        if len(where) < len(chunk_hashes) and self._being_saved(chunk_hashes[len(where)], now):
            return None  # this engine is saving it: the tier may have it already
        return where

    def _being_saved(self, chunk_hash: str, now: float) -> bool:
        """Whether this engine planned the save of `chunk_hash` within `saving_s`."""
        with self._saving_lock:
            planned = self._saving.get(chunk_hash)
        return planned is not None and now - planned < self._saving_s

    def saving(self, chunk_hashes: list[str]) -> None:
        """This engine planned the save of these chunks: until the tier is seen admitting
        them (or `saving_s` passed: a dropped save), a request that needs them is looked
        up instead of answered from the set."""
        now = time.monotonic()
        with self._saving_lock:
            for h in chunk_hashes:
                self._saving.pop(h, None)  # to the end: the dict stays in planning order
                self._saving[h] = now
            while self._saving and (
                len(self._saving) > MAX_SAVING
                or now - next(iter(self._saving.values())) > self._saving_s
            ):
                del self._saving[next(iter(self._saving))]

    def hit(
        self, spans: list[Any], tails: Callable[[int], list[Any]] | None = None
    ) -> tuple[int, list[tuple[str, int]]] | None:
        """The prefix tokens of `spans` (one rank's, in order) the tiers hold and where, as
        a lookup's sources (`[(tier, prefix tokens up to the end of its run)]`), counted
        in raykv's lookup metrics as a manager lookup would count them; None when the
        sets are not known (`locate`) or a partial chunk it would take is being saved.
        `tails(n)`: the partial chunks that may follow the first n chunks held, longest
        first (`save_unfull_chunk`): the first one held ends the hit."""
        where = self.locate([s.key.chunk_hash for s in spans])
        if where is None:
            return None
        found = list(zip(spans, where, strict=False))
        last = where[-1] if where else None
        if tails is not None and (tail := self.tail(tails(len(where)), last)) is not None:
            if tail[1] is None:
                return None  # this engine is saving it: the manager may have it already
            found.append(tail)
        sources: list[tuple[str, int]] = []
        for span, tier in found:
            add_source(sources, tier, span.end)
        hit = sources[-1][1] if sources else 0
        metrics.inc("raykv_lookups")
        metrics.inc("raykv_hit_tokens", hit)
        metrics.inc("raykv_miss_tokens", max((spans[-1].end if spans else 0) - hit, 0))
        low = 0
        for tier, high in sources:
            metrics.inc("raykv_tier_hit_tokens", high - low, tier=tier)
            low = high
        return hit, sources

    def tail(self, spans: list[Any], after: str | None = None) -> tuple[Any, str | None] | None:
        """The first of `spans` (a request's partial chunks, longest first) the sets hold,
        and its tier, or with tier None the first this engine is saving right now; None
        if neither, or the sets are not known. `after`: the tier of the last whole chunk
        (the manager reads on from that tier, never back). A partial chunk read unpinned
        that is gone by the load fails it, and vLLM recomputes it, as any stale answer."""
        held = self._held  # one read: the poller may swap in new sets
        if held is None:
            return None
        tiers = self._tiers[self._tiers.index(after) :] if after in self._tiers else self._tiers
        now = time.monotonic()
        for span in spans:
            h = span.key.chunk_hash
            tier = next((t for t in tiers if h in held[t]), None)
            if tier is not None:
                return span, tier
            if self._being_saved(h, now):
                return span, None
        return None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = time.monotonic() < self._busy_until
            self._wake.wait(self._poll_s if busy else self._idle_poll_s)
            self._wake.clear()
            if not self._stop.is_set():
                self._poll()

    def _poll(self) -> None:
        try:
            reply = self._kv.cpu_events(self._cursor, self._identity, self._tiers)
            if reply is None:  # a fault (logged by the client): unknown until the next poll
                self._lost()
                return
            cursor, changes = reply
            if changes is None or self._held is None:
                # The log cannot say what changed (first call, a rebuilt index, a reader
                # fallen off its ring): a snapshot taken after that cursor, then the
                # events after it on top (replaying one already in the snapshot leaves
                # each key as its last event says).
                held = {t: self._kv.cpu_keys(self._identity, t) for t in self._tiers}
                if any(keys is None for keys in held.values()):
                    self._lost()
                    return
                self._held = {t: set(keys) for t, keys in held.items()}
                self.resyncs += 1
                sets = list(self._held.values())
                with self._saving_lock:  # admitted meanwhile: in the snapshot
                    for key in [k for k in self._saving if any(k in s for s in sets)]:
                        del self._saving[key]
            else:
                self._apply(changes)
            self._cursor = tuple(cursor)
            self._polled_at = time.monotonic()
        except Exception as exc:  # a closed or broken client: unknown until it answers
            logger.debug("raykv CPU view: polling the manager failed: %r", exc)
            self._lost()

    def _apply(self, changes: list[tuple[bool, str, str]]) -> None:
        held = self._held
        assert held is not None
        for admitted, tier, key in changes:
            if admitted:
                held[tier].add(key)
            else:
                held[tier].discard(key)
        with self._saving_lock:
            for admitted, _, key in changes:
                if admitted:
                    self._saving.pop(key, None)

    def _lost(self) -> None:
        self._held = None
        self._cursor = None


def add_source(sources: list[tuple[str, int]], tier: str, end: int) -> None:
    """Extend a lookup's sources (`[(tier, prefix tokens up to the end of its run)]`) to
    `end`, found in `tier`."""
    if sources and sources[-1][0] == tier:
        sources[-1] = (tier, end)
    else:
        sources.append((tier, end))


__all__ = ["IDLE_POLL_S", "POLL_S", "SAVING_S", "STALE_S", "CPUView", "add_source"]
