"""L1: the CPU tier, chunks held as Ray objects that this store owns.

`CPUStore` is a plain class (index, byte budget, eviction policy, pins, leases),
unit-tested without Ray; `CPUStoreActor` is the thin async Ray actor around it.

Ownership: `ray.put(_owner=)` is gone, so the store makes every object it indexes
its own. `put` re-puts the client's batch (one `ray.put` per request, one copy);
`pull` calls a source actor's `get_batch` with `num_returns=2` and keeps the second
return (the caller of a task owns its returns), which costs no copy in this process;
from a peer (another node's manager, whose objects this node's manager read and served
already) `adopt` re-puts what it keeps, as a peer's object lives, and dies, on the peer's node.
Either way the data outlives the writer. Evicting drops this store's reference and
Ray frees the memory once no borrower (the manager, a reading client) still holds it.

Budget: objects are whole request batches, so the store counts *physical* bytes:
a batch is charged in full until its last live chunk is evicted. Inserting a
request's chunks deepest-first and touching them the same way (prefix-closed) makes
the deep chunks of one request leave together, which keeps the gap between
physical and live bytes (`fragmentation` in `stats()`) small.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray

from raykv import metrics
from raykv.actors.common import HandoutHold, put_own
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.budget import check_priority
from raykv.tiers.cpu import CPUStore, payload_problems
from raykv.tiers.lease import sweep_forever
from raykv.wire import TIER_CPU, ChunkRef, CPUAck

logger = logging.getLogger(__name__)

# Ray's object store should exceed the CPU budget by this factor, or Ray spills silently.
OBJECT_STORE_HEADROOM = 1.2


def object_store_bytes() -> int | None:
    """Ray's object store size on this node (None if unknown)."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("Alive", True):
                return int(node["Resources"].get("object_store_memory", 0)) or None
    except Exception:
        logger.debug("cannot read the object store size", exc_info=True)
    return None


def check_object_store(capacity_bytes: int, have: int | None = None) -> bool:
    """Warn if Ray's object store cannot hold the CPU budget plus headroom (Ray would spill).

    `have` is the object store size if already known (default: ask Ray).
    """
    have = object_store_bytes() if have is None else have
    want = int(capacity_bytes * OBJECT_STORE_HEADROOM)
    if have is not None and have < want:
        logger.warning(
            "raykv CPU tier budget is %.2f GiB but Ray's object store on this node is %.2f GiB; "
            "it needs at least %.2f GiB (budget + %d%% headroom) or Ray will spill to disk "
            "and stall. Lower max_local_cpu_size or start Ray with a larger "
            "object_store_memory.",
            capacity_bytes / 2**30,
            have / 2**30,
            want / 2**30,
            round((OBJECT_STORE_HEADROOM - 1) * 100),
        )
        return False
    return True


@ray.remote
class CPUStoreActor:
    """The CPU tier as an async Ray actor around one `CPUStore`.

    Async so that a put waiting for room never blocks the unpin that frees it; no
    lock is held across an await.
    """

    def __init__(
        self,
        capacity_bytes: int,
        policy: str = "lru",
        *,
        blocking_timeout_secs: float = 10.0,
        pin_lease_secs: float = 300.0,
    ) -> None:
        self._hold = HandoutHold()  # refs handed out and dropped here (see HandoutHold)
        self._store = CPUStore(
            capacity_bytes, policy, lease_secs=pin_lease_secs, on_release=self._hold.hold
        )
        self._timeout = blocking_timeout_secs
        self._incarnation = uuid.uuid4().hex
        self._seq = 0  # put/pull acks sent (CPUAck.seq)
        self._room: asyncio.Event | None = None
        self._sweeper: asyncio.Task | None = None
        self._lease_secs = pin_lease_secs
        # Keys of peer chunks being copied into this store (see `adopt`).
        self._copying: set[CacheKey] = set()
        self._cancelled: set[CacheKey] = set()  # removed or cleared while being copied
        self._object_store_bytes = object_store_bytes()  # read once: ray.nodes() is costly
        self._object_store_ok = check_object_store(capacity_bytes, self._object_store_bytes)

    # ----- plumbing -----

    def _room_event(self) -> asyncio.Event:
        if self._room is None:
            self._room = asyncio.Event()
        return self._room

    def _signal_room(self) -> None:
        """Wake every put waiting for room (each re-checks; a fresh event for later waiters)."""
        event, self._room = self._room, asyncio.Event()
        if event is not None:
            event.set()

    def _start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                sweep_forever(self._lease_secs, self._store.expire_leases, self._leases_expired)
            )

    def _leases_expired(self, expired: list[str]) -> None:
        logger.info("released the pins of %d expired lookups", len(expired))
        self._signal_room()

    def _record(self, ack: CPUAck) -> CPUAck:
        self._seq += 1
        ack.seq = self._seq
        store = self._store
        policy = store.policy_name
        if ack.evicted:
            metrics.inc("raykv_evictions", len(ack.evicted), tier=TIER_CPU, policy=policy)
        metrics.set_gauge("raykv_used_bytes", store.used_bytes, tier=TIER_CPU, policy=policy)
        metrics.set_gauge("raykv_entries", len(store), tier=TIER_CPU, policy=policy)
        return ack

    async def _allocate(
        self, sizes: list[int], *, wait: bool, spare: list[CacheKey] | None = None
    ) -> tuple[int, list[CacheKey]]:
        """Reserve room for `sizes`, waiting up to the blocking timeout while pins hold it.

        The batches holding `spare` (the request's cached chunks) are not evicted for it.
        """
        store = self._store
        spare = spare or []
        evicted: list[CacheKey] = []
        deadline = time.monotonic() + self._timeout
        while True:
            event = self._room_event()  # taken before the attempt: no wake-up is lost
            n, ev = store.allocate(sizes, partial=False, spare=spare)
            evicted += ev
            if n == len(sizes) or not wait:
                return n, evicted
            if not store.could_fit(sum(sizes), spare):
                break  # more than pins and reservations hold: waiting cannot help
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            store.expire_leases()
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                break
        n, ev = store.allocate(sizes, partial=True, spare=spare)
        return n, evicted + ev

    def _readable(self, keys: list[CacheKey]) -> dict[CacheKey, ChunkRef]:
        chunks = self._store.chunk_refs(keys)
        return {k: c for k, c in zip(keys, chunks, strict=True) if c is not None}

    def _skip(self, ack: CPUAck, keys: list[CacheKey], reason: str | None = None) -> None:
        if keys:
            ack.skipped += keys
            self._store.skipped += len(keys)
            metrics.inc("raykv_skipped_stores", len(keys), tier=TIER_CPU)
            stats = self._store
            logger.warning(
                "CPU tier: %d chunk(s) not cached (%s; %d of %d bytes held by pinned batches)",
                len(keys),
                reason or "no unpinned room",
                stats.pinned_bytes,
                stats.capacity,
            )

    # ----- data path -----

    async def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: list[ray.ObjectRef],
        lookup_id: str | None = None,
        priority: float | None = None,
        prefix: list[CacheKey] | None = None,
    ) -> CPUAck:
        """Cache `ray.get(batch[0])[i]` under `keys[i]`, re-put as one object this store owns.

        `keys` are one request's chunks in order; `prefix` names the request's chunks
        before `keys[0]` when only the new ones are sent. The request's cached chunks are
        not evicted for its new ones, and the whole chain is then ordered prefix-closed
        (see `CPUStore.commit`); new chunks enter the policy with `priority`. An array
        whose size is not its meta's is skipped. Waits up to `blocking_timeout_secs` for
        unpinned room, then skips what does not fit.
        """
        self._start()
        check_priority(priority)
        store = self._store
        ack = CPUAck(self._incarnation)
        ack.present, todo = store.split(keys)
        copying = self._copying
        if any(k in copying for k in todo):  # being written by another put: left to it
            ack.present += [k for k in todo if k in copying]
            todo = {k: i for k, i in todo.items() if k not in copying}
        if not todo:
            ack.refs = self._readable(keys)
            return self._record(ack)  # numbered: the manager orders it among the others
        mine = list(todo)
        # Other puts spare this request's chain until this one ends: while its copy runs,
        # evicting the prefix it adds to would leave its new chunks dead weight.
        held = store.hold_chain([*(prefix or ()), *keys])
        copying.update(mine)
        try:
            return await self._put(ack, keys, metas, batch[0], todo, lookup_id, priority, prefix)
        finally:
            store.drop_chain(held)
            copying.difference_update(mine)
            self._cancelled.difference_update(mine)
            if held:
                self._signal_room()  # its chain is evictable again: a waiting put may go

    async def _put(
        self,
        ack: CPUAck,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        source: ray.ObjectRef,
        todo: dict[CacheKey, int],
        lookup_id: str | None,
        priority: float | None,
        prefix: list[CacheKey] | None,
    ) -> CPUAck:
        store = self._store
        try:
            arrays = await source
        except Exception as exc:  # the writer died before we read its batch
            logger.warning("put: cannot read the batch object (%s); nothing cached", exc)
            ack.skipped = list(todo)
            return ack
        bad = payload_problems(metas, arrays, todo.values())
        if bad:
            wrong = [k for k, i in todo.items() if i in bad]
            self._skip(ack, wrong, reason=f"bad payload: {bad[todo[wrong[0]]]}")
            todo = {k: i for k, i in todo.items() if i not in bad}
        chain = [*(prefix or ()), *keys]
        new = list(todo)
        sizes = [metas[todo[k]].nbytes for k in new]
        n, ack.evicted = await self._allocate(sizes, wait=True, spare=chain) if new else (0, [])
        taken, left = new[:n], new[n:]
        self._skip(ack, left)
        if taken:
            parts = [arrays[todo[k]] for k in taken]
            nbytes = sum(sizes[:n])
            try:
                ref = await put_own(parts, nbytes)
            except Exception as exc:
                # Keep the ack: `_allocate` may have evicted entries the caller must drop.
                logger.warning("put: ray.put of %d bytes failed (%s); not cached", nbytes, exc)
                store.release(nbytes)
                ref = None
            del parts, arrays
            # Keys removed (or the tier cleared) while the copy ran are not cached after all.
            kept = [j for j, k in enumerate(taken) if k not in self._cancelled]
            if ref is None:
                self._skip(ack, taken, reason="the object store refused the batch")
            elif not kept:
                store.release(nbytes)
            else:
                added = store.commit(
                    ref,
                    [taken[j] for j in kept],
                    [metas[todo[taken[j]]] for j in kept],
                    kept,
                    batch_bytes=nbytes,
                    reserved=nbytes,
                    lookup_id=lookup_id,
                    chain=chain,
                    priority=priority,
                )
                ack.accepted = [k for k in taken if k in added]
                # Put meanwhile by another request (a pull): the first put wins.
                ack.present += [k for k in taken if k not in added and k in store]
                if added:
                    metrics.inc("raykv_stored_bytes", nbytes, tier=TIER_CPU)
        if ack.evicted or taken:  # a reservation ended: room a waiting put may take
            self._signal_room()
        ack.refs = self._readable(keys)
        return self._record(ack)

    async def pull(
        self,
        source: Any,
        keys: list[CacheKey],
        lookup_id: str | None = None,
    ) -> CPUAck:
        """Load `keys` from a tier or producer actor's `get_batch` and keep the object.

        The store calls `source.get_batch.options(num_returns=2)` and keeps the second
        return, so it owns the arrays without copying them. Chunks that do not fit
        right now are still returned in `refs` (served, not cached): a read never
        waits for room. A failed source is a miss for every key; an array whose size
        is not its meta's is a miss too (skipped: neither cached nor served).
        """
        self._start()
        store = self._store
        ack = CPUAck(self._incarnation)
        try:
            metas_ref, arrays_ref = source.get_batch.options(num_returns=2).remote(keys)
            metas = list(await metas_ref)
            arrays = None
            if len(metas) != len(keys):
                raise ValueError(f"the source sent {len(metas)} metas for {len(keys)} keys")
            listed = [i for i, m in enumerate(metas) if m is not None]
            if listed and arrays is None:
                # Read to check each array's size against its meta (zero-copy on this node).
                arrays = await arrays_ref
        except Exception as exc:
            logger.warning("pull of %d chunks failed (%s); counted as misses", len(keys), exc)
            ack.missing = list(keys)
            return ack
        bad = payload_problems(metas, arrays, listed)
        hits = [i for i in listed if i not in bad]
        ack.missing = [k for i, k in enumerate(keys) if metas[i] is None or i in bad]
        if bad:
            first = next(iter(bad.values()))
            self._skip(ack, [keys[i] for i in bad], reason=f"bad payload from the source: {first}")
        if not hits:
            return ack
        batch_bytes = sum(metas[i].nbytes for i in hits)
        # An inline return is here already; a source object with bad arrays is not kept.
        copy = bool(bad)
        if not copy:
            arrays = None  # the store keeps the source's object, not these views of it
        new = [i for i in hits if keys[i] not in store]
        added: dict[CacheKey, ChunkRef] = {}
        if new:
            # The source's object counts every hit; a copy holds only the new ones.
            nbytes = sum(metas[i].nbytes for i in new) if copy else batch_bytes
            added = await self._admit(
                ack,
                [keys[i] for i in new],
                [metas[i] for i in new],
                nbytes,
                own=arrays_ref,
                index=new,
                arrays=[arrays[i] for i in new] if copy else None,
                lookup_id=lookup_id,
            )
        del arrays
        # After the awaits above: what is cached now, by this pull or another request.
        ack.accepted = list(added)
        ack.present = [keys[i] for i in hits if keys[i] in store and keys[i] not in added]
        if lookup_id is not None and ack.present:
            store.pin(lookup_id, ack.present)
        cached = store.chunk_refs(keys)
        served = False
        for i in hits:
            if cached[i] is not None:
                ack.refs[keys[i]] = cached[i]
            else:
                ack.refs[keys[i]] = ChunkRef(arrays_ref, i, metas[i])
                served = True
        if served:  # handed out, not kept: hold it past the caller's borrow
            self._hold.hold(arrays_ref, batch_bytes)
        if ack.evicted:
            self._signal_room()
        return self._record(ack)

    async def adopt(
        self, keys: list[CacheKey], metas: list[PayloadMeta], where: list[tuple[Any, int]]
    ) -> CPUAck:
        """Cache copies of a peer's chunks: chunk i is `ray.get(where[i][0])[where[i][1]]`,
        an object of another node's CPU store that this node's manager read (so it is on
        this node already) and served from before asking. The copy is one object of ours,
        as far as there is room, so this node's object store holds the bytes its budget
        counts and the cache outlives the peer. Keys being copied by another adopt are
        left to it; keys cached already are `present`. The ack says what entered (and was
        evicted for it); an object that cannot be read leaves its chunks `skipped`."""
        self._start()
        todo = [i for i, k in enumerate(keys) if k not in self._copying]
        mine = [keys[i] for i in todo]
        self._copying.update(mine)
        try:
            need = {i for i in todo if keys[i] not in self._store}
            objects = list({where[i][0]: None for i in need})
            try:
                values = dict(zip(objects, await asyncio.gather(*objects), strict=True))
                arrays = [values[where[i][0]][where[i][1]] if i in need else None for i in todo]
            except Exception as exc:
                logger.warning("reading %d peer chunks to copy them failed: %s", len(need), exc)
                return self._record(CPUAck(self._incarnation, skipped=[keys[i] for i in need]))
            del values
            return await self._keep(mine, [metas[i] for i in todo], arrays)
        finally:
            self._copying.difference_update(mine)
            self._cancelled.difference_update(mine)

    async def _keep(
        self, keys: list[CacheKey], metas: list[PayloadMeta], arrays: list[Any]
    ) -> CPUAck:
        """Cache `keys` from `arrays` (views of a peer's objects; None for a key that was
        cached when the copy began) in one object of ours, as far as there is room; the
        ack of what entered (and was evicted for it)."""
        store = self._store
        ack = CPUAck(self._incarnation)
        try:
            cancelled = self._cancelled
            new = [
                i
                for i, k in enumerate(keys)
                if k not in store and k not in cancelled and arrays[i] is not None
            ]
            if new:
                added = await self._admit(
                    ack,
                    [keys[i] for i in new],
                    [metas[i] for i in new],
                    sum(metas[i].nbytes for i in new),
                    arrays=[arrays[i] for i in new],
                )
                ack.accepted = list(added)
            del arrays
            ack.present = [k for k in keys if k in store and k not in ack.accepted]
            ack.refs = self._readable(keys)
        except Exception as exc:  # never lose the ack: it carries what was evicted for room
            logger.warning("copying %d chunks from a peer failed: %s", len(keys), exc)
            ack.skipped = [k for k in keys if k not in store]
        if ack.evicted:
            self._signal_room()
        return self._record(ack)

    async def _admit(
        self,
        ack: CPUAck,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        nbytes: int,
        *,
        own: Any = None,
        index: Any = None,
        arrays: list[Any] | None = None,
        lookup_id: str | None = None,
    ) -> dict[CacheKey, ChunkRef]:
        """Cache `keys` as one batch of `nbytes`, if there is room now: the object `own`
        as it is (chunk i at `index[i]`), or one new object of ours copied from `arrays`.
        What was evicted for it goes in `ack`; without room, or if the copy failed, the
        keys are skipped. The entries added."""
        store = self._store
        n, ack.evicted = await self._allocate([nbytes], wait=False)
        reason = None
        if n and arrays is not None:
            try:
                own, index = await put_own(arrays, nbytes), None
            except Exception as exc:  # served from the source's object, not cached
                store.release(nbytes)
                self._signal_room()
                n, reason = 0, f"copying from the source failed: {exc}"
        del arrays
        if n and self._cancelled and any(k in self._cancelled for k in keys):
            # removed (or the tier cleared) while the copy ran: not cached after all
            kept = [j for j, k in enumerate(keys) if k not in self._cancelled]
            index = kept if index is None else [index[j] for j in kept]
            keys, metas = [keys[j] for j in kept], [metas[j] for j in kept]
            if not keys:
                store.release(nbytes)
                self._signal_room()
                return {}
        if not n:
            self._skip(ack, keys, reason)
            return {}
        added = store.commit(
            own, keys, metas, index, batch_bytes=nbytes, reserved=nbytes, lookup_id=lookup_id
        )
        self._signal_room()  # the reservation ended: room a waiting put may take
        if added:
            metrics.inc("raykv_stored_bytes", nbytes, tier=TIER_CPU)
        return added

    # ----- control (one message each; the manager sends them without waiting) -----

    async def pin(
        self, lookup_id: str, keys: list[CacheKey], lease_secs: float | None = None
    ) -> int:
        self._start()
        return self._store.pin(lookup_id, keys, lease_secs)

    async def unpin(self, lookup_id: str) -> int:
        n = self._store.unpin(lookup_id)
        if n:
            self._signal_room()
        return n

    async def release(self, ends: list[tuple[str | None, list[CacheKey]]]) -> None:
        """Ends of requests, in order: drop each one's pins and apply its hits as one
        prefix-closed touch."""
        freed = False
        for lookup_id, touched in ends:
            if lookup_id is not None and self._store.unpin(lookup_id):
                freed = True
            if touched:
                self._store.touch(touched)
        if freed:
            self._signal_room()

    async def touch(self, keys: list[CacheKey]) -> None:
        self._store.touch(keys)

    async def chunk_refs(self, keys: list[CacheKey]) -> list[ChunkRef | None]:
        return self._store.chunk_refs(keys)

    async def contains(self, keys: list[CacheKey]) -> list[bool]:
        return [k in self._store for k in keys]

    async def snapshot(self) -> tuple[str, dict[CacheKey, ChunkRef], int]:
        """(incarnation, every cached key's ChunkRef, the last ack's number), for a manager
        rebuilding its index."""
        return self._incarnation, self._store.snapshot(), self._seq

    async def version(self) -> tuple[str, int]:
        """(incarnation, the last put/pull ack's number): the manager checks it applied them all."""
        return self._incarnation, self._seq

    async def remove(self, keys: list[CacheKey]) -> int:
        self._cancelled.update(k for k in keys if k in self._copying)
        n = self._store.remove(keys)
        if n:
            self._signal_room()
        return n

    async def keys(self) -> list[CacheKey]:
        return self._store.keys()

    async def clear(self) -> None:
        self._cancelled.update(self._copying)
        self._store.clear()
        self._signal_room()
        self._record(CPUAck(self._incarnation))

    async def stats(self) -> dict[str, Any]:
        out = self._store.stats()
        out["incarnation"] = self._incarnation
        out["object_store_bytes"] = self._object_store_bytes
        out["object_store_ok"] = self._object_store_ok
        return out

    async def incarnation(self) -> str:
        return self._incarnation
