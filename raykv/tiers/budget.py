"""Byte budgets and bounded key sets: the bookkeeping every tier and the manager's index share.

Ray-free: unit-tested in `tests/unit` without starting Ray.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey
from raykv.policies import make_policy, touch_prefix

DEFAULT_EXPECTED_CHUNK_BYTES = 2 << 20


def check_priority(priority: object) -> None:
    """A put's eviction priority is None or a finite int or float (not a bool)."""
    if priority is None:
        return
    if not isinstance(priority, bool) and isinstance(priority, numbers.Real):
        if isinstance(priority, numbers.Integral) or math.isfinite(priority):
            return
    raise InvalidInputError(f"priority={priority!r} is invalid; allowed: None or a finite number")


@dataclass(slots=True, eq=False)
class _Chain:
    """A request's keys (shallowest first) waiting for their writes before `place` runs."""

    keys: list
    priority: float | None
    spared: bool
    waiting: int = 0


class ByteBudgetIndex:
    """Sizes of the entries of one tier, its eviction policy and its byte budget.

    Not thread-safe: the owning tier holds its lock around every call. Space for an
    entry being written is *reserved* first (evicting complete entries by policy to make
    room) and *committed* once the entry is complete, so `used + reserved` never exceeds
    capacity.

    Only evictable keys are in the policy, so eviction never walks over the others: a
    key enters it when it is complete *and* the put that admitted it has placed its
    request with `place()`. `place` waits for the request's pending writes, then walks
    the request's chain deepest first, inserting its new keys and touching the ones
    held before, so the first chunk of a request ends the most recent and an earlier
    chunk is never evicted before a later one, across requests too (a multi-turn chat
    adds deeper chunks to a prefix cached earlier). Between `spare(chain)` and its
    `place(..., spared=True)` the chain's held keys are not evicted: a request never
    makes room for its new chunks by evicting its own prefix.
    """

    def __init__(
        self,
        capacity_bytes: int,
        policy: str = "lru",
        expected_entry_bytes: int = DEFAULT_EXPECTED_CHUNK_BYTES,
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidInputError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.policy_name = policy.lower()
        # Policies are sized in objects; only queue-based ones (S3-FIFO, SLRU, ARC) use it.
        slots = max(1, self.capacity // max(1, expected_entry_bytes))
        self._policy = make_policy(policy, slots)
        self._sizes: dict[Hashable, int] = {}
        self._reserved: dict[Hashable, int] = {}
        self._waiting: dict[Hashable, list[_Chain]] = {}  # pending key -> chains to place
        self._spared: dict[Hashable, int] = {}  # key -> puts admitting its request
        self.used = 0
        self.reserved = 0

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size_of(self, key: Hashable) -> int | None:
        return self._sizes.get(key)

    def keys(self) -> list:
        return list(self._sizes)

    def touch(self, key: Hashable) -> None:
        self._policy.touch(key)

    def touch_prefix(self, keys: Sequence[Hashable]) -> None:
        """Touch a request's hits deepest first (see `raykv.policies.touch_prefix`)."""
        touch_prefix(self._policy, keys)

    def _evict_one(self, incoming: Hashable = None) -> tuple[Hashable, int] | None:
        # Only complete, placed keys are in the policy: just the spared chains (a few
        # requests' keys) are skipped, never the pending writes.
        spared = self._spared
        can_evict = (lambda k: k not in spared) if spared else None
        got = self._policy.evict(1, can_evict, incoming=incoming)
        if not got:
            return None
        size = self._sizes.pop(got[0])
        self.used -= size
        return got[0], size

    def reserve(self, key: Hashable, size: int) -> tuple[bool, list[tuple[Hashable, int]]]:
        """Reserve `size` bytes for `key`, evicting by policy: (fits, [(victim, size)]).

        Reserved entries cannot be evicted, so a request larger than
        `capacity - reserved` fails at once without evicting anything.
        """
        if size > self.capacity - self.reserved:
            return False, []
        victims: list[tuple[Hashable, int]] = []
        while self.used + self.reserved + size > self.capacity:
            victim = self._evict_one(incoming=key)
            if victim is None:
                break
            victims.append(victim)
        fits = self.used + self.reserved + size <= self.capacity
        if fits:
            self._reserved[key] = size
            self.reserved += size
        return fits, victims

    def spare(self, keys: Iterable[Hashable]) -> None:
        """Keep `keys` (a request's chain being admitted) from eviction until the matching
        `place(keys, spared=True)` has placed them."""
        spared = self._spared
        for key in dict.fromkeys(keys):  # once per put, as `_settle` ends it
            spared[key] = spared.get(key, 0) + 1

    def place(
        self, keys: Sequence[Hashable], priority: float | None = None, *, spared: bool = False
    ) -> None:
        """Place a request's chain `keys` (request order: shallowest first) in the policy.

        Deepest first, each new complete key is inserted (with `priority`) and each key
        already in the policy touched, so `keys[0]` ends the most recent. Keys whose
        write is pending hold the whole chain back until each commits or is unreserved
        (the order is request order, not write-completion order). With `spared`, ends
        the `spare(keys)` taken for this put once the chain is placed.
        """
        chain = _Chain(list(keys), priority, spared)
        for key in dict.fromkeys(chain.keys):
            if key in self._reserved:
                self._waiting.setdefault(key, []).append(chain)
                chain.waiting += 1
        if not chain.waiting:
            self._settle(chain)

    def _settle(self, chain: _Chain) -> None:
        policy, sizes = self._policy, self._sizes
        seen: set[Hashable] = set()
        for key in reversed(chain.keys):
            if key in seen:
                continue
            seen.add(key)
            if key in policy:
                policy.touch(key)
            elif key in sizes:
                policy.insert(key, priority=chain.priority)
        if chain.spared:
            uncount(self._spared, seen)

    def _wake(self, key: Hashable) -> None:
        """`key`'s write ended: place the chains that waited only for it."""
        for chain in self._waiting.pop(key, ()):
            chain.waiting -= 1
            if not chain.waiting:
                self._settle(chain)

    def order(self, keys: Iterable[Hashable]) -> None:
        """Place admitted keys given deepest first (last = most recent); see `place`."""
        self.place(list(keys)[::-1])

    def commit(self, key: Hashable, size: int) -> None:
        """Turn `key`'s reservation into an entry of its real size (at most the reservation)."""
        self.reserved -= self._reserved.pop(key, 0)
        self._sizes[key] = size
        self.used += size
        self._wake(key)

    def unreserve(self, key: Hashable) -> None:
        """Drop a reservation whose write failed or was cancelled."""
        self.reserved -= self._reserved.pop(key, 0)
        self._wake(key)

    def add(self, key: Hashable, size: int) -> None:
        """Record an entry without a reservation (index rebuild); may exceed capacity."""
        old = self._sizes.get(key)
        if old is not None:
            self.used -= old
        self._sizes[key] = size
        self.used += size
        self._policy.insert(key)

    def discard(self, key: Hashable) -> int | None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used -= size
            self._policy.remove(key)
        return size

    def shrink(self) -> list[tuple[Hashable, int]]:
        """Evict until within capacity (after a rebuild or a capacity change)."""
        victims: list[tuple[Hashable, int]] = []
        while self.used + self.reserved > self.capacity:
            victim = self._evict_one()
            if victim is None:
                break
            victims.append(victim)
        return victims

    def clear(self) -> list[Hashable]:
        """Drop every complete entry (reservations stay until their writes finish)."""
        keys = list(self._sizes)
        for key in keys:
            self._policy.remove(key)
        self._sizes.clear()
        self.used = 0
        return keys


def uncount(counts: dict[Any, int], items: Iterable[Any]) -> None:
    """Take one off the count of each of `items`, dropping those that reach 0."""
    for item in items:
        left = counts.get(item, 0) - 1
        if left > 0:
            counts[item] = left
        else:
            counts.pop(item, None)


def check_put_lengths(keys: Sequence[Any], metas: Sequence[Any], arrays: Sequence[Any]) -> None:
    """A put needs one meta and one array per key."""
    if not len(keys) == len(metas) == len(arrays):
        raise InvalidInputError(
            f"put needs one meta and one array per key: got {len(keys)} keys, "
            f"{len(metas)} metas, {len(arrays)} arrays"
        )


class BoundedKeySet:
    """A set of keys holding at most `max_keys`: adding past the cap forgets the keys
    added (or re-confirmed by `update`) longest ago. Has the set operations the manager's
    index uses. Keys are any hashables (cache keys here, chunk ids in the router)."""

    __slots__ = ("_keys", "max_keys")

    def __init__(self, max_keys: int, keys: Iterable[Hashable] = ()) -> None:
        if max_keys < 1:
            raise InvalidInputError(f"a bounded key set needs max_keys >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self.update(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def update(self, keys: Iterable[Hashable]) -> None:
        d = self._keys
        for key in keys:
            d[key] = None
            d.move_to_end(key)
        while len(d) > self.max_keys:
            d.popitem(last=False)

    def difference_update(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def intersection(self, keys: Iterable[Hashable]) -> set[Hashable]:
        return {k for k in keys if k in self._keys}

    def clear(self) -> None:
        self._keys.clear()


_HEX = "0123456789abcdef"


class CompactKeySet(BoundedKeySet):
    """A `BoundedKeySet` of `CacheKey`s that stores each as one int: its 128-bit chunk
    hash and the number of its identity (model, world size, worker, dtype), kept once.

    The manager's remote-tier index holds up to `remote_index_max_keys` (1M by default)
    keys: as tuples of fresh strings they cost ~0.3-0.6 KiB each (measured in the 30-minute
    soak), as ints ~0.15 KiB. Iterating gives the keys back, equal to those added. A key
    whose hash is not 32 lower-case hex digits is kept as it is.
    """

    __slots__ = ("_ids", "_identities")

    def __init__(self, max_keys: int, keys: Iterable[Hashable] = ()) -> None:
        self._ids: dict[tuple, int] = {}
        self._identities: list[tuple] = []
        super().__init__(max_keys, keys)

    def _encode(self, key: Any, add: bool) -> Hashable | None:
        """`key` as stored; None if it cannot be in the set (an identity never added)."""
        if not isinstance(key, CacheKey):
            return key
        h, ident = key.chunk_hash, key.identity
        if not isinstance(h, str) or len(h) != 32 or h.strip(_HEX):
            return key
        no = self._ids.get(ident)
        if no is None:
            if not add:
                return None
            no = self._ids[ident] = len(self._identities)
            self._identities.append(ident)
        return (no << 128) | int(h, 16)

    def _decode(self, item: Hashable) -> Hashable:
        if not isinstance(item, int):
            return item
        return CacheKey.of(self._identities[item >> 128], f"{item & ((1 << 128) - 1):032x}")

    def __contains__(self, key: object) -> bool:
        item = self._encode(key, add=False)
        return item is not None and item in self._keys

    def __iter__(self) -> Iterator[Hashable]:
        return (self._decode(item) for item in list(self._keys))

    def update(self, keys: Iterable[Hashable]) -> None:
        super().update(self._encode(k, add=True) for k in keys)

    def difference_update(self, keys: Iterable[Hashable]) -> None:
        items = (self._encode(k, add=False) for k in keys)
        super().difference_update(i for i in items if i is not None)

    def intersection(self, keys: Iterable[Hashable]) -> set[Hashable]:
        return {k for k in keys if k in self}

    def clear(self) -> None:
        super().clear()
        self._ids.clear()
        self._identities.clear()


__all__ = [
    "DEFAULT_EXPECTED_CHUNK_BYTES",
    "BoundedKeySet",
    "CompactKeySet",
    "ByteBudgetIndex",
    "check_priority",
    "check_put_lengths",
    "uncount",
]
