"""MRU: evict the most recently used key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raykv.policies._ordered import OrderedPolicy
from raykv.policies.base import Key


class MRUPolicy(OrderedPolicy):
    """Most Recently Used (Chou & DeWitt, VLDB'85): good for loops larger than the cache.

    Same ordering as LRU, evicted from the other end.
    """

    name = "mru"
    reorder_on_hit = True
    evict_newest = True

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
                    pop()  # the most recently used
                else:
                    size += 1
                order[key] = None
        return misses
