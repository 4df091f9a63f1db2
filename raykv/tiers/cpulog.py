"""What entered and left the CPU tier (and the disk tier), in order, for readers that
poll (Ray-free).

The manager's index tells its reporters what each CPU ack admitted and evicted
(`PrefixIndex.reporter`); `CPULog` keeps the latest of those events numbered, so a
reader that polls (the vLLM connector's KV events, `RayKVConnector.take_events`) gets
each one once: `since(cursor, identity)` answers the events after `cursor` for one
engine's keys and the cursor to pass next.

A reader cannot always be told everything: the ring holds `capacity` events, and a CPU
index rebuilt from a snapshot (`lost`: a CPU store restarted, an ack was lost) does not
say which keys left meanwhile. `since` then answers None for the events, meaning "assume
every key you were told of is gone"; the reader starts over from the cursor it is given.
A cursor names its log (a restarted manager's log refuses it the same way).

`since_tiers` answers the same for the disk tier's events too (the vLLM connector's CPU
view of a CPU + disk cache). Nothing is recorded for a tier until a reader first asks
for it: a manager nobody polls pays nothing.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, KeyIdentity
from raykv.wire import TIER_CPU, TIER_DISK

CPU_LOG_EVENTS = 16384

# A reader's position: (the log's id, events numbered so far, losses so far of the tiers
# it reads).
Cursor = tuple[str, int, int]
LOGGED_TIERS = (TIER_CPU, TIER_DISK)


class CPULog:
    """The latest CPU (and, for readers that ask, disk) admissions and evictions (a
    reporter of `PrefixIndex`)."""

    def __init__(self, capacity: int = CPU_LOG_EVENTS) -> None:
        # (admitted, tier, key); the first one is event number `self._next - len(ring)`.
        self._ring: deque[tuple[bool, str, CacheKey]] = deque(maxlen=capacity)
        self._id = uuid.uuid4().hex
        self._next = 0
        self._losses = dict.fromkeys(LOGGED_TIERS, 0)
        self._watched: frozenset[str] = frozenset()  # tiers some reader asked for

    def admitted(self, tier: str, keys: Iterable[CacheKey]) -> None:
        self._record(True, tier, keys)

    def evicted(self, tier: str, keys: Iterable[CacheKey]) -> None:
        self._record(False, tier, keys)

    def _record(self, admitted: bool, tier: str, keys: Iterable[CacheKey]) -> None:
        if tier in self._watched:
            for key in keys:
                self._ring.append((admitted, tier, key))
                self._next += 1

    def lost(self, tier: str | None = None) -> None:
        """`tier`'s index was rebuilt (None: every tier's): keys may have left unrecorded."""
        for t in LOGGED_TIERS if tier is None else (tier,):
            if t in self._losses:
                self._losses[t] += 1

    def since(
        self, cursor: Cursor | None, identity: KeyIdentity
    ) -> tuple[Cursor, list[tuple[bool, str]] | None]:
        """The CPU tier's events after `cursor` for keys of `identity` (`CacheKey.identity`:
        model, world size, worker, dtype), as `(admitted, chunk hash)` pairs in order, and
        the cursor to pass next. None for the events when the log cannot say (the reader's
        first call, a loss since `cursor`, events that fell off the ring, a cursor of
        another log): the reader assumes every key it was told of gone."""
        now, events = self.since_tiers(cursor, identity, (TIER_CPU,))
        return now, None if events is None else [(a, h) for a, _, h in events]

    def since_tiers(
        self, cursor: Cursor | None, identity: KeyIdentity, tiers: Iterable[str]
    ) -> tuple[Cursor, list[tuple[bool, str, str]] | None]:
        """`since` for the events of several tiers (`LOGGED_TIERS`), as `(admitted, tier,
        chunk hash)`. A reader passes the same tiers on every call (its cursor counts the
        losses of those tiers)."""
        tiers = tuple(tiers)
        unknown = set(tiers) - set(LOGGED_TIERS)
        if unknown:
            raise InvalidInputError(f"the log records {LOGGED_TIERS}, not {sorted(unknown)}")
        if cursor is not None and not (
            isinstance(cursor, (tuple, list))
            and len(cursor) == 3
            and isinstance(cursor[0], str)
            and all(isinstance(c, int) and not isinstance(c, bool) for c in cursor[1:])
        ):
            raise InvalidInputError(f"cursor={cursor!r} is not one this log handed out")
        try:
            identity = tuple(identity)
        except TypeError:
            raise InvalidInputError(f"identity={identity!r} is not a key identity") from None
        self._watched = self._watched | set(tiers)
        now = (self._id, self._next, sum(self._losses[t] for t in tiers))
        if cursor is None or (cursor[0], cursor[2]) != (now[0], now[2]):
            return now, None
        start = cursor[1] - (self._next - len(self._ring))
        if start < 0 or cursor[1] > self._next:
            return now, None
        events = [
            (admitted, tier, key.chunk_hash)
            for admitted, tier, key in itertools.islice(self._ring, start, None)
            if tier in tiers and key.identity == identity
        ]
        return now, events


class Reporters:
    """Several `PrefixIndex` reporters as one (the controller's and the CPU log)."""

    def __init__(self, *reporters: Any) -> None:
        self._all = [r for r in reporters if r is not None]

    def admitted(self, tier: str, keys: Iterable[CacheKey]) -> None:
        keys = list(keys)
        for r in self._all:
            r.admitted(tier, keys)

    def evicted(self, tier: str, keys: Iterable[CacheKey]) -> None:
        keys = list(keys)
        for r in self._all:
            r.evicted(tier, keys)

    def lost(self, tier: str | None = None) -> None:
        for r in self._all:
            r.lost(tier)


__all__ = ["CPU_LOG_EVENTS", "LOGGED_TIERS", "CPULog", "Cursor", "Reporters"]
