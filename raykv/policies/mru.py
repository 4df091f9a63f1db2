"""MRU: evict the most recently used key."""

from __future__ import annotations

from raykv.policies._ordered import OrderedPolicy


class MRUPolicy(OrderedPolicy):
    """Most Recently Used (Chou & DeWitt, VLDB'85): good for loops larger than the cache.

    Same ordering as LRU, evicted from the other end.
    """

    name = "mru"
    reorder_on_hit = True
    evict_newest = True
