"""ARC: adaptive replacement between a recency list and a frequency list."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raykv.policies.base import BasePolicy, CanEvict, Key


class ARCPolicy(BasePolicy):
    """ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03).

    T1 (seen once) and T2 (seen twice or more) hold data; B1 and B2 hold the
    ids last evicted from each. ``p`` is the paper's real-valued target size
    of T1: a hit in B1 grows it by ``max(|B2|/|B1|, 1)``, a hit in B2 shrinks
    it by ``max(|B1|/|B2|, 1)``. Pass the key about to be inserted as
    ``evict(..., incoming=key)`` so the target adapts before victims are
    chosen, as in the paper; without it ``insert`` adapts afterwards. An
    ``evict`` that finds no victim leaves ``p`` alone. Every ``insert`` and
    ``evict`` keeps the ghosts (trimming their LRU ends) within the paper's
    bounds |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c, which a store
    evicting several keys at once would otherwise break.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self._t1: OrderedDict = OrderedDict()  # LRU first
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()
        self._b2: OrderedDict = OrderedDict()
        self._adapted: Key | None = None

    def _adapt(self, key: Key) -> None:
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self.p = min(float(self.capacity), self.p + max(b2 / b1, 1.0))
        elif key in self._b2:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
        self._adapted = key

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key in self:
            self.touch(key)
            return
        if self._adapted != key:
            self._adapt(key)
        self._adapted = None
        if self._b1.pop(key, False) is None or self._b2.pop(key, False) is None:
            self._t2[key] = None
        else:
            self._t1[key] = None  # the only insert that can break a bound
            self._trim()

    def _trim(self) -> None:
        """Drop ghost LRU ids past the paper's bounds (relaxed only if over-filled)."""
        t1, b1, b2 = len(self._t1), self._b1, self._b2
        extra = t1 + len(b1) - self.capacity
        if extra > 0:
            for _ in range(min(extra, len(b1))):
                b1.popitem(last=False)
        extra = t1 + len(self._t2) + len(b1) + len(b2) - 2 * self.capacity
        if extra > 0:
            for ghost in (b2, b1):
                while extra and ghost:
                    ghost.popitem(last=False)
                    extra -= 1

    def touch(self, key: Key) -> None:
        if self._t1.pop(key, False) is None:
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if self._t1.pop(key, False) is not None:
            self._t2.pop(key, None)

    @staticmethod
    def _oldest(order: OrderedDict, can_evict: CanEvict | None) -> Key | None:
        for key in order:
            if can_evict is None or can_evict(key):
                return key
        return None

    def _replace(self, can_evict: CanEvict | None, in_b2: bool) -> Key | None:
        """The paper's REPLACE: move T1's or T2's LRU (evictable) key to its ghost."""
        t1 = len(self._t1)
        prefer_t1 = t1 > 0 and (t1 > self.p or (in_b2 and t1 == self.p))
        lists = [(self._t1, self._b1), (self._t2, self._b2)]
        for data, ghost in lists if prefer_t1 else lists[::-1]:
            key = self._oldest(data, can_evict)
            if key is not None:
                del data[key]
                ghost[key] = None
                return key
        return None

    def _evict_one(self, can_evict: CanEvict | None, incoming: Key | None) -> Key | None:
        c, t1, b1 = self.capacity, len(self._t1), len(self._b1)
        if incoming is not None and (incoming in self._b1 or incoming in self._b2):
            return self._replace(can_evict, incoming in self._b2)
        drop = None  # a ghost list whose LRU id goes, once a victim is found
        if t1 + b1 >= c:
            if t1 >= c:
                key = self._oldest(self._t1, can_evict)
                if key is not None:
                    del self._t1[key]
                    return key
            elif b1:
                drop = self._b1
        elif t1 + b1 + len(self._t2) + len(self._b2) >= 2 * c and self._b2:
            drop = self._b2
        victim = self._replace(can_evict, False)
        if victim is not None and drop is not None:
            drop.popitem(last=False)
        return victim

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        if n <= 0:
            return []
        p, adapted = self.p, self._adapted
        # Evicting never grows |T1|+|B1| or the total; only an over-filled cache
        # (insert without evict) can leave bounds that need trimming afterwards.
        overfull = len(self._t1) + len(self._t2) > self.capacity
        if incoming is not None and incoming not in self and adapted != incoming:
            self._adapt(incoming)
        victims: list = []
        while len(victims) < n and len(self):
            key = self._evict_one(can_evict, incoming)
            if key is None:
                break
            victims.append(key)
        if not victims:  # nothing changed: the insert may never come
            self.p, self._adapted = p, adapted
        elif overfull:
            self._trim()
        return victims

    def simulate(self, ids: Iterable[Key]) -> int:
        # replay() inlined. With no pins and one miss at a time, evict(1, incoming=key)
        # then insert(key) reduces to the paper's cases II-IV below. After the fill,
        # |T1|+|T2| == c and each case keeps |T1|+|B1| <= c and the total <= 2c, so
        # the trimming that insert() does never fires here.
        t1: OrderedDict = OrderedDict()
        t2: OrderedDict = OrderedDict()
        b1: OrderedDict = OrderedDict()
        b2: OrderedDict = OrderedDict()
        t2_move = t2.move_to_end
        t1_pop, t2_pop, b1_pop, b2_pop = t1.popitem, t2.popitem, b1.popitem, b2.popitem
        c, p, misses = self.capacity, 0.0, 0
        cf = float(c)
        it = iter(ids)
        for key in it:  # fill: nothing is evicted, the ghosts stay empty
            if key in t2:
                t2_move(key)
            elif t1.pop(key, False) is None:
                t2[key] = None
            else:
                misses += 1
                t1[key] = None
                if misses == c:
                    break
        # From here on |T1| + |T2| == c: every miss makes room for exactly one key.
        for key in it:
            if key in t2:
                t2_move(key)
                continue
            if t1.pop(key, False) is None:
                t2[key] = None
                continue
            misses += 1
            n1 = len(t1)
            in_b1 = b1.pop(key, False) is None
            if in_b1 or b2.pop(key, False) is None:  # cases II/III: adapt, REPLACE, to T2
                if in_b1:
                    p = min(cf, p + max(len(b2) / (len(b1) + 1), 1.0))
                else:
                    p = max(0.0, p - max(len(b1) / (len(b2) + 1), 1.0))
                if n1 and (n1 > p or not in_b1 and n1 == p) or not t2:
                    b1[t1_pop(False)[0]] = None
                else:
                    b2[t2_pop(False)[0]] = None
                t2[key] = None
                continue
            # Case IV: T1 filling the cache loses its LRU outright; otherwise REPLACE,
            # and the ghost bounds (checked before it) decide which ghost drops its LRU.
            if n1 >= c:
                t1_pop(False)
            else:
                nb1, nb2 = len(b1), len(b2)
                if n1 and n1 > p or not t2:
                    b1[t1_pop(False)[0]] = None
                else:
                    b2[t2_pop(False)[0]] = None
                if n1 + nb1 >= c:
                    b1_pop(False)
                elif nb2 and nb1 + nb2 >= c:
                    b2_pop(False)
            t1[key] = None
        return misses

    def clear(self) -> None:
        for order in (self._t1, self._t2, self._b1, self._b2):
            order.clear()
        self.p = 0.0
        self._adapted = None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
