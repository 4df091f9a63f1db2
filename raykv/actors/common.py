"""Helpers shared by the tier actors: a byte-budget index, put argument checks and
resolution, a short hold for handed-out refs, and node-scoped actor names and factories."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.actors.base import ACTOR_OPTIONS
from raykv.errors import InvalidInputError
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


# Ray keeps task returns up to this size in the owner's process heap (its
# `max_direct_call_object_size`, 100 KiB by default), not in the object store.
INLINE_OBJECT_BYTES = 100 * 1024
# How long a handed-out small ref is held: up to HANDOUT_HOLD_SECS while the held bytes fit
# in HANDOUT_HOLD_BYTES, never less than HANDOUT_MIN_HOLD_SECS. Measured on an idle 2-core
# box: 20 ms already stops the leak, 0 does not.
HANDOUT_HOLD_SECS = 2.0
HANDOUT_MIN_HOLD_SECS = 0.25
HANDOUT_HOLD_BYTES = 1 << 20


class HandoutHold:
    """Keeps refs this process owns but no longer needs alive for a moment more.

    An actor that returns, nested in its reply, a ref to a *small* object it owns (one
    Ray keeps inline, in this process's heap) and drops its own reference at once leaks
    that object's bytes in Ray 2.60: the owner's copy is never freed (measured: +32 KiB
    per call, forever; big objects, and refs the owner holds until the caller has
    registered as a borrower, are fine). So such refs are held a while after the reply:
    `hold_secs`, or only `min_secs` once more than `max_bytes` are held. The held objects
    sit in the object store meanwhile (Ray promotes a handed-out inline object), so the
    cap bounds what the hold costs there: `max_bytes` + what arrives within `min_secs`.
    """

    def __init__(
        self,
        hold_secs: float = HANDOUT_HOLD_SECS,
        min_secs: float = HANDOUT_MIN_HOLD_SECS,
        max_bytes: int = HANDOUT_HOLD_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hold_secs = hold_secs
        self._min_secs = min(min_secs, hold_secs)
        self._max_bytes = max_bytes
        self._clock = clock
        self._held: deque[tuple[float, int, Any]] = deque()  # (held since, nbytes, ref)
        self.nbytes = 0

    def hold(self, ref: Any, nbytes: int) -> None:
        """Hold `ref` (a handed-out object of `nbytes`) if Ray keeps it inline."""
        now = self._clock()
        if nbytes <= INLINE_OBJECT_BYTES:
            self._held.append((now, nbytes, ref))
            self.nbytes += nbytes
        self._release(now)

    def _release(self, now: float) -> None:
        while self._held:
            since, nbytes, _ = self._held[0]
            age = now - since
            if age < self._min_secs or (age < self._hold_secs and self.nbytes <= self._max_bytes):
                break
            self._held.popleft()
            self.nbytes -= nbytes

    def __len__(self) -> int:
        return len(self._held)


def check_put_lengths(keys: Sequence[Any], metas: Sequence[Any], arrays: Sequence[Any]) -> None:
    """A put needs one meta and one array per key."""
    if not len(keys) == len(metas) == len(arrays):
        raise InvalidInputError(
            f"put needs one meta and one array per key: got {len(keys)} keys, "
            f"{len(metas)} metas, {len(arrays)} arrays"
        )


def resolve_batch(batch: Any) -> list[np.ndarray]:
    """The arrays of a put: `[ObjectRef]` whose values are `list[np.ndarray]` (zero-copy on
    the same node), a bare ObjectRef, or the arrays themselves (passed by value)."""
    if isinstance(batch, ray.ObjectRef):
        batch = [batch]
    batch = list(batch)
    if batch and all(isinstance(b, ray.ObjectRef) for b in batch):
        return [array for part in ray.get(batch) for array in part]
    return batch


def node_scoped_name(base: str, node_id: str) -> str:
    """The name of a node-scoped actor: `<base>-<node_id[:12]>`."""
    return f"{base}-{node_id[:12]}"


def get_or_create_node_actor(
    actor_cls: Any,
    base_name: str,
    namespace: str,
    *args: Any,
    node_id: str | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """The node-scoped tier actor `<base_name>-<node_id[:12]>` of `node_id` (default: this
    node), created if missing: detached (created by the manager, it must not die with it),
    pinned to its node, restarted forever."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return actor_cls.options(
        name=name or node_scoped_name(base_name, node_id),
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **ACTOR_OPTIONS,
    ).remote(*args, **kwargs)


__all__ = [
    "DEFAULT_EXPECTED_CHUNK_BYTES",
    "ByteBudgetIndex",
    "check_put_lengths",
    "get_or_create_node_actor",
    "node_scoped_name",
    "resolve_batch",
]
