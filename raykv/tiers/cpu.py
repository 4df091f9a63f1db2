"""The CPU tier's bookkeeping: which batch object holds each chunk, the byte budget, the
eviction policy, pins and leases. Objects are opaque handles here; the Ray actor shell
(`raykv.actors.cpu_store`) makes and frees them.

Budget: objects are whole request batches, so the store counts *physical* bytes: a batch
is charged in full until its last live chunk is evicted. Inserting a request's chunks
deepest-first and touching them the same way (prefix-closed) makes the deep chunks of one
request leave together, which keeps the gap between physical and live bytes
(`fragmentation` in `stats()`) small.

Only evictable entries are in the policy: a batch with a pinned chunk leaves it on its
first pin and comes back (as the most recent) on its last unpin, so eviction never walks
over pinned entries, however many there are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.policies import make_policy, touch_prefix
from raykv.tiers.budget import check_priority, uncount
from raykv.tiers.lease import Leases
from raykv.wire import TIER_CPU, ChunkRef

# A policy's `capacity` is an object count; size it for chunks of about this many bytes.
_TYPICAL_CHUNK_BYTES = 1 << 20
# How long a released lookup id is remembered (capped by the lease), so late pins are no-ops.
CLOSED_LOOKUP_SECS = 60.0


@dataclass(slots=True, eq=False)
class _Batch:
    """One Ray object holding `list[np.ndarray]`; freed when its last live chunk goes."""

    ref: Any
    nbytes: int
    live: int = 0
    # Pins held on its chunks: a batch with any pinned chunk is not evictable, and its
    # chunks are out of the policy meanwhile.
    pins: int = 0
    keys: list[CacheKey] = field(default_factory=list)  # indexed here, in request order


@dataclass(slots=True)
class _Entry:
    batch: _Batch
    chunk: ChunkRef
    nbytes: int
    pins: int = 0
    priority: float | None = None  # given again to the policy when its batch is unpinned


def _nbytes(array: Any) -> int | None:
    n = getattr(array, "nbytes", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def payload_problem(meta: Any, array: Any) -> str | None:
    """Why `array` cannot be cached as the chunk `meta` describes, or None if it can.

    A reader rebuilds the chunk from `meta`, so an array of another size would make every
    later retrieve of its key fail.
    """
    if not isinstance(meta, PayloadMeta):
        return f"meta is a {type(meta).__name__}, not a PayloadMeta"
    actual = _nbytes(array)
    if actual != meta.nbytes:
        what = f"{actual} bytes" if actual is not None else f"a {type(array).__name__}"
        return f"array has {what}, its meta declares {meta.nbytes} bytes"
    return None


def payload_problems(metas: Any, arrays: Any, indices: Iterable[int]) -> dict[int, str]:
    """`payload_problem` of `metas[i]` and `arrays[i]` for each i, only where there is one
    (a missing meta or array is one too; never raises)."""
    out: dict[int, str] = {}
    for i in indices:
        try:
            meta, array = metas[i], arrays[i]
        except Exception as exc:
            out[i] = f"no meta or array at {i} ({type(exc).__name__})"
            continue
        why = payload_problem(meta, array)
        if why is not None:
            out[i] = why
    return out


class CPUStore:
    """The CPU tier's index: key -> (batch object, index, meta, bytes, pins).

    Not thread-safe; the actor calls it from its event loop only.
    """

    def __init__(
        self,
        capacity_bytes: int,
        policy: str = "lru",
        *,
        policy_capacity: int | None = None,
        lease_secs: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        on_release: Callable[[Any, int], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.policy_name = policy
        n_objects = policy_capacity or max(1024, self.capacity // _TYPICAL_CHUNK_BYTES)
        self._policy = make_policy(policy, n_objects)
        self._entries: dict[CacheKey, _Entry] = {}
        self._leases = Leases(lease_secs, clock)
        self._pinned: dict[str, list[_Entry]] = {}  # what each open lookup pinned
        # Lookup ids already released, with when to forget them (insertion order is expiry
        # order). The manager sends pin and unpin without waiting and an async actor does
        # not keep their order: a pin arriving after its unpin must not open a new lease.
        self._closed: dict[str, float] = {}
        self._closed_secs = min(lease_secs, CLOSED_LOOKUP_SECS)
        self._clock = clock
        self._on_release = on_release  # gets (ref, bytes) of each batch the index lets go
        self._held: dict[_Batch, int] = {}  # batches of puts' chains in flight: `hold_chain`
        self.used_bytes = 0  # physical: sum of the sizes of live batches
        self.pinned_bytes = 0  # physical bytes of live batches with a pinned chunk
        self.live_bytes = 0  # sum of the sizes of indexed chunks
        self.reserved_bytes = 0  # promised to puts whose re-put is still running
        self.batches = 0
        self.evictions = 0
        self.skipped = 0
        self.expired_leases = 0

    # ----- queries -----

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[CacheKey]:
        return list(self._entries)

    def chunk_refs(self, keys: Sequence[CacheKey]) -> list[ChunkRef | None]:
        """The `ChunkRef` of each key, None where absent."""
        entries = self._entries
        return [e.chunk if (e := entries.get(k)) is not None else None for k in keys]

    def snapshot(self) -> dict[CacheKey, ChunkRef]:
        """Every cached key with its `ChunkRef` (for a manager rebuilding its index)."""
        return {k: e.chunk for k, e in self._entries.items()}

    def pins(self, key: CacheKey) -> int:
        entry = self._entries.get(key)
        return entry.pins if entry is not None else 0

    def split(self, keys: Sequence[CacheKey]) -> tuple[list[CacheKey], dict[CacheKey, int]]:
        """(keys already cached, {new key: its first position in `keys`}), for a put."""
        present: list[CacheKey] = []
        new: dict[CacheKey, int] = {}
        for i, key in enumerate(keys):
            if key in self._entries:
                present.append(key)
            elif key not in new:
                new[key] = i
        return present, new

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes - self.reserved_bytes

    @property
    def obtainable_bytes(self) -> int:
        """Free bytes plus what evicting every evictable batch would give back."""
        return self.capacity - self.reserved_bytes - self.pinned_bytes

    # ----- allocation -----

    def hold_chain(self, keys: Sequence[CacheKey]) -> list[_Batch]:
        """Spare the batches holding `keys` (a put's request chain, as cached now) from
        every allocation until `drop_chain`: while its copy runs, another put must not
        evict the prefix it is adding to. Returns the token for `drop_chain`."""
        entries, held = self._entries, self._held
        batches = list({id(e.batch): e.batch for k in keys if (e := entries.get(k))}.values())
        for batch in batches:
            held[batch] = held.get(batch, 0) + 1
        return batches

    def drop_chain(self, batches: list[_Batch]) -> None:
        uncount(self._held, batches)

    def _spare(
        self, keys: Iterable[CacheKey], *, held: bool = True
    ) -> tuple[Callable[[CacheKey], bool] | None, int]:
        """A `can_evict` sparing the unpinned batches holding `keys` (and, with `held`,
        those of the chains of puts in flight: `hold_chain`), and their bytes.

        A put spares its request's cached chunks: making room for the new, deeper chunks
        by evicting their own prefix would leave them dead weight. Only those batches'
        chunks are ever walked over (pinned ones are out of the policy).
        """
        entries = self._entries
        spared = {e.batch for k in keys if (e := entries.get(k)) is not None and not e.batch.pins}
        if held and self._held:
            spared.update(b for b in self._held if b.live and not b.pins)
        if not spared:
            return None, 0
        return (lambda k: entries[k].batch not in spared), sum(b.nbytes for b in spared)

    def _make_room(
        self, nbytes: int, can_evict: Callable[[CacheKey], bool] | None, room: int
    ) -> tuple[bool, list[CacheKey]]:
        evicted: list[CacheKey] = []
        if nbytes > room:
            return False, evicted
        while self.free_bytes < nbytes:
            victims = self._policy.evict(1, can_evict)
            if not victims:
                return False, evicted
            for key in victims:
                self._drop(key)
                evicted.append(key)
        return True, evicted

    def make_room(self, nbytes: int, spare: Iterable[CacheKey] = ()) -> tuple[bool, list[CacheKey]]:
        """Evict unpinned batches' entries by policy until `nbytes` fit; (fits, evicted).

        Never evicts a pinned entry nor a sibling of one (that would free no memory),
        nor an entry of the batches holding `spare`, and evicts nothing at all when
        even evicting everything evictable would not make `nbytes` fit.
        """
        can_evict, held = self._spare(spare)
        return self._make_room(nbytes, can_evict, self.obtainable_bytes - held)

    def could_fit(self, nbytes: int, spare: Iterable[CacheKey] = ()) -> bool:
        """Whether `nbytes` would fit once every pin and reservation has ended (the chains
        other puts hold count as taken: two puts waiting for each other's would stall)."""
        return nbytes <= self.capacity - self._spare(spare)[1]

    def allocate(
        self, sizes: Sequence[int], *, partial: bool, spare: Iterable[CacheKey] = ()
    ) -> tuple[int, list[CacheKey]]:
        """Make room for chunks of `sizes` and reserve it; (how many fit, evicted keys).

        All or nothing unless `partial`, which takes the longest prefix that fits
        (earlier chunks of a request are worth more: later ones need them). The batches
        holding `spare` (the request's chunks already cached) are not evicted.
        """
        total = sum(sizes)
        can_evict, held = self._spare(spare)
        room = self.obtainable_bytes - held
        fits, evicted = self._make_room(total, can_evict, room)
        if fits:
            self.reserved_bytes += total
            return len(sizes), evicted
        if not partial:
            return 0, evicted
        n, taken = 0, 0
        while n < len(sizes) and taken + sizes[n] <= room:
            taken += sizes[n]
            n += 1
        if taken:
            fits, more = self._make_room(taken, can_evict, room)
            evicted += more
            if not fits:  # pragma: no cover - obtainable_bytes said it would fit
                return 0, evicted
        self.reserved_bytes += taken
        return n, evicted

    def release(self, nbytes: int) -> None:
        """Give back a reservation that will not be committed."""
        self.reserved_bytes -= nbytes

    def commit(
        self,
        ref: Any,
        keys: Sequence[CacheKey],
        metas: Sequence[PayloadMeta],
        indices: Sequence[int] | None = None,
        *,
        batch_bytes: int | None = None,
        reserved: int = 0,
        lookup_id: str | None = None,
        chain: Sequence[CacheKey] | None = None,
        priority: float | None = None,
    ) -> dict[CacheKey, ChunkRef]:
        """Index `keys[i]` as chunk `indices[i]` of the batch object `ref`.

        `batch_bytes` is the object's physical size (default: the chunks' sizes);
        `reserved` the reservation it replaces. Keys already cached keep their first
        copy, and a key repeated in `keys` is indexed once. With `lookup_id` the new
        entries are pinned under it at once (a prefetch must not lose them before its
        get), unless that lookup was already released. Returns the entries added.

        `chain` is the request's keys in order, those already cached included (default:
        `keys`). Walking it deepest first, new chunks enter the policy (with `priority`)
        and cached ones are touched, so the request's first chunk ends the most recently
        used and an earlier chunk never leaves before a later one, across requests too
        (the next turn of a chat adds deeper chunks to a prefix cached before).
        """
        check_priority(priority)
        indices = range(len(keys)) if indices is None else indices
        entries = self._entries
        new = []
        seen: set[CacheKey] = set()
        for k, m, i in zip(keys, metas, indices, strict=True):
            if k not in entries and k not in seen:
                seen.add(k)
                new.append((k, m, i))
        self.reserved_bytes -= reserved
        if not new:
            return {}
        size = sum(m.nbytes for _, m, _ in new) if batch_bytes is None else batch_bytes
        batch = _Batch(ref, size, live=len(new), keys=[k for k, _, _ in new])
        self.used_bytes += size
        self.batches += 1
        out: dict[CacheKey, ChunkRef] = {}
        for key, meta, index in new:
            chunk = ChunkRef(ref, index, meta, size)
            self._entries[key] = _Entry(batch, chunk, meta.nbytes, priority=priority)
            self.live_bytes += meta.nbytes
            out[key] = chunk
        self._place(keys if chain is None else chain, out, priority)
        if lookup_id is not None:
            self.pin(lookup_id, list(out))
        return out

    def _place(self, chain: Sequence[CacheKey], added: Any, priority: float | None) -> None:
        """Deepest first: insert the chain's `added` keys, touch its other cached ones."""
        policy = self._policy
        seen: set[CacheKey] = set()
        for key in reversed(chain):
            if key in seen:
                continue
            seen.add(key)
            if key in added:
                policy.insert(key, priority=priority)
            else:
                policy.touch(key)  # a no-op when absent or pinned (out of the policy)

    def _drop(self, key: CacheKey) -> None:
        entry = self._entries.pop(key)
        self.live_bytes -= entry.nbytes
        batch = entry.batch
        batch.live -= 1
        if batch.live == 0:
            self.used_bytes -= batch.nbytes
            if batch.pins:  # removed while pinned: its bytes are no longer charged
                self.pinned_bytes -= batch.nbytes
            self.batches -= 1
            if self._on_release is not None:
                self._on_release(batch.ref, batch.nbytes)
            batch.ref = None  # the store's reference goes; Ray frees the object
            batch.keys = []
        self.evictions += 1

    def remove(self, keys: Sequence[CacheKey]) -> int:
        """Drop keys (pinned or not); returns how many were held."""
        n = 0
        for key in keys:
            if key in self._entries:
                self._policy.remove(key)
                self._drop(key)
                self.evictions -= 1  # an explicit removal is not an eviction
                n += 1
        return n

    def clear(self) -> None:
        if self._on_release is not None:  # each live batch let go, as `_drop` does
            for batch in {id(e.batch): e.batch for e in self._entries.values()}.values():
                self._on_release(batch.ref, batch.nbytes)
        self._entries.clear()
        self._held.clear()  # their batches are let go: nothing left to spare
        self._leases.clear()
        self._pinned.clear()
        self._policy.clear()
        self.used_bytes = self.live_bytes = self.batches = self.pinned_bytes = 0

    # ----- pins, leases, touches -----

    def _live_keys(self, batch: _Batch) -> list[CacheKey]:
        """The keys still indexed in `batch` (a key may since live in another batch)."""
        entries = self._entries
        return [k for k in batch.keys if (e := entries.get(k)) is not None and e.batch is batch]

    def _leave(self, batch: _Batch) -> None:
        """First pin: the batch's chunks leave the policy until its last unpin."""
        remove = self._policy.remove
        for key in self._live_keys(batch):
            remove(key)

    def _return(self, batches: list[_Batch]) -> None:
        """Last unpins: `batches` (in pin order) re-enter the policy as the most recent,
        deepest chunk first, so the first chunk of the first batch ends the most recent."""
        insert, entries = self._policy.insert, self._entries
        for batch in reversed(batches):
            for key in reversed(self._live_keys(batch)):
                insert(key, priority=entries[key].priority)

    def pin(self, lookup_id: str, keys: Sequence[CacheKey], lease_secs: float | None = None) -> int:
        """Pin the cached `keys` under `lookup_id` until `unpin` or the lease ends.

        A no-op (0) for a lookup already released: its pin lost the race with its unpin.
        """
        if lookup_id in self._closed:
            return 0
        self._leases.renew(lookup_id, lease_secs)
        pinned = self._pinned.setdefault(lookup_id, [])
        n = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.pins += 1
                batch = entry.batch
                batch.pins += 1
                if batch.pins == 1:
                    self.pinned_bytes += batch.nbytes
                    self._leave(batch)
                pinned.append(entry)
                n += 1
        return n

    def unpin(self, lookup_id: str) -> int:
        """Release every pin taken under `lookup_id`; returns how many.

        The id is remembered as closed for a while: a later `pin` or pinning commit
        under it is ignored (it arrived after this unpin).
        """
        self._closed.pop(lookup_id, None)  # re-insert: insertion order is expiry order
        self._closed[lookup_id] = self._clock() + self._closed_secs
        self._leases.end(lookup_id)
        pinned = self._pinned.pop(lookup_id, None)
        if pinned is None:
            return 0
        # The lookup holds the entries it pinned, so a key evicted and re-added since
        # is not unpinned by mistake.
        freed: list[_Batch] = []
        for entry in pinned:
            entry.pins -= 1
            batch = entry.batch
            batch.pins -= 1
            if batch.pins == 0 and batch.live:
                self.pinned_bytes -= batch.nbytes
                freed.append(batch)
        self._return(freed)
        return len(pinned)

    def is_closed(self, lookup_id: str) -> bool:
        return lookup_id in self._closed

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Unpin leases past their deadline (their client died or forgot); their ids.

        Also forgets released lookup ids older than their retention.
        """
        now = self._clock() if now is None else now
        expired = self._leases.expired(now)
        for lookup_id in expired:
            self.unpin(lookup_id)
        self.expired_leases += len(expired)
        closed = self._closed
        while closed:
            lookup_id, until = next(iter(closed.items()))
            if until > now:
                break
            del closed[lookup_id]
        return expired

    def touch(self, keys: Sequence[CacheKey]) -> None:
        """Apply a request's hits at once, prefix-closed (the first chunk ends most recent).

        Pinned chunks are out of the policy: their touch is their return on the last unpin.
        """
        touch_prefix(self._policy, keys)

    # ----- reporting -----

    def stats(self) -> dict[str, Any]:
        pinned = sum(1 for e in self._entries.values() if e.pins)
        return {
            "tier": TIER_CPU,
            "policy": self.policy_name,
            "entries": len(self._entries),
            "used_bytes": self.used_bytes,
            "live_bytes": self.live_bytes,
            "reserved_bytes": self.reserved_bytes,
            "capacity_bytes": self.capacity,
            "batches": self.batches,
            "fragmentation": 1.0 - self.live_bytes / self.used_bytes if self.used_bytes else 0.0,
            "pinned_entries": pinned,
            "pinned_bytes": self.pinned_bytes,
            "leases": len(self._leases),
            "closed_lookups": len(self._closed),
            "evictions": self.evictions,
            "skipped": self.skipped,
            "expired_leases": self.expired_leases,
        }


__all__ = ["CLOSED_LOOKUP_SECS", "CPUStore", "payload_problem", "payload_problems"]
