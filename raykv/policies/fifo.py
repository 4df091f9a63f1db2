"""FIFO: evict the oldest inserted key; hits change nothing."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

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

    def simulate(self, ids: Iterable[Key]) -> int:
        cached: set = set()
        queue: deque = deque()
        add, discard, push, pop = cached.add, cached.discard, queue.append, queue.popleft
        cap, size, misses = self.capacity, 0, 0
        for key in ids:
            if key not in cached:
                misses += 1
                if size >= cap:
                    discard(pop())
                else:
                    size += 1
                push(key)
                add(key)
        return misses
