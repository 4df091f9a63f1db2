"""What each replica's engine holds, from vLLM's KV events: the index a router scores by.

vLLM publishes its prefix cache as KV events (`kv_events_config`, ZMQ: one batch of
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` per engine step), and raykv's vLLM
connector adds the blocks raykv's CPU tier holds (ownership ``"raykv"``,
`raykv.integrations.vllm_events`). `BlockIndex` turns them into sets of the router's own
block ids: a chained hash of each full block's token ids (and its extra keys: LoRA,
multimodal inputs, `cache_salt`), which the router computes from a request's prompt in
the same way (`request_ids`). vLLM's block hashes serve only to find a block's parent.

Two kinds of holding:
* a replica's own blocks (vLLM's events, any ownership but raykv's) count for that
  replica only: its engine's pool holds them;
* raykv's blocks count for every replica sharing the namespace (`shared`): any of them
  can load a chunk from the tier, whichever engine stored it and advertised it.

A request whose blocks carry extra keys (a salted or LoRA prompt) never matches, since
the router does not know them: it underrates such a replica, it never overrates one.
Only whole blocks of the first KV cache group are indexed (full attention; a hybrid
model's other groups are skipped). Events lost beyond what the publisher can replay
leave the sets stale until the blocks are stored or removed again, and a block whose
parent was never seen is not indexed (`orphans`); each set is bounded (`max_blocks`,
least recently stored forgotten first).

`EventSubscriber` is the ZMQ side: per replica a SUB socket and, where the publisher has
one, a DEALER on its replay socket, read by one daemon thread that decodes vLLM's
`KVEventBatch` and applies it here. Ray-free; needs `pyzmq` and vLLM (for the event
types) only in that thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from raykv.errors import InvalidInputError
from raykv.keys import leading
from raykv.tiers.budget import BoundedKeySet

logger = logging.getLogger(__name__)

OWNERSHIP = "raykv"  # the ownership of the blocks raykv's connector advertises
ROOT = 0  # the parent id of a prompt's first block
DEFAULT_MAX_BLOCKS = 1 << 20  # per set, and of the engine-hash -> id map (~100 B each)


def freeze(value: Any) -> Any:
    """`value` hashable: lists (msgpack's arrays: a multimodal key's pairs) as tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((freeze(k), freeze(v)) for k, v in value.items()))
    return value


def chain(parent: int, tokens: Sequence[int], extra: Any = None) -> int:
    """The router's id of a full block: its parent's id, its token ids, its extra keys."""
    return hash((parent, tuple(tokens), extra))


class BlockIndex:
    """Per source (a replica), the router's ids of the blocks its engine and raykv hold.

    Thread-safe: a subscriber thread applies events while the router's loop scores.
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise InvalidInputError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.block_size: int | None = None  # learned from the first stored event
        self._lock = threading.Lock()
        # Per source: its engine's block hash -> id (engines hash apart: one shared map
        # of `max_blocks` forgot hashes whose ids its sets still held, and their removals).
        self._ids: dict[Hashable, OrderedDict[Hashable, int]] = {}
        self._local: dict[Hashable, BoundedKeySet] = {}
        self._shared: dict[Hashable, BoundedKeySet] = {}
        self.counts = {"stored": 0, "removed": 0, "cleared": 0, "orphans": 0, "foreign": 0}

    # ----- events -----

    def apply(self, source: Hashable, events: Iterable[Any]) -> None:
        """Apply one batch of `source`'s events (vLLM's event objects, in order)."""
        with self._lock:
            for event in events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    self._stored(source, event)
                elif kind == "BlockRemoved":
                    if getattr(event, "group_idx", None) not in (None, 0):
                        continue
                    known = self._ids.get(source, {})
                    ids = [known.get(h) for h in event.block_hashes]
                    held = self._set(source, event)
                    held.difference_update(i for i in ids if i is not None)
                    self._prune(source, zip(event.block_hashes, ids, strict=True))
                    self.counts["removed"] += len(ids)
                elif kind == "AllBlocksCleared":  # vLLM's pool reset (raykv never sends it)
                    self._local.pop(source, None)
                    self._prune(source, list(self._ids.get(source, {}).items()))
                    self.counts["cleared"] += 1

    def _prune(self, source: Hashable, pairs: Iterable[tuple[Hashable, int | None]]) -> None:
        """Forget the block hashes of `pairs` whose ids neither of `source`'s sets holds
        any more: a map holds about what its sets do, not every hash ever stored."""
        known = self._ids.get(source)
        if known is None:
            return
        sets = [s for s in (self._local.get(source), self._shared.get(source)) if s is not None]
        for block_hash, block_id in pairs:
            if block_id is not None and not any(block_id in s for s in sets):
                known.pop(block_hash, None)

    def _set(self, source: Hashable, event: Any) -> BoundedKeySet:
        sets = self._shared if getattr(event, "ownership", None) == OWNERSHIP else self._local
        held = sets.get(source)
        if held is None:
            held = sets[source] = BoundedKeySet(self.max_blocks)
        return held

    def _stored(self, source: Hashable, event: Any) -> None:
        size = event.block_size
        tokens = event.token_ids
        # Only whole blocks of the first KV cache group (full attention): vLLM leaves a
        # hybrid model's skipped blocks out of `block_hashes` but not out of `token_ids`,
        # and a partial block's event has fewer tokens than its blocks.
        if (
            getattr(event, "group_idx", None) not in (None, 0)
            or not size
            or len(tokens) != size * len(event.block_hashes)
            or (self.block_size is not None and size != self.block_size)
        ):
            self.counts["foreign"] += 1
            return
        self.block_size = size
        known = self._ids.get(source)
        if known is None:
            known = self._ids[source] = OrderedDict()
        parent = ROOT
        if event.parent_block_hash is not None:
            parent = known.get(event.parent_block_hash)
            if parent is None:  # its parent's event was missed: the chain is unknown
                self.counts["orphans"] += 1
                return
            known.move_to_end(event.parent_block_hash)  # a live prefix stays known
        extras = event.extra_keys or ()
        new = []
        for i, block_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            extra = extras[i] if i < len(extras) else None
            parent = chain(parent, block, freeze(extra) if extra else None)
            known[block_hash] = parent
            known.move_to_end(block_hash)
            new.append(parent)
        while len(known) > 2 * self.max_blocks:  # as many as its two sets hold
            known.popitem(last=False)
        self._set(source, event).update(new)
        self.counts["stored"] += len(new)

    def forget(self, source: Hashable) -> None:
        """Drop what `source` held (its replica died, or its endpoint changed)."""
        with self._lock:
            self._local.pop(source, None)
            self._shared.pop(source, None)
            self._ids.pop(source, None)
            if not (self._local or self._shared or self._ids):
                self.block_size = None  # the next replicas may run another block size

    # ----- scoring -----

    def request_ids(self, tokens: Sequence[int]) -> list[int]:
        """The ids of a prompt's full blocks ([] until an event told the block size)."""
        size = self.block_size
        if not size:
            return []
        ids, parent = [], ROOT
        for start in range(0, len(tokens) - size + 1, size):
            parent = chain(parent, tokens[start : start + size])
            ids.append(parent)
        return ids

    def matches(self, ids: Sequence[int], sources: Iterable[Hashable]) -> tuple[dict, int]:
        """({source: leading blocks of `ids` its engine holds}, leading blocks raykv holds)."""
        with self._lock:
            local = {s: leading(ids, 0, self._local[s]) if s in self._local else 0 for s in sources}
            shared = list(self._shared.values())
            held = leading(ids, 0, lambda i: any(i in s for s in shared)) if shared else 0
        return local, held

    def sizes(self) -> dict[str, int]:
        """Blocks held in all, vLLM's own and raykv's (for logs and tests)."""
        with self._lock:
            return {
                "local": sum(len(s) for s in self._local.values()),
                "shared": sum(len(s) for s in self._shared.values()),
            }


END_SEQ = -1  # vLLM's replay socket: the sequence number that ends a replay
REPLAY_WAIT_S = 5.0  # a replay not ended by then: go on with what arrived
MAX_HELD = 10_000  # batches published while a replay runs, applied after it


class _Feed:
    """One source's sockets and where its sequence of batches stands."""

    __slots__ = ("dealer", "endpoints", "held", "last", "replay_until", "source", "sub")

    def __init__(self, source: Hashable, endpoints: tuple[str, str | None]) -> None:
        self.source = source
        self.endpoints = endpoints
        self.sub: Any = None
        self.dealer: Any = None
        self.last: int | None = None  # the last sequence number applied
        self.held: list[tuple[int | None, Any]] = []
        self.replay_until = 0.0  # while a replay runs (monotonic deadline), else 0


class EventSubscriber:
    """Subscribes to each source's vLLM KV-event endpoint and feeds a `BlockIndex`.

    `watch({source: endpoint or (endpoint, replay endpoint)})` (any thread) says which
    publishers to read; the thread connects new ones, and closes (and forgets) those gone
    or changed. With a replay endpoint (vLLM's `replay_endpoint`, a ROUTER socket over
    the publisher's last batches) it first asks for every batch the publisher still
    holds, so a router that subscribes late (a restart, a new ingress replica) still
    learns the prefixes cached before it came; and a gap in the sequence numbers (lost
    batches) is asked for again. Batches published meanwhile wait, then apply in order;
    none applies twice. A batch it cannot decode or apply is counted and skipped.
    """

    POLL_MS = 100

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.counts = {
            "batches": 0,
            "replayed": 0,
            "undecodable": 0,
            "unapplied": 0,
            "gaps": 0,
            "refused": 0,
            "restarts": 0,
        }
        self._decoder: Any = None
        self._zmq: Any = None
        self._wanted: dict[Hashable, tuple[str, str | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-kv-events", daemon=True)
        self._thread.start()

    def watch(self, endpoints: Mapping[Hashable, str | tuple[str, str | None]]) -> None:
        wanted = {s: (e, None) if isinstance(e, str) else tuple(e) for s, e in endpoints.items()}
        with self._lock:
            self._wanted = wanted  # type: ignore[assignment]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        """Serve the feeds; after an unexpected error, forget what they said (a replica's
        sets would go stale for good, crediting it with blocks it evicted) and start over,
        backing off."""
        delay = 0.5
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._serve()
                return
            except ImportError as exc:  # no vLLM or zmq here: nothing to subscribe with
                logger.error("the KV-event subscriber cannot start (%r): routing by load", exc)
                return
            except Exception:  # a router must keep routing, by load meanwhile
                logger.exception("the KV-event subscriber failed; again in %.1f s", delay)
                with self._lock:
                    sources = list(self._wanted)
                for source in sources:
                    self.index.forget(source)
                self.counts["restarts"] += 1
            if time.monotonic() - started > 60.0:
                delay = 0.5  # it ran well for a while: a fresh failure backs off afresh
            self._stop.wait(delay)
            delay = min(2 * delay, 30.0)

    def _serve(self) -> None:
        # Imported here, not on the router's event loop (vLLM's module imports torch).
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        poller = zmq.Poller()
        feeds: dict[Hashable, _Feed] = {}
        sockets: dict[Any, tuple[_Feed, bool]] = {}  # socket -> (feed, is its replay)
        try:
            while not self._stop.is_set():
                with self._lock:
                    wanted = dict(self._wanted)
                for source in [s for s in feeds if wanted.get(s) != feeds[s].endpoints]:
                    feed = feeds.pop(source)
                    for sock in (feed.sub, feed.dealer):
                        if sock is not None:
                            poller.unregister(sock)
                            sockets.pop(sock, None)
                            sock.close(linger=0)
                    self.index.forget(source)
                for source, endpoints in wanted.items():
                    if source not in feeds:
                        feeds[source] = feed = self._open(ctx, source, endpoints)
                        for sock, replay in ((feed.sub, False), (feed.dealer, True)):
                            if sock is not None:
                                poller.register(sock, zmq.POLLIN)
                                sockets[sock] = (feed, replay)
                now = time.monotonic()
                for feed in feeds.values():
                    if feed.replay_until and now > feed.replay_until:
                        self._replayed(feed)  # the publisher did not answer in time
                for sock, _ in poller.poll(self.POLL_MS):
                    feed, replay = sockets[sock]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(feed, frames, replay)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _open(self, ctx: Any, source: Hashable, endpoints: tuple[str, str | None]) -> _Feed:
        zmq = self._zmq
        feed = _Feed(source, endpoints)
        endpoint, replay = endpoints
        try:
            feed.sub = ctx.socket(zmq.SUB)
            feed.sub.setsockopt(zmq.SUBSCRIBE, b"")
            feed.sub.connect(endpoint)
            if replay:
                feed.dealer = ctx.socket(zmq.DEALER)
                feed.dealer.connect(replay)
        except zmq.ZMQError as exc:  # a malformed endpoint: not again until it changes
            for sock in (feed.sub, feed.dealer):
                if sock is not None:
                    sock.close(linger=0)
            feed.sub = feed.dealer = None
            self.counts["refused"] += 1
            logger.warning("cannot subscribe to %r: %r", endpoints, exc)
            return feed
        logger.info("subscribed to the KV events of %s at %s", source, endpoint)
        self._ask_replay(feed, 0)
        return feed

    def _ask_replay(self, feed: _Feed, start: int) -> None:
        if feed.dealer is None or feed.replay_until:
            return
        feed.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        feed.replay_until = time.monotonic() + REPLAY_WAIT_S

    def _receive(self, feed: _Feed, frames: list[bytes], replay: bool) -> None:
        try:
            seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else None
            if replay and seq == END_SEQ:
                self._replayed(feed)
                return
            batch = self._decoder.decode(frames[-1])
        except Exception:
            self.counts["undecodable"] += 1
            return
        if replay:
            self.counts["replayed"] += 1
            self._apply(feed, seq, batch, replayed=True)
        elif feed.replay_until and len(feed.held) < MAX_HELD:
            feed.held.append((seq, batch))
        else:
            self._apply(feed, seq, batch)

    def _replayed(self, feed: _Feed) -> None:
        """The replay ended (or timed out): apply what was published meanwhile."""
        feed.replay_until = 0.0
        held, feed.held = feed.held, []
        for seq, batch in held:
            self._apply(feed, seq, batch, replayed=True)

    def _apply(self, feed: _Feed, seq: int | None, batch: Any, replayed: bool = False) -> None:
        if seq is not None and feed.last is not None:
            if seq <= feed.last:  # replayed and published both: applied once
                return
            if seq > feed.last + 1 and not replayed:  # lost batches: ask for them again
                self.counts["gaps"] += 1
                if feed.dealer is not None:
                    self._ask_replay(feed, feed.last + 1)
                    feed.held.append((seq, batch))
                    return
        if seq is not None:
            feed.last = seq
        self.counts["batches"] += 1
        try:
            self.index.apply(feed.source, batch.events)
        except Exception:  # an event this index cannot read: skip it, keep the rest
            self.counts["unapplied"] += 1
            logger.debug("a KV event batch of %s was not applied", feed.source, exc_info=True)


__all__ = ["OWNERSHIP", "BlockIndex", "EventSubscriber", "chain", "freeze"]
