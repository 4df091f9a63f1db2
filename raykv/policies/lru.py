"""LRU: evict the least recently used key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raykv.policies.base import BasePolicy, CanEvict, Key, take


class LRUPolicy(BasePolicy):
    """Least Recently Used (the classic; Mattson et al., IBM Systems Journal 1970).

    One ``OrderedDict`` from least to most recently used; a hit moves the key
    to the end, eviction pops from the front.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict = OrderedDict()

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        else:
            self._order[key] = None

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        return take(self._order, n, can_evict)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def simulate(self, ids: Iterable[Key]) -> int:
        order: OrderedDict = OrderedDict()
        move, pop = order.move_to_end, order.popitem
        cap, size, misses = self.capacity, 0, 0
        for key in ids:
            if key in order:
                move(key)
            else:
                misses += 1
                if size >= cap:
                    pop(False)
                else:
                    size += 1
                order[key] = None
        return misses
