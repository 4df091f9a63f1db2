"""The eviction-policy protocol shared by every policy, plus small helpers.

A policy only *orders* keys; the storage tier that owns it decides *when* to
evict (a byte budget, a pin table) and calls ``evict(n, can_evict)``. The
simulator drives a policy the same way: on a miss it evicts while
``len(policy) >= capacity`` and then inserts.

Contract (pinned down by ``tests/unit/test_policies_contract.py``):

* ``insert(key)`` of a key already cached counts as a hit (``touch``).
  Every policy accepts an optional ``priority`` keyword; only ``priority``
  uses it. Inserting never evicts: the caller calls ``evict`` first.
* ``touch(key)`` and ``remove(key)`` of an absent key are no-ops, because a
  lazily batched touch may name keys that were evicted meanwhile.
* ``evict(n, can_evict)`` removes and returns up to ``n`` keys for which
  ``can_evict(key)`` is true, in eviction order. The result may be partial:
  fewer than ``n`` victims (even ``[]``) when fewer keys are evictable, so a
  caller that needs room must check ``len(victims)``; the state stays
  consistent either way. ``evict(n)`` with ``n <= 0`` returns ``[]`` and
  changes nothing (not even ARC's target or a ghost). It never returns a
  pinned key and never changes a pinned key's metadata (position, bits,
  counts): pinned keys are skipped in place. Evictable keys the scan passes
  over age exactly as the algorithm ages them (SIEVE/CLOCK clear their bit,
  S3-FIFO moves small->main or reinserts in main). When no key is evictable
  the call returns ``[]`` and leaves the state unchanged. The scan only walks
  over pinned keys, so it never walks the whole cache when nothing is pinned.
* Ghost and queue state (S3-FIFO's ghost FIFO, ARC's B1/B2) is internal: a
  victim's id enters the ghost inside ``evict``; a later ``insert`` of that id
  consults the ghost. ``remove`` never adds to a ghost. The reference order
  is "look up the ghost, then evict", so both take the key about to be
  inserted as ``evict(..., incoming=key)`` when the caller knows it (every
  policy accepts and may ignore that keyword): ARC adapts its target before
  choosing victims, S3-FIFO takes the key out of its ghost before trimming
  it. Without ``incoming``, S3-FIFO defers trimming to the next ``insert``
  (its ghost may exceed its size by the victims of one ``evict`` meanwhile)
  and ARC adapts in ``insert``. Ghosts stay bounded: S3-FIFO's by its size,
  ARC's by the paper's |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
* ``capacity`` is the object count the policy is sized for. It sizes the
  internal queues (S3-FIFO small/main/ghost, SLRU segments, ARC); ``len``
  may exceed it if the caller inserts without evicting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from raykv.errors import ConfigError

Key = Hashable
CanEvict = Callable[[Any], bool]


@runtime_checkable
class Policy(Protocol):
    """What a storage tier needs from an eviction policy; every method is O(1) amortised."""

    capacity: int

    def insert(self, key: Key, priority: float | None = None) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class BasePolicy:
    """Capacity validation and the reference replay loop shared by all policies."""

    name: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"policy {self.name!r}: capacity={capacity!r} is invalid; "
                "allowed: an integer >= 1 (objects)"
            )
        self.capacity = capacity

    def simulate(self, ids: Iterable[Key]) -> int:
        """Miss count of ``ids`` on a cold cache of ``capacity`` objects; ``self`` is untouched.

        Subclasses override this with a specialised loop; it must return
        exactly what :func:`replay` returns on a fresh instance.
        """
        return replay(self.fresh(), ids)

    def fresh(self) -> BasePolicy:
        """A new, empty policy with the same class, capacity and parameters."""
        return type(self)(self.capacity, **self.params())

    def params(self) -> dict[str, Any]:
        """Constructor keyword parameters (besides capacity) that rebuild this policy."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, len={len(self)})"  # type: ignore[arg-type]


def replay(policy: Policy, ids: Iterable[Key]) -> int:
    """Drive ``policy`` through its protocol methods, as the simulator does; return misses.

    The size is tracked from the protocol's own guarantees (an insert of an
    absent key adds it, ``evict`` returns what it removed) rather than asked
    with ``len`` on every miss.
    """
    contains, touch, evict, insert = policy.__contains__, policy.touch, policy.evict, policy.insert
    misses, size, cap = 0, len(policy), policy.capacity
    for key in ids:
        if contains(key):
            touch(key)
            continue
        misses += 1
        if size >= cap:
            size -= len(evict(size - cap + 1, None, incoming=key))
        insert(key)
        size += 1
    return misses


def touch_prefix(policy: Policy, keys: Sequence[Key]) -> None:
    """Touch a request's cached chunk keys deepest first.

    The first chunk is then the most recently used, so recency-ordered
    policies evict a deeper chunk before its prefix and the cache stays
    prefix-closed (a chunk is useless without its parent).
    """
    for key in reversed(keys):
        policy.touch(key)  # a no-op for an absent key


def take(order: OrderedDict, n: int, can_evict: CanEvict | None, newest: bool = False) -> list:
    """Pop up to ``n`` evictable keys from one end of ``order``, skipping pinned ones."""
    if n <= 0 or not order:
        return []
    if can_evict is None:
        n = min(n, len(order))
        return [order.popitem(last=newest)[0] for _ in range(n)]
    victims = []
    for key in reversed(order) if newest else order:
        if can_evict(key):
            victims.append(key)
            if len(victims) == n:
                break
    for key in victims:
        del order[key]
    return victims


def pick(groups: Iterable[Iterable], n: int, can_evict: CanEvict | None) -> list:
    """Up to ``n`` evictable keys, scanning ``groups`` in order; removes nothing.

    For policies that keep keys in ordered buckets (LFU counts, priority
    levels, SLRU segments), each bucket oldest first.
    """
    victims: list = []
    if n <= 0:
        return victims
    for group in groups:
        for key in group:
            if can_evict is None or can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    return victims
    return victims


def restore_front(order: OrderedDict, held: list[tuple[Any, Any]]) -> None:
    """Put keys set aside from the front of ``order`` back where they were."""
    for key, value in reversed(held):
        order[key] = value
        order.move_to_end(key, last=False)
