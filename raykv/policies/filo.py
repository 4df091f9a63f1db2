"""FILO: evict the most recently inserted key; hits change nothing."""

from __future__ import annotations

from collections.abc import Iterable

from raykv.policies._ordered import OrderedPolicy
from raykv.policies.base import Key


class FILOPolicy(OrderedPolicy):
    """First In, Last Out (a stack): the newest insertion is evicted first.

    Keeps whatever filled the cache first; the mirror image of FIFO.
    """

    name = "filo"
    reorder_on_hit = False
    evict_newest = True

    def simulate(self, ids: Iterable[Key]) -> int:
        cached: set = set()
        stack: list = []
        add, discard, push, pop = cached.add, cached.discard, stack.append, stack.pop
        cap, size, misses = self.capacity, 0, 0
        for key in ids:
            if key not in cached:
                misses += 1
                if size >= cap:
                    discard(pop())  # the newest insertion
                else:
                    size += 1
                push(key)
                add(key)
        return misses
