"""Leases: how long an open lookup may hold pins before its client counts as gone.

A client that dies between `lookup` and `retrieve`/`unpin` would hold its pins forever.
Both the manager's index and the CPU tier give each lookup a deadline, renewed by use,
and sweep the expired ones on a timer. The rule and the sweep loop live here, once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

# The sweep runs every quarter lease, at least every 5 s, at most every 50 ms.
SWEEP_MIN_SECS = 0.05
SWEEP_MAX_SECS = 5.0


class Leases:
    """Lookup id -> deadline. Not thread-safe (called from one event loop)."""

    def __init__(self, secs: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.secs = secs
        self._clock = clock
        self._deadlines: dict[str, float] = {}

    def renew(self, lookup_id: str, secs: float | None = None) -> float:
        """Open or extend the lease of `lookup_id` to now + `secs` (never shortened)."""
        deadline = self._clock() + (self.secs if secs is None else secs)
        old = self._deadlines.get(lookup_id)
        if old is None or deadline > old:
            self._deadlines[lookup_id] = deadline
            return deadline
        return old

    def end(self, lookup_id: str) -> bool:
        """Forget `lookup_id`'s lease; False if it had none."""
        return self._deadlines.pop(lookup_id, None) is not None

    def expired(self, now: float | None = None) -> list[str]:
        """The ids whose lease has ended (still listed until `end`)."""
        now = self._clock() if now is None else now
        return [lid for lid, deadline in self._deadlines.items() if deadline <= now]

    def clear(self) -> None:
        self._deadlines.clear()

    def next_deadline(self) -> float | None:
        return min(self._deadlines.values(), default=None)

    def __contains__(self, lookup_id: object) -> bool:
        return lookup_id in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)

    def __iter__(self) -> Iterator[str]:
        return iter(self._deadlines)


def sweep_period(lease_secs: float) -> float:
    """How often to look for expired leases: a quarter lease, within 50 ms .. 5 s."""
    return min(max(lease_secs / 4, SWEEP_MIN_SECS), SWEEP_MAX_SECS)


async def sweep_forever(
    lease_secs: float,
    expire: Callable[[], list[str]],
    on_expired: Callable[[list[str]], None] | None = None,
) -> None:
    """Every `sweep_period(lease_secs)`: `expire()` releases what has expired and returns
    those ids; `on_expired` (if given) hears about a non-empty list. Runs until cancelled."""
    period = sweep_period(lease_secs)
    while True:
        await asyncio.sleep(period)
        ids = expire()
        if ids and on_expired is not None:
            on_expired(ids)


__all__ = ["Leases", "sweep_forever", "sweep_period"]
