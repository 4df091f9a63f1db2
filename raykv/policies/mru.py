"""MRU: evict the most recently used key."""

from __future__ import annotations

from collections import OrderedDict

from raykv.policies.base import BasePolicy, CanEvict, Key, take


class MRUPolicy(BasePolicy):
    """Most Recently Used (Chou & DeWitt, VLDB'85): good for loops larger than the cache.

    Same ordering as LRU, evicted from the other end.
    """

    name = "mru"

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
        return take(self._order, n, can_evict, newest=True)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
