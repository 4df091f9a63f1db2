"""One ``OrderedDict`` of keys, oldest first: the shared body of LRU, MRU, FIFO and FILO."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import ClassVar

from raykv.policies.base import BasePolicy, CanEvict, Key, take


class OrderedPolicy(BasePolicy):
    """A recency or insertion order; subclasses pick two switches.

    ``reorder_on_hit``: a hit moves the key to the newest end (LRU, MRU) or
    changes nothing (FIFO, FILO). ``evict_newest``: eviction pops the newest
    end (MRU, FILO) instead of the oldest (LRU, FIFO).
    """

    reorder_on_hit: ClassVar[bool] = True
    evict_newest: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict = OrderedDict()

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key not in self._order:
            self._order[key] = None
        elif self.reorder_on_hit:
            self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if self.reorder_on_hit and key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        order = self._order
        if n == 1 and can_evict is None and order:  # a store's usual call
            return [order.popitem(self.evict_newest)[0]]
        return take(order, n, can_evict, newest=self.evict_newest)

    def simulate(self, ids: Iterable[Key]) -> int:
        if self.reorder_on_hit:
            return recency_misses(ids, self.capacity, self.evict_newest)
        return insertion_misses(ids, self.capacity, self.evict_newest)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


def recency_misses(ids: Iterable[Key], capacity: int, newest: bool = False) -> int:
    """Miss count of LRU (``newest=False``) or MRU on a cold cache of ``capacity`` objects.

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
            pop(newest)
            order[key] = None
    return misses


def insertion_misses(ids: Iterable[Key], capacity: int, newest: bool = False) -> int:
    """Miss count of FIFO (``newest=False``) or FILO: hits change nothing."""
    cached: set = set()
    queue: deque = deque()
    add, discard, push = cached.add, cached.discard, queue.append
    pop = queue.pop if newest else queue.popleft
    size, misses = 0, 0
    for key in ids:
        if key not in cached:
            misses += 1
            if size >= capacity:
                discard(pop())
            else:
                size += 1
            push(key)
            add(key)
    return misses
