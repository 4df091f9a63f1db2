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

    def touch(self, key: Key) -> None:
        try:
            self._order.move_to_end(key)
        except KeyError:  # absent: a no-op, as the protocol says
            pass

    def simulate(self, ids: Iterable[Key]) -> int:
        return lru_misses(ids, self.capacity)


def lru_misses(ids: Iterable[Key], capacity: int) -> int:
    """LRU's miss count of ``ids`` on a cold cache of ``capacity`` objects.

    The fill phase (no eviction) runs in its own loop so the steady-state loop
    does no size bookkeeping.
    """
    order: OrderedDict = OrderedDict()
    move, pop = order.move_to_end, order.popitem
    misses = 0
    it = iter(ids)
    for key in it:
        if key in order:
            move(key)
            continue
        misses += 1
        order[key] = None
        if misses == capacity:
            break
    for key in it:
        if key in order:
            move(key)
        else:
            misses += 1
            pop(False)
            order[key] = None
    return misses
