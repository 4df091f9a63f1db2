"""LRU: evict the least recently used key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raykv.policies._ordered import OrderedPolicy
from raykv.policies.base import Key


class LRUPolicy(OrderedPolicy):
    """Least Recently Used (the classic; Mattson et al., IBM Systems Journal 1970).

    One ``OrderedDict`` from least to most recently used; a hit moves the key
    to the end, eviction pops from the front.
    """

    name = "lru"
    reorder_on_hit = True
    evict_newest = False

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
