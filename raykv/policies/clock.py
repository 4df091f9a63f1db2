"""CLOCK: FIFO with a reference bit that buys one more trip round the queue."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from raykv.policies.base import BasePolicy, CanEvict, Key, restore_front


class ClockPolicy(BasePolicy):
    """CLOCK / second chance (Corbató, MIT Project MAC 1968), as libCacheSim's ``Clock``.

    Reference bit 0 on insert, 1 on a hit. Eviction looks at the oldest key:
    bit set -> clear it and move the key to the back; else evict it.
    """

    name = "clock"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._ref: OrderedDict = OrderedDict()

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key in self._ref:
            self._ref[key] = 1
        else:
            self._ref[key] = 0

    def touch(self, key: Key) -> None:
        if key in self._ref:
            self._ref[key] = 1

    def remove(self, key: Key) -> None:
        self._ref.pop(key, None)

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        ref, victims, held = self._ref, [], []
        while len(victims) < n and ref:
            key, bit = ref.popitem(last=False)
            if can_evict is not None and not can_evict(key):
                held.append((key, bit))  # pinned: keep its place and its bit
            elif bit:
                ref[key] = 0
            else:
                victims.append(key)
        restore_front(ref, held)
        return victims

    def clear(self) -> None:
        self._ref.clear()

    def __len__(self) -> int:
        return len(self._ref)

    def __contains__(self, key: object) -> bool:
        return key in self._ref

    def simulate(self, ids: Iterable[Key]) -> int:
        ref: dict = {}
        queue: deque = deque()
        push, pop = queue.append, queue.popleft
        cap, size, misses = self.capacity, 0, 0
        for key in ids:
            if key in ref:
                ref[key] = 1
                continue
            misses += 1
            if size >= cap:
                while True:
                    victim = pop()
                    if ref[victim]:
                        ref[victim] = 0
                        push(victim)
                    else:
                        del ref[victim]
                        break
            else:
                size += 1
            push(key)
            ref[key] = 0
        return misses
