"""The manager's prefix index: which tier holds which chunk, lookup plans, pins and leases.

Plain Python (no Ray): the `StorageManager` actor owns one `PrefixIndex` and is only its
shell (it makes the calls to the tiers and feeds their replies in here). All state the
manager keeps about the tiers lives in this one object, so every rule below is tested in
`tests/unit/test_prefix_index.py` without starting Ray.

* CPU: key -> `ChunkRef` (refs borrowed from the CPU store), updated from every put and
  pull reply (`CPUAck`), evicted keys included. Every ack carries the CPU store's
  incarnation and a sequence number: an ack from another incarnation or older than the
  last snapshot is ignored (it would re-add evicted chunks), and acks that never arrive
  (a pull that timed out on this side and was applied nowhere) show up as a gap that
  `cpu_lagging` reports, so the shell resyncs within seconds instead of serving evicted
  batches beyond the CPU budget forever.
* disk and remote: sets of keys believed present (the remote's bounded), updated from
  `PutAck`s of the current incarnation only. A stale positive costs a miss when a pull
  finds the key missing, and is corrected then.
* A tier marked down (its actor died for good) answers nothing until the shell has
  re-created it and resynced; the other tiers keep serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, leading
from raykv.tiers.budget import BoundedKeySet, CompactKeySet
from raykv.tiers.lease import Leases
from raykv.wire import (
    TIER_CPU,
    TIER_ORDER,
    TIER_PEER,
    TIER_REMOTE,
    ChunkRef,
    CPUAck,
    PeerTier,
    PutAck,
    RetrieveResult,
    kind,
)

# Keys of the shared remote the index remembers by default (oldest forgotten first).
REMOTE_INDEX_MAX_KEYS = 1 << 20
# Lookup ids ended before they were recorded (a get or unpin that overtook its prefetch).
ENDED_EARLY_MAX_IDS = 4096

Segment = tuple[str | PeerTier, int, int]  # (tier, start, stop) over a request's keys


def tokens(ends: Sequence[int], n: int) -> int:
    """Tokens covered by the first `n` chunks of a request whose chunk ends are `ends`."""
    return ends[n - 1] if n else 0


def _changed(ack: CPUAck) -> frozenset[CacheKey]:
    """The keys whose CPU index entry a CPU ack sets (those it has a ref for) or drops."""
    refs = ack.refs
    return frozenset((*ack.evicted, *(k for k in (*ack.accepted, *ack.present) if k in refs)))


@dataclass(slots=True)
class Lookup:
    """A lookup with pins or a prefetch in flight, until its get, unpin or lease end."""

    lookup_id: str
    cpu_incarnation: str | None
    ends: list[int] = field(default_factory=list)
    refs: dict[CacheKey, ChunkRef] = field(default_factory=dict)
    ready: int = 0  # chunks of the prefix ready in CPU
    task: Any = None  # the shell's prefetch task
    closed: bool = False
    ranks: set[int] = field(default_factory=set)  # workers (TP ranks) yet to read it
    # (tier kind, prefix tokens up to the end of that tier's run): where the prefetch
    # found the prefix, before promotion into CPU (the connector's hit sources)
    sources: list[tuple[str, int]] = field(default_factory=list)

    def loading(self) -> bool:
        return self.task is not None and not self.task.done()


class PrefixIndex:
    """Everything the manager knows about its tiers, and the rules that keep it true.

    `tiers` are the enabled tiers in lookup order. `reporter` (optional) is told what
    entered and left the CPU and disk tiers (the controller's event stream). Not
    thread-safe: the manager's event loop and its Ray threads call it, one at a time,
    under the manager's one lock (the loop holds it except while it waits for I/O; a Ray
    thread that answers a lookup takes it between two loop steps).
    """

    def __init__(
        self,
        tiers: Sequence[str],
        *,
        lease_secs: float,
        remote_index_max_keys: int = REMOTE_INDEX_MAX_KEYS,
        reporter: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        unknown = set(tiers) - set(TIER_ORDER)
        if unknown:
            raise InvalidInputError(f"unknown tier(s) {sorted(unknown)}; allowed: {TIER_ORDER}")
        self.order = [t for t in TIER_ORDER if t in tiers]
        self.lower_tiers = [t for t in self.order if t != TIER_CPU]
        self.leases = Leases(lease_secs, clock)
        self.reporter = reporter
        self._clock = clock
        self._remote_max = remote_index_max_keys
        self.cpu: dict[CacheKey, ChunkRef] = {}
        self.lower: dict[str, set[CacheKey] | BoundedKeySet] = {
            t: self._new_lower(t) for t in self.lower_tiers
        }
        self.incarnations: dict[str, str | None] = dict.fromkeys(self.order)
        self.down: set[str] = set()
        self.lookups: dict[str, Lookup] = {}
        self._ended_early = BoundedKeySet(ENDED_EARLY_MAX_IDS)
        # CPU ack sequence numbers: every ack up to `_cpu_mark` is applied (or was in the
        # last snapshot); `_cpu_seen` holds those applied above it, with the keys each
        # changed (an older ack applied after them must not undo their evictions or
        # admissions). `_cpu_log` records the acks applied while a snapshot is awaited.
        self._cpu_mark = 0
        self._cpu_seen: dict[int, frozenset[CacheKey]] = {}
        self._cpu_log: list[CPUAck] | None = None
        self._cpu_resyncs = 0
        self._cpu_dropped = False
        self._cpu_checked: int | None = None  # the store's sequence number at the last check
        self.counts = dict.fromkeys(
            (
                "lookups",
                "hit_tokens",
                "miss_tokens",
                "retrieved_tokens",
                "puts",
                "remote_errors",
                "stale_positives",
                "resyncs",
                "skipped_lower_writes",
                "pull_timeouts",
                "late_acks",
                "stale_acks",
                "recreated_tiers",
                "peer_asks_used",
                "peer_asks_unused",
            ),
            0,
        )
        self.tier_hits = dict.fromkeys(self.order, 0)
        self.tier_misses = dict.fromkeys(self.order, 0)

    def _new_lower(self, tier: str, keys: Iterable[CacheKey] = ()) -> set[CacheKey] | BoundedKeySet:
        if tier == TIER_REMOTE:
            return CompactKeySet(self._remote_max, keys)
        return set(keys)

    def enable_peers(self) -> None:
        """Count lookup hits of the peer tier too (the controller is on)."""
        self.tier_hits.setdefault(TIER_PEER, 0)
        self.tier_misses.setdefault(TIER_PEER, 0)

    def tiers_for(self, search_range: Sequence[str] | None) -> list[str]:
        """The enabled tiers of `search_range` (default all), in lookup order."""
        if search_range is None:
            return self.order
        unknown = set(search_range) - set(TIER_ORDER)
        if unknown:
            raise InvalidInputError(
                f"unknown tier(s) {sorted(unknown)} in search_range; allowed: {list(TIER_ORDER)}"
            )
        return [t for t in self.order if t in search_range]

    def up(self, tier: str) -> bool:
        return tier in self.incarnations and tier not in self.down

    # ----- plans -----

    def plan(self, keys: list[CacheKey], tiers: Sequence[str]) -> tuple[list[Segment], int]:
        """Segments (tier, start, stop) of the prefix the indexes know, and its length."""
        segs: list[Segment] = []
        pos = 0
        for tier in tiers:
            if tier in self.down:
                continue
            end = leading(keys, pos, self.cpu if tier == TIER_CPU else self.lower[tier])
            if end > pos:
                segs.append((tier, pos, end))
                pos = end
        return segs, pos

    def local_lower_plan(self, keys: list[CacheKey], start: int) -> tuple[list[Segment], int]:
        """Segments of `keys[start:]` held by this node's lower tiers (disk), and the end."""
        segs: list[Segment] = []
        pos = start
        for tier in self.lower_tiers:
            if tier == TIER_REMOTE or tier in self.down:
                continue
            end = leading(keys, pos, self.lower[tier])
            if end > pos:
                segs.append((tier, pos, end))
                pos = end
        return segs, pos

    def count_lookup(
        self, segs: list[Segment], ends: list[int], n: int, asked: int | None = None
    ) -> tuple[int, int]:
        """Record a lookup's outcome; (hit tokens, miss tokens). `asked`: the tokens it
        asked for, where `ends` no longer says (a plan cut short by a partial chunk)."""
        hit = tokens(ends, n)
        miss = max(tokens(ends, len(ends)), asked or 0) - hit
        self.counts["lookups"] += 1
        self.counts["hit_tokens"] += hit
        self.counts["miss_tokens"] += miss
        remaining = len(ends)
        for tier, a, b in segs:
            k = kind(tier)
            self.tier_hits[k] += b - a
            self.tier_misses[k] += remaining - (b - a)
            remaining -= b - a
        return hit, miss

    # ----- CPU index upkeep -----

    def apply_cpu(self, ack: CPUAck) -> bool:
        """Apply a CPU put/pull reply. False if it came from another CPU store incarnation
        (the index is then dropped; the caller resyncs) or predates the last snapshot.

        Replies may arrive out of order (concurrent calls): a key that a newer reply,
        applied already, evicted or admitted keeps that reply's state.
        """
        if ack.incarnation != self.incarnations.get(TIER_CPU):
            self.drop(TIER_CPU)
            return False
        seq, seen = ack.seq, self._cpu_seen
        if seq and (seq <= self._cpu_mark or seq in seen):
            self.counts["stale_acks"] += 1
            return False
        newer = frozenset().union(*(ks for s, ks in seen.items() if s > seq)) if seq else ()
        self._apply_cpu_effects(ack, newer)
        if seq:
            seen[seq] = _changed(ack)
            self._advance_cpu_mark()
        if self._cpu_log is not None:
            self._cpu_log.append(ack)
        return True

    def _apply_cpu_effects(self, ack: CPUAck, skip: Collection[CacheKey] = ()) -> None:
        evicted = [k for k in ack.evicted if k not in skip]
        for key in evicted:
            self.cpu.pop(key, None)
        for key in (*ack.accepted, *ack.present):
            chunk = ack.refs.get(key)
            if chunk is not None and key not in skip:
                self.cpu[key] = chunk
        if self.reporter is not None:
            self.reporter.evicted(TIER_CPU, evicted)
            self.reporter.admitted(TIER_CPU, [k for k in ack.accepted if k not in skip])

    def _advance_cpu_mark(self) -> None:
        seen = self._cpu_seen
        while self._cpu_mark + 1 in seen:
            self._cpu_mark += 1
            del seen[self._cpu_mark]

    def begin_cpu_resync(self) -> None:
        """A snapshot was asked for: record the acks applied until `end_cpu_resync`, so
        that `reset_cpu` keeps those newer than the snapshot."""
        self._cpu_resyncs += 1
        if self._cpu_log is None:
            self._cpu_log = []

    def end_cpu_resync(self) -> None:
        self._cpu_resyncs = max(0, self._cpu_resyncs - 1)
        if not self._cpu_resyncs:
            self._cpu_log = None

    def cpu_lagging(self, incarnation: str, seq: int) -> bool:
        """Called periodically with the CPU store's incarnation and last ack number: True
        if an ack it had sent by the previous check is still not applied here (it was
        lost, e.g. its caller timed out), or the store is another incarnation: resync."""
        if incarnation != self.incarnations.get(TIER_CPU):
            return True
        previous, self._cpu_checked = self._cpu_checked, seq
        return previous is not None and self._cpu_mark < previous

    def reset_cpu(self, incarnation: str, snapshot: dict[CacheKey, ChunkRef], seq: int) -> None:
        """Replace the CPU index with the store's snapshot taken at ack sequence `seq`,
        then re-apply the acks newer than it that were applied while it was awaited."""
        same = incarnation == self.incarnations.get(TIER_CPU)
        if same and seq < self._cpu_mark and not self._cpu_dropped:
            return  # older than what is applied here (resyncs overlapped): no news
        self._cpu_dropped = False
        self.cpu = dict(snapshot)
        log = self._cpu_log
        self._cpu_mark, self._cpu_checked = seq, None
        self._cpu_seen = {s: ks for s, ks in self._cpu_seen.items() if s > seq} if same else {}
        for ack in sorted(log or (), key=lambda a: a.seq):
            if ack.seq > seq and ack.incarnation == incarnation:
                self._apply_cpu_effects(ack)
                self._cpu_seen[ack.seq] = _changed(ack)
        self._advance_cpu_mark()
        for rec in self.lookups.values():
            if rec.cpu_incarnation != incarnation:
                rec.refs.clear()  # objects of a dead CPU store are gone
                rec.ready = 0
                rec.cpu_incarnation = incarnation
        self._resynced(TIER_CPU, incarnation)

    def reset_lower(self, tier: str, incarnation: str, keys: Iterable[CacheKey]) -> None:
        """Replace a lower tier's index with the keys it reported."""
        self.lower[tier] = self._new_lower(tier, keys)
        self._resynced(tier, incarnation)

    def _resynced(self, tier: str, incarnation: str) -> None:
        self.down.discard(tier)
        self.incarnations[tier] = incarnation
        self.counts["resyncs"] += 1
        if self.reporter is not None:
            self.reporter.lost(tier)  # the controller gets the rebuilt index as a snapshot

    def drop(self, tier: str) -> None:
        """Forget what `tier` holds (it restarted or died); a resync rebuilds it."""
        if tier == TIER_CPU:
            self.cpu.clear()
            self._cpu_dropped = True  # the next snapshot is news, however old
        else:
            self.lower[tier].clear()
        if self.reporter is not None:
            self.reporter.lost(tier)  # listings built on what it held are stale

    def mark_down(self, tier: str) -> None:
        """`tier`'s actor is dead: serve nothing from it until `reset_*` after re-creation."""
        self.drop(tier)  # says `lost` to the reporter
        self.down.add(tier)
        self.incarnations[tier] = None

    # ----- lower-tier index upkeep -----

    def apply_lower(self, tier: str, ack: PutAck) -> bool:
        """Apply a lower tier's put reply, unless it came from another incarnation of the
        tier (a reply that raced a restart must not re-add keys the restart lost)."""
        inc = getattr(ack, "incarnation", "")
        if inc and inc != self.incarnations.get(tier):
            self.counts["stale_acks"] += 1
            return False
        index = self.lower[tier]
        index.difference_update(ack.evicted)
        index.update(ack.accepted)
        if self.reporter is not None and tier != TIER_REMOTE:
            self.reporter.evicted(tier, ack.evicted)
            self.reporter.admitted(tier, ack.accepted)
        return True

    def apply_pull(self, tier: str, ack: CPUAck) -> None:
        """What a pull learned about its source tier: misses it believed present, hits."""
        if tier not in self.lower:
            return
        if ack.missing:
            stale = self.lower[tier].intersection(ack.missing)
            if stale:
                self.lower[tier].difference_update(stale)
                self.counts["stale_positives"] += len(stale)
                if self.reporter is not None and tier != TIER_REMOTE:
                    self.reporter.evicted(tier, list(stale))
        if ack.refs:
            self.lower[tier].update(ack.refs)

    def found_remote(self, keys: list[CacheKey]) -> None:
        self.lower[TIER_REMOTE].update(keys)

    def needs_write(self, tier: str, keys: list[CacheKey]) -> bool:
        return tier not in self.down and not all(k in self.lower[tier] for k in keys)

    # ----- lookups, pins, leases -----

    def record(self, lookup_id: str, ends: list[int]) -> Lookup:
        """The open lookup `lookup_id`, created with a fresh lease if new; closed (and not
        kept: it pins nothing) if a get or unpin of it came first (`close(early=True)`)."""
        rec = self.lookups.get(lookup_id)
        if rec is None:
            rec = Lookup(lookup_id, self.incarnations.get(TIER_CPU), ends)
            if lookup_id in self._ended_early:
                self._ended_early.difference_update([lookup_id])
                rec.closed = True
                return rec
            self.lookups[lookup_id] = rec
            self.leases.renew(lookup_id)
        return rec

    def pin(self, rec: Lookup, keys: list[CacheKey]) -> int:
        """Hold the CPU refs of the leading `keys` for `rec`; how many (0 if closed)."""
        if rec.closed:
            return 0
        got = 0
        for key in keys:
            chunk = self.cpu.get(key)  # the index may have changed during a probe
            if chunk is None:
                break
            rec.refs[key] = chunk
            got += 1
        rec.ready = max(rec.ready, got)
        return got

    def take_loaded(self, rec: Lookup, keys: list[CacheKey], start: int, ack: CPUAck) -> bool:
        """Hold the chunks a pull of `keys` (at `start` in the request) served for `rec`;
        True if it served them all (the prefix goes on)."""
        got = 0
        for key in keys:
            chunk = ack.refs.get(key)
            if chunk is None:
                break
            rec.refs[key] = chunk
            got += 1
        rec.ready = start + got
        return got == len(keys)

    def close(self, lookup_id: str, early: bool = False) -> Lookup | None:
        """End `lookup_id` (get, unpin, lease end); its record, or None if unknown. With
        `early` (a client's get or unpin), an unknown id is remembered: its lookup may
        still arrive (calls to a threaded actor overtake each other) and must not pin."""
        rec = self.lookups.pop(lookup_id, None)
        self.leases.end(lookup_id)
        if rec is not None:
            rec.closed = True
        elif early:
            self._ended_early.update([lookup_id])
        return rec

    def read(self, lookup_id: str, keys: list[CacheKey]) -> tuple[Lookup | None, bool]:
        """A get of `keys` (one worker's) under `lookup_id`: its record, and whether this
        read ends it. A lookup over several workers' keys (tensor-parallel ranks, looked
        up at once by the scheduler) stays open, pins and all, until each has read its
        own (or its lease ends): the first rank's read released the others' pins."""
        rec = self.lookups.get(lookup_id)
        if rec is not None and len(rec.ranks) > 1 and keys:
            rec.ranks.discard(keys[0].worker_id)
            if rec.ranks:
                return rec, False
        return self.close(lookup_id, early=True), True

    def expired(self, now: float | None = None) -> list[str]:
        """Ids of open lookups whose lease ended (their client died or forgot them)."""
        return self.leases.expired(now)

    def collect(self, keys: list[CacheKey], held: dict[CacheKey, ChunkRef]) -> RetrieveResult:
        """The leading chunks of `keys` readable from CPU: held by a lookup, or indexed."""
        result = RetrieveResult()
        for key in keys:
            chunk = held.get(key) or self.cpu.get(key)
            if chunk is None:
                break
            result.chunks.append(chunk)
            result.tiers.append(TIER_CPU)
        return result

    # ----- maintenance -----

    def remove(self, keys: list[CacheKey], tiers: Sequence[str]) -> None:
        for tier in tiers:
            if tier == TIER_CPU:
                for key in keys:
                    self.cpu.pop(key, None)
            else:
                self.lower[tier].difference_update(keys)
            if self.reporter is not None:
                self.reporter.evicted(tier, keys)

    def clear(self) -> list[str]:
        """Close every lookup and empty every index; the ids closed."""
        ids = list(self.lookups)
        for lookup_id in ids:
            self.close(lookup_id)
        self.cpu.clear()
        for index in self.lower.values():
            index.clear()
        if self.reporter is not None:
            self.reporter.lost()
        return ids

    def snapshot(self) -> dict[str, list[CacheKey]]:
        """What this node's CPU and disk tiers hold, for the controller."""
        snap = {TIER_CPU: list(self.cpu)}
        for tier in self.lower_tiers:
            if tier != TIER_REMOTE:
                snap[tier] = list(self.lower[tier])
        return snap

    def entries(self, tier: str) -> int:
        return len(self.held(tier))

    def held(self, tier: str) -> Collection[CacheKey]:
        """The keys the index says `tier` holds."""
        return self.cpu.keys() if tier == TIER_CPU else self.lower[tier]

    def stats(self) -> dict[str, Any]:
        looked = self.counts["hit_tokens"] + self.counts["miss_tokens"]
        return {
            **self.counts,
            "hit_rate": self.counts["hit_tokens"] / looked if looked else 0.0,
            "open_lookups": len(self.lookups),
            "down_tiers": sorted(self.down),
        }


__all__ = [
    "REMOTE_INDEX_MAX_KEYS",
    "Lookup",
    "PrefixIndex",
    "leading",
    "tokens",
]
