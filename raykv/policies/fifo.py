"""FIFO: evict the oldest inserted key; hits change nothing."""

from __future__ import annotations

from raykv.policies._ordered import OrderedPolicy
from raykv.policies.base import Key


class FIFOPolicy(OrderedPolicy):
    """First In, First Out (Belady, IBM Systems Journal 1966).

    Insertion order only; a hit is a no-op, eviction pops the oldest key.
    """

    name = "fifo"
    reorder_on_hit = False
    evict_newest = False

    def touch(self, key: Key) -> None:
        pass  # a hit changes nothing
