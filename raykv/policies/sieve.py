"""SIEVE: one FIFO queue, a hand sweeping from old to new, a visited bit."""

from __future__ import annotations

from collections.abc import Iterable

from raykv.policies.base import BasePolicy, CanEvict, Key


class _Gone:
    """The tombstone left where a key was evicted or removed; one per process."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "_GONE"  # copy and pickle keep the singleton, so ``is _GONE`` still holds


_GONE = _Gone()


class SIEVEPolicy(BasePolicy):
    """SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI'24).

    New keys join the head with visited=0; a hit sets visited=1 and moves
    nothing. The hand walks from the tail (oldest) toward the head: it clears
    visited bits and evicts the first unvisited key, staying where it stopped;
    past the head it wraps to the tail. The queue is a list with tombstones,
    compacted when the hand wraps (amortised O(1)).
    """

    name = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.clear()

    def clear(self) -> None:
        self._queue: list = []
        self._visited: list[int] = []
        self._pos: dict = {}
        self._hand = 0

    def _compact(self) -> None:
        """Drop tombstones, keep the hand on the same live key."""
        live = [i for i, key in enumerate(self._queue) if key is not _GONE]
        hand = sum(1 for i in live if i < self._hand)
        self._queue = [self._queue[i] for i in live]
        self._visited = [self._visited[i] for i in live]
        self._pos = {key: i for i, key in enumerate(self._queue)}
        self._hand = hand

    def _wrap_if_past_head(self) -> None:
        if self._hand >= len(self._queue):
            self._hand = 0
            self._compact()

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key in self._pos:
            self.touch(key)
            return
        self._pos[key] = len(self._queue)
        self._queue.append(key)
        self._visited.append(0)

    def touch(self, key: Key) -> None:
        i = self._pos.get(key)
        if i is not None:
            self._visited[i] = 1

    def remove(self, key: Key) -> None:
        i = self._pos.pop(key, None)
        if i is None:
            return
        self._queue[i] = _GONE
        if len(self._queue) > 2 * len(self._pos) + 16:
            self._compact()

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        victims: list = []
        if n <= 0:
            return victims
        idle = 0  # live keys passed since the last change; a full lap means all pinned
        while len(victims) < n and self._pos and idle < len(self._pos):
            self._wrap_if_past_head()
            h = self._hand
            key = self._queue[h]
            self._hand = h + 1
            if key is _GONE:
                continue
            if can_evict is not None and not can_evict(key):
                idle += 1
            elif self._visited[h]:
                self._visited[h] = 0
                idle = 0
            else:
                self._queue[h] = _GONE
                del self._pos[key]
                victims.append(key)
                idle = 0
        # Reference SIEVE restarts at the tail once the hand passes the head.
        self._wrap_if_past_head()
        return victims

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def simulate(self, ids: Iterable[Key]) -> int:
        # The queue holds keys oldest first (None where one was evicted) and the hand
        # walks it towards the newest; past the newest it compacts and restarts at the
        # oldest. The fill phase (no eviction) runs in its own loop to keep the steady
        # state loop short.
        visited: dict = {}
        queue: list = []
        push = queue.append
        cap, misses, hand = self.capacity, 0, 0
        it = iter(ids)
        for key in it:
            if key in visited:
                visited[key] = 1
                continue
            misses += 1
            push(key)
            visited[key] = 0
            if misses == cap:
                break
        for key in it:
            if key in visited:
                visited[key] = 1
                continue
            misses += 1
            while True:
                try:
                    victim = queue[hand]
                except IndexError:  # the hand passed the newest key
                    queue = [k for k in queue if k is not None]
                    push, hand = queue.append, 0
                    victim = queue[0]
                hand += 1
                if victim is None:
                    continue
                if visited[victim]:
                    visited[victim] = 0
                else:
                    queue[hand - 1] = None
                    del visited[victim]
                    break
            if hand == len(queue):  # restart at the oldest before the new key goes in
                queue = [k for k in queue if k is not None]
                push, hand = queue.append, 0
            push(key)
            visited[key] = 0
        return misses
