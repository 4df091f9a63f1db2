"""LFU: evict the least frequently used key, least recently used among ties."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from sortedcontainers import SortedDict

from raykv.policies.base import BasePolicy, CanEvict, Key, pick


class LFUPolicy(BasePolicy):
    """Least Frequently Used with LRU tie-breaking (as libCacheSim's ``LFU``).

    A count starts at 1 on insert, +1 per hit, and is forgotten on eviction.
    Keys live in frequency buckets (a ``SortedDict`` of ``OrderedDict``);
    within a bucket the order is "entered the bucket", i.e. last access.
    """

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._freq: dict = {}
        self._buckets: SortedDict = SortedDict()

    def _add(self, key: Key, freq: int) -> None:
        self._freq[key] = freq
        bucket = self._buckets.get(freq)
        if bucket is None:
            bucket = self._buckets[freq] = OrderedDict()
        bucket[key] = None

    def _drop(self, key: Key, freq: int) -> None:
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key in self._freq:
            self.touch(key)
        else:
            self._add(key, 1)

    def touch(self, key: Key) -> None:
        freq = self._freq.get(key)
        if freq is not None:
            self._drop(key, freq)
            self._add(key, freq + 1)

    def remove(self, key: Key) -> None:
        freq = self._freq.pop(key, None)
        if freq is not None:
            self._drop(key, freq)

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        victims = pick(self._buckets.values(), n, can_evict)
        for key in victims:
            self.remove(key)
        return victims

    def clear(self) -> None:
        self._freq.clear()
        self._buckets.clear()

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def simulate(self, ids: Iterable[Key]) -> int:
        # Classic O(1) LFU with lazy bucket removal: each live key has a cell [key, freq];
        # a hit bumps the cell's freq and appends the cell to the next bucket (a deque),
        # leaving a stale entry behind. An entry is live iff its cell's freq equals the
        # bucket's: within one life a key's freq only grows, so it enters each bucket at
        # most once, and an evicted cell gets freq 0. Bucket order is still "entered the
        # bucket" (LRU among ties), as with the protocol path's OrderedDicts; the minimum
        # frequency only drops (to 1) on insert.
        cells: dict = {}
        get = cells.get
        buckets: list = [None, deque()]
        grow = buckets.append
        cap, misses, low, top = self.capacity, 0, 1, 1
        for key in ids:
            cell = get(key)
            if cell is None:
                misses += 1
                if misses > cap:  # full: each miss past the first `cap` evicts one
                    while True:
                        bucket = buckets[low]
                        while bucket:
                            victim = bucket.popleft()
                            if victim[1] == low:
                                break
                        else:
                            low += 1
                            continue
                        break
                    victim[1] = 0
                    del cells[victim[0]]
                cell = cells[key] = [key, 1]
                buckets[1].append(cell)
                low = 1
            else:
                f = cell[1] + 1
                cell[1] = f
                if f > top:
                    grow(deque())
                    top = f
                buckets[f].append(cell)
        return misses
