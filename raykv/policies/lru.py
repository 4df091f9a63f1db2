"""LRU: evict the least recently used key."""

from __future__ import annotations

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
