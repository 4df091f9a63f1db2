"""S3-FIFO: a small FIFO, a main FIFO and a ghost FIFO of ids."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from raykv.errors import ConfigError
from raykv.policies.base import BasePolicy, CanEvict, Key, restore_front


class S3FIFOPolicy(BasePolicy):
    """S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

    As libCacheSim's textbook ``S3FIFOv0``: small = ``int(0.1 * capacity)``
    (at least 1), main = the rest, ghost = ``int(0.9 * capacity)`` ids.
    2-bit frequency capped at 3. New keys enter small, or main when their id
    is in the ghost. Evict from main when main is over its share or small is
    empty, else from small: a key hit ``move_threshold`` times moves to main
    (frequency 0), otherwise its id goes to the ghost and it is evicted. Main
    reinserts a key with frequency-1 and evicts one at 0. Tiny capacities
    work (capacity 1: small 1, main 0, so a promoted key is evicted next);
    libCacheSim itself refuses capacities below 10. The reference looks the
    new key up in the ghost before evicting: ``evict(..., incoming=key)``
    takes ``key`` out of the ghost and trims it to size; without ``incoming``
    the trim waits for the next ``insert``.
    """

    name = "s3fifo"

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        move_threshold: int = 2,
    ) -> None:
        super().__init__(capacity)
        if not 0 < small_ratio < 1 or ghost_ratio < 0 or move_threshold < 1:
            raise ConfigError(
                f"policy 's3fifo': small_ratio={small_ratio!r}, ghost_ratio={ghost_ratio!r}, "
                f"move_threshold={move_threshold!r}; allowed: 0 < small_ratio < 1, "
                "ghost_ratio >= 0, move_threshold >= 1"
            )
        self.small_ratio, self.ghost_ratio = small_ratio, ghost_ratio
        self.move_threshold = move_threshold
        self._small_cap = max(1, int(capacity * small_ratio))
        self._main_cap = capacity - self._small_cap
        self._ghost_cap = int(capacity * ghost_ratio)
        # Every cached key's 2-bit frequency (membership too); small, main and the
        # ghost only keep order, oldest first.
        self._freq: dict = {}
        self._small, self._main, self._ghost = OrderedDict(), OrderedDict(), OrderedDict()
        self._returning: Key | None = None  # taken out of the ghost by evict(incoming=)

    def params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("small_ratio", "ghost_ratio", "move_threshold")}

    def _trim_ghost(self, slack: int = 0) -> None:
        for _ in range(len(self._ghost) - self._ghost_cap - slack):
            self._ghost.popitem(last=False)

    def insert(self, key: Key, priority: float | None = None) -> None:
        freq = self._freq
        f = freq.get(key)
        if f is not None:  # cached: a hit
            if f < 3:
                freq[key] = f + 1
            return
        returning, self._returning = self._returning, None
        freq[key] = 0
        if key == returning or self._ghost.pop(key, False) is None:
            self._main[key] = None
        else:
            self._small[key] = None
        if len(self._ghost) > self._ghost_cap:
            self._trim_ghost()

    def touch(self, key: Key) -> None:
        freq = self._freq
        f = freq.get(key)
        if f is not None and f < 3:
            freq[key] = f + 1

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is not None and self._small.pop(key, False) is not None:
            del self._main[key]

    def _evict_small(self, ok: CanEvict, held: list) -> Key | None:
        small, freq = self._small, self._freq
        while small:
            key = small.popitem(last=False)[0]
            if not ok(key):
                held.append((key, None))
            elif freq[key] >= self.move_threshold:
                self._main[key] = None
                freq[key] = 0
            else:
                del freq[key]
                if self._ghost_cap:
                    self._ghost[key] = None
                return key
        return None

    def _evict_main(self, ok: CanEvict, held: list) -> Key | None:
        main, freq = self._main, self._freq
        while main:
            key = main.popitem(last=False)[0]
            if not ok(key):
                held.append((key, None))
                continue
            f = freq[key]
            if f:
                main[key] = None
                freq[key] = f - 1
            else:
                del freq[key]
                return key
        return None

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        if n <= 0:
            return []
        ghost = self._ghost
        ghosts = len(ghost)
        freq = self._freq
        if n == 1 and can_evict is None and freq:
            # A store's usual call, nothing pinned: _evict_some inlined without the
            # bookkeeping for held keys (this is the hot path of every miss).
            small, main = self._small, self._main
            victim = None
            while victim is None:
                if main and (len(main) > self._main_cap or not small):
                    while True:  # frequencies only drop here, so a victim comes
                        key = main.popitem(False)[0]
                        f = freq[key]
                        if not f:
                            del freq[key]
                            victim = key
                            break
                        main[key] = None
                        freq[key] = f - 1
                else:
                    while small:
                        key = small.popitem(False)[0]
                        if freq[key] >= self.move_threshold:
                            main[key] = None
                            freq[key] = 0
                        else:
                            del freq[key]
                            if self._ghost_cap:
                                ghost[key] = None
                            victim = key
                            break
            victims = [victim]
        else:
            victims = self._evict_some(n, can_evict or _always)
        if victims:  # else nothing changed, the ghost included
            if incoming is None:  # the next insert's key may be in the new slack
                self._trim_ghost(len(ghost) - ghosts)
            else:
                if ghost.pop(incoming, False) is None:
                    self._returning = incoming
                if len(ghost) > self._ghost_cap:
                    self._trim_ghost()
        return victims

    def _evict_some(self, n: int, ok: CanEvict) -> list:
        small, main = self._small, self._main
        victims: list = []
        held_small: list = []  # pinned keys set aside, put back in place below
        held_main: list = []
        while len(victims) < n and (small or main):
            if main and (len(main) + len(held_main) > self._main_cap or not small):
                victim = self._evict_main(ok, held_main)
            else:
                victim = self._evict_small(ok, held_small)
            if victim is not None:
                victims.append(victim)
        restore_front(small, held_small)
        restore_front(main, held_main)
        return victims

    def clear(self) -> None:
        for queue in (self._freq, self._small, self._main, self._ghost):
            queue.clear()
        self._returning = None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def simulate(self, ids: Iterable[Key]) -> int:
        # replay() inlined on deques (no pins, no removal): ~2x faster than driving
        # the protocol's OrderedDict steps, so the two loops are kept apart.
        freq: dict = {}
        small: deque = deque()
        main: deque = deque()
        ghost: OrderedDict = OrderedDict()
        s_push, s_pop, m_push, m_pop = small.append, small.popleft, main.append, main.popleft
        g_pop = ghost.popitem
        cap, main_cap, ghost_cap = self.capacity, self._main_cap, self._ghost_cap
        threshold, misses, n_small, n_main = self.move_threshold, 0, 0, 0
        for key in ids:
            f = freq.get(key)
            if f is not None:
                if f < 3:
                    freq[key] = f + 1
                continue
            misses += 1
            to_main = ghost.pop(key, False) is None
            while n_small + n_main >= cap:
                if n_main > main_cap or not n_small:
                    while True:
                        victim = m_pop()
                        f = freq[victim]
                        if f:
                            freq[victim] = f - 1
                            m_push(victim)
                        else:
                            del freq[victim]
                            n_main -= 1
                            break
                else:
                    while n_small:
                        victim = s_pop()
                        n_small -= 1
                        if freq[victim] >= threshold:
                            freq[victim] = 0
                            m_push(victim)
                            n_main += 1
                        else:
                            del freq[victim]
                            if ghost_cap:
                                ghost[victim] = None
                                if len(ghost) > ghost_cap:
                                    g_pop(False)
                            break
            freq[key] = 0
            if to_main:
                m_push(key)
                n_main += 1
            else:
                s_push(key)
                n_small += 1
        return misses


def _always(key: Any) -> bool:
    return True
