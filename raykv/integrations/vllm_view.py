"""The scheduler's copy of which chunks raykv's CPU tier holds (`lookup_view`).

vLLM asks the connector how much of a new request raykv holds inside its scheduler loop,
with the engine stopped. A lookup is a manager round trip (1-3 ms on a quiet machine);
on a loaded CPU engine it is seldom back within the step's `lookup_wait_ms`, and a
request whose lookup is not back waits a whole engine step (often another request's
prefill): measured, 0.5-0.75 steps per request in `bench_serving --quick`.

When the CPU tier is the only place a chunk can be (no disk, remote or peer tier) and
the engine has one rank, the scheduler answers from a local set of this engine's chunk
hashes in the CPU tier instead: no round trip, no wait. A thread keeps the set: a
snapshot of the tier (`KVCache.cpu_keys`) at start and whenever the manager's event log
cannot say what changed, then the log's admissions and evictions
(`KVCache.cpu_events`), polled every `POLL_S` while the engine is busy.

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
    """This engine's chunk hashes in raykv's CPU tier, kept by a polling thread."""

    def __init__(
        self,
        kv: Any,
        identity: tuple[str, int, int, str],
        *,
        poll_s: float = POLL_S,
        idle_poll_s: float = IDLE_POLL_S,
        stale_s: float = STALE_S,
        saving_s: float = SAVING_S,
    ) -> None:
        self._kv = kv
        self._identity = identity  # `CacheKey.identity` of this engine's keys
        self._poll_s = poll_s
        self._idle_poll_s = idle_poll_s
        self._stale_s = stale_s
        self._saving_s = saving_s
        self._held: set[str] | None = None  # None: not known (not synced, or a poll failed)
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
        """How many leading chunks of `chunk_hashes` the CPU tier holds; None when the
        set is not known or not fresh (after an idle spell: the call wakes the poller,
        and the next requests find it fresh)."""
        now = time.monotonic()
        idle, self._busy_until = now > self._busy_until, now + IDLE_AFTER_S
        held = self._held  # one read: the poller may swap in a new set
        if held is None or idle or now - self._polled_at > self._stale_s:
            self._wake.set()
            return None
        n = 0
        for h in chunk_hashes:
            if h not in held:
                break
            n += 1
        if n < len(chunk_hashes):
            with self._saving_lock:
                planned = self._saving.get(chunk_hashes[n])
            if planned is not None and now - planned < self._saving_s:
                return None  # this engine is saving it: the tier may have it already
        return n

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

    def hit(self, spans: list[Any]) -> int | None:
        """The prefix tokens of `spans` (one rank's, in order) the CPU tier holds, counted
        in raykv's lookup metrics as a manager lookup would count them; None when the set
        is not known."""
        n = self.prefix([s.key.chunk_hash for s in spans])
        if n is None:
            return None
        hit = spans[n - 1].end if n else 0
        metrics.inc("raykv_lookups")
        metrics.inc("raykv_hit_tokens", hit)
        metrics.inc("raykv_miss_tokens", spans[-1].end - hit)
        if hit:
            metrics.inc("raykv_tier_hit_tokens", hit, tier=TIER_CPU)
        return hit

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
            reply = self._kv.cpu_events(self._cursor, self._identity)
            if reply is None:  # a fault (logged by the client): unknown until the next poll
                self._lost()
                return
            cursor, changes = reply
            if changes is None or self._held is None:
                # The log cannot say what changed (first call, a rebuilt index, a reader
                # fallen off its ring): a snapshot taken after that cursor, then the
                # events after it on top (replaying one already in the snapshot leaves
                # each key as its last event says).
                held = self._kv.cpu_keys(self._identity)
                if held is None:
                    self._lost()
                    return
                self._held = set(held)
                self.resyncs += 1
            else:
                held = self._held
                for admitted, key in changes:
                    if admitted:
                        held.add(key)
                    else:
                        held.discard(key)
                with self._saving_lock:
                    for admitted, key in changes:
                        if admitted:
                            self._saving.pop(key, None)
            self._cursor = tuple(cursor)
            self._polled_at = time.monotonic()
        except Exception as exc:  # a closed or broken client: unknown until it answers
            logger.debug("raykv CPU view: polling the manager failed: %r", exc)
            self._lost()

    def _lost(self) -> None:
        self._held = None
        self._cursor = None


__all__ = ["IDLE_POLL_S", "POLL_S", "SAVING_S", "STALE_S", "CPUView"]
