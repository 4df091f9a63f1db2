"""Priority: the caller ranks keys; the lowest priority goes first, LRU within a priority."""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from sortedcontainers import SortedDict

from raykv.errors import ConfigError, InvalidInputError
from raykv.policies._ordered import recency_misses
from raykv.policies.base import BasePolicy, CanEvict, Key, pick


def _valid(priority: object) -> bool:
    """A finite real number (int, float, numpy scalar), not a bool."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Real):
        return False
    return isinstance(priority, numbers.Integral) or math.isfinite(priority)


class PriorityPolicy(BasePolicy):
    """Caller-given priorities (as LMCache's priority-aware eviction), LRU within a level.

    ``insert(key, priority=p)``: lower ``p`` is evicted first; re-inserting
    a cached key updates its priority. ``p`` is a finite int or float (else
    InvalidInputError, state unchanged). Levels are a ``SortedDict`` of
    ``OrderedDict``; ``default_priority`` is used when none is given.
    """

    name = "priority"

    def __init__(self, capacity: int, default_priority: float = 0) -> None:
        super().__init__(capacity)
        if not _valid(default_priority):
            raise ConfigError(
                f"policy 'priority': default_priority={default_priority!r} is invalid; "
                "allowed: a finite int or float"
            )
        self.default_priority = default_priority
        self._level: dict = {}
        self._levels: SortedDict = SortedDict()

    def params(self) -> dict[str, Any]:
        return {"default_priority": self.default_priority}

    def insert(self, key: Key, priority: float | None = None) -> None:
        if priority is None:
            priority = self._level.get(key, self.default_priority)
        elif not _valid(priority):
            raise InvalidInputError(
                f"priority={priority!r} for key {key!r} is invalid; allowed: a finite int or float"
            )
        self.remove(key)
        self._level[key] = priority
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = OrderedDict()
        level[key] = None

    def touch(self, key: Key) -> None:
        priority = self._level.get(key)
        if priority is not None:
            self._levels[priority].move_to_end(key)

    def remove(self, key: Key) -> None:
        priority = self._level.pop(key, None)
        if priority is not None:
            level = self._levels[priority]
            del level[key]
            if not level:
                del self._levels[priority]

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        victims = pick(self._levels.values(), n, can_evict)
        for key in victims:
            self.remove(key)
        return victims

    def simulate(self, ids: Iterable[Key]) -> int:
        # A trace carries no priorities: every key sits at the default level, which
        # is ordered LRU, so the miss count is LRU's.
        return recency_misses(ids, self.capacity)

    def clear(self) -> None:
        self._level.clear()
        self._levels.clear()

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, key: object) -> bool:
        return key in self._level
