"""SLRU: segmented LRU, a probation segment and protected segment(s)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from raykv.errors import ConfigError
from raykv.policies.base import BasePolicy, CanEvict, Key, pick, replay


class SLRUPolicy(BasePolicy):
    """Segmented LRU (Karedla, Love & Wherry, IEEE Computer 1994).

    New keys enter the probation segment (segment 0). A hit moves a key one
    segment up (or to the front of the top segment); a segment over its
    share demotes its LRU key to the MRU end of the segment below. Eviction
    takes the LRU key of the lowest non-empty segment. ``split`` gives the
    segments' shares of ``capacity`` (default 20:80, like libCacheSim's
    ``seg-size=1:4``). ``warm_fill=True`` copies libCacheSim's cold start: a
    new key goes to the lowest segment that still has room, so a cold cache
    fills its protected segment directly; that breaks the prefix-closed
    guarantee during warm-up, hence off by default.
    """

    name = "slru"

    def __init__(
        self, capacity: int, split: Sequence[float] = (1, 4), warm_fill: bool = False
    ) -> None:
        super().__init__(capacity)
        shares = [float(s) for s in split]
        if len(shares) < 2 or min(shares) <= 0:
            raise ConfigError(
                f"policy 'slru': split={split!r} is invalid; allowed: two or more positive shares"
            )
        self.split = tuple(split)
        self.warm_fill = warm_fill
        total = sum(shares)
        self._caps = [max(1, int(capacity * s / total)) for s in shares]
        self._segs: list[OrderedDict] = [OrderedDict() for _ in shares]
        self._where: dict = {}

    def params(self) -> dict[str, Any]:
        return {"split": self.split, "warm_fill": self.warm_fill}

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key in self._where:
            self.touch(key)
            return
        seg = 0
        if self.warm_fill:
            free = (i for i, s in enumerate(self._segs) if len(s) < self._caps[i])
            seg = next(free, 0)
        self._where[key] = seg
        self._segs[seg][key] = None

    def touch(self, key: Key) -> None:
        seg = self._where.get(key)
        if seg is None:
            return
        top = len(self._segs) - 1
        if seg == top:
            self._segs[seg].move_to_end(key)
            return
        del self._segs[seg][key]
        self._segs[seg + 1][key] = None
        self._where[key] = seg + 1
        self._demote_from(seg + 1)

    def _demote_from(self, seg: int) -> None:
        # Overflow cascades down; segment 0 is bounded by the caller's evictions.
        while seg > 0 and len(self._segs[seg]) > self._caps[seg]:
            key = self._segs[seg].popitem(last=False)[0]
            self._segs[seg - 1][key] = None  # a new key: already the newest there
            self._where[key] = seg - 1
            seg -= 1

    def remove(self, key: Key) -> None:
        seg = self._where.pop(key, None)
        if seg is not None:
            del self._segs[seg][key]

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        victims = pick(self._segs, n, can_evict)
        for key in victims:
            self.remove(key)
        return victims

    def simulate(self, ids: Iterable[Key]) -> int:
        if len(self._caps) != 2:  # the general case drives the protocol
            return replay(self.fresh(), ids)
        # replay() inlined for the usual probation + protected pair.
        prob: OrderedDict = OrderedDict()
        prot: OrderedDict = OrderedDict()
        prot_move, prot_pop = prot.move_to_end, prot.popitem
        prob_cap, prot_cap = self._caps
        cap, size, misses, warm = self.capacity, 0, 0, self.warm_fill
        for key in ids:
            if key in prot:
                prot_move(key)
                continue
            if prob.pop(key, False) is None:  # a probation hit: promote, maybe demote
                prot[key] = None
                if len(prot) > prot_cap:
                    prob[prot_pop(False)[0]] = None
                continue
            misses += 1
            if size >= cap:
                (prob or prot).popitem(False)
            else:
                size += 1
            if warm and len(prob) >= prob_cap and len(prot) < prot_cap:
                prot[key] = None
            else:
                prob[key] = None
        return misses

    def clear(self) -> None:
        for seg in self._segs:
            seg.clear()
        self._where.clear()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where
