"""Byte budgets and bounded key sets: the bookkeeping every tier and the manager's index share.

Ray-free: unit-tested in `tests/unit` without starting Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey
from raykv.policies import make_policy, touch_prefix

DEFAULT_EXPECTED_CHUNK_BYTES = 2 << 20


class ByteBudgetIndex:
    """Sizes of the entries of one tier, its eviction policy and its byte budget.

    Not thread-safe: the owning tier holds its lock around every call. Space for an
    entry being written is *reserved* first (evicting complete entries by policy to make
    room) and *committed* once the entry is complete, so `used + reserved` never exceeds
    capacity. The put that admitted keys places them in the policy with `order()` once
    (in request order, not write-completion order); a key is evictable only once it is
    both complete and ordered, so a request never evicts its own earlier chunks.
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

    def _complete(self, key: Hashable) -> bool:
        return key in self._sizes

    def _evict_one(self, incoming: Hashable = None) -> tuple[Hashable, int] | None:
        got = self._policy.evict(1, self._complete, incoming=incoming)
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

    def order(self, keys: Iterable[Hashable]) -> None:
        """Insert admitted keys into the policy, in the given order (last = most recent)."""
        for key in keys:
            if key in self._reserved or key in self._sizes:
                self._policy.insert(key)

    def commit(self, key: Hashable, size: int) -> None:
        """Turn `key`'s reservation into an entry of its real size (at most the reservation)."""
        self.reserved -= self._reserved.pop(key, 0)
        self._sizes[key] = size
        self.used += size

    def unreserve(self, key: Hashable) -> None:
        """Drop a reservation whose write failed or was cancelled."""
        self.reserved -= self._reserved.pop(key, 0)
        if key not in self._sizes:
            self._policy.remove(key)

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
    index uses."""

    __slots__ = ("_keys", "max_keys")

    def __init__(self, max_keys: int, keys: Iterable[CacheKey] = ()) -> None:
        if max_keys < 1:
            raise InvalidInputError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._keys: OrderedDict[CacheKey, None] = OrderedDict()
        self.update(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[CacheKey]:
        return iter(self._keys)

    def update(self, keys: Iterable[CacheKey]) -> None:
        d = self._keys
        for key in keys:
            d[key] = None
            d.move_to_end(key)
        while len(d) > self.max_keys:
            d.popitem(last=False)

    def difference_update(self, keys: Iterable[CacheKey]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def intersection(self, keys: Iterable[CacheKey]) -> set[CacheKey]:
        return {k for k in keys if k in self._keys}

    def clear(self) -> None:
        self._keys.clear()


__all__ = ["DEFAULT_EXPECTED_CHUNK_BYTES", "BoundedKeySet", "ByteBudgetIndex", "check_put_lengths"]
