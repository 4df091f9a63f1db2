"""FIFO: evict the oldest inserted key; hits change nothing."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from raykv.policies.base import BasePolicy, CanEvict, Key, take


class FIFOPolicy(BasePolicy):
    """First In, First Out (Belady, IBM Systems Journal 1966).

    Insertion order only; a hit is a no-op, eviction pops the oldest key.
    """

    name = "fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict = OrderedDict()

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key not in self._order:
            self._order[key] = None

    def touch(self, key: Key) -> None:
        """A hit does not reorder a FIFO."""

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
