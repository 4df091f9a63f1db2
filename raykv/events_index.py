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
Events lost (a subscriber that joined late, a publisher's dropped messages) leave the
sets stale until the blocks are stored or removed again; each set is bounded
(`max_blocks`, least recently stored forgotten first).

`EventSubscriber` is the ZMQ side: one SUB socket per replica's endpoint, read by one
daemon thread that decodes vLLM's `KVEventBatch` and applies it here. Ray-free; needs
`pyzmq` and vLLM (for the event types) only when a subscriber starts.
"""

from __future__ import annotations

import logging
import threading
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
        self._ids: OrderedDict[Hashable, int] = OrderedDict()  # engine block hash -> id
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
                    ids = [self._ids.get(h) for h in event.block_hashes]
                    held = self._set(source, event)
                    held.difference_update(i for i in ids if i is not None)
                    self.counts["removed"] += len(ids)
                elif kind == "AllBlocksCleared":  # vLLM's pool reset (raykv never sends it)
                    self._local.pop(source, None)
                    self.counts["cleared"] += 1

    def _set(self, source: Hashable, event: Any) -> BoundedKeySet:
        sets = self._shared if getattr(event, "ownership", None) == OWNERSHIP else self._local
        held = sets.get(source)
        if held is None:
            held = sets[source] = BoundedKeySet(self.max_blocks)
        return held

    def _stored(self, source: Hashable, event: Any) -> None:
        size = event.block_size
        if self.block_size is None:
            self.block_size = size
        if size != self.block_size:  # another geometry: not comparable with requests
            self.counts["foreign"] += 1
            return
        parent = ROOT
        if event.parent_block_hash is not None:
            parent = self._ids.get(event.parent_block_hash)
            if parent is None:  # its parent's event was missed: the chain is unknown
                self.counts["orphans"] += 1
                return
        extras = event.extra_keys or ()
        tokens = event.token_ids
        new = []
        for i, block_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                break
            extra = extras[i] if i < len(extras) else None
            parent = chain(parent, block, tuple(extra) if extra else None)
            self._ids[block_hash] = parent
            self._ids.move_to_end(block_hash)
            new.append(parent)
        while len(self._ids) > self.max_blocks:
            self._ids.popitem(last=False)
        self._set(source, event).update(new)
        self.counts["stored"] += len(new)

    def forget(self, source: Hashable) -> None:
        """Drop what `source` held (its replica died, or its endpoint changed)."""
        with self._lock:
            self._local.pop(source, None)
            self._shared.pop(source, None)

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


class EventSubscriber:
    """Subscribes to each source's vLLM KV-event endpoint and feeds a `BlockIndex`.

    `watch({source: endpoint})` (any thread) says which endpoints to read; the thread
    connects new ones, and closes (and forgets) those gone or changed. A batch it
    cannot decode is counted and skipped; a gap in a publisher's sequence numbers (lost
    events) is counted.
    """

    POLL_MS = 100

    def __init__(self, index: BlockIndex) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.index = index
        self.counts = {"batches": 0, "undecodable": 0, "gaps": 0}
        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._wanted: dict[Hashable, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-kv-events", daemon=True)
        self._thread.start()

    def watch(self, endpoints: Mapping[Hashable, str]) -> None:
        with self._lock:
            self._wanted = dict(endpoints)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context.instance()
        poller = zmq.Poller()
        sockets: dict[Hashable, tuple[str, Any]] = {}
        sources: dict[Any, Hashable] = {}
        last_seq: dict[Hashable, int] = {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    wanted = dict(self._wanted)
                for source in [s for s in sockets if wanted.get(s) != sockets[s][0]]:
                    _, sock = sockets.pop(source)
                    poller.unregister(sock)
                    sources.pop(sock, None)
                    sock.close(linger=0)
                    last_seq.pop(source, None)
                    self.index.forget(source)
                for source, endpoint in wanted.items():
                    if source not in sockets:
                        sock = ctx.socket(zmq.SUB)
                        sock.setsockopt(zmq.SUBSCRIBE, b"")
                        sock.connect(endpoint)
                        poller.register(sock, zmq.POLLIN)
                        sockets[source] = (endpoint, sock)
                        sources[sock] = source
                for sock, _ in poller.poll(self.POLL_MS):
                    source = sources[sock]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(source, frames, last_seq)
        except Exception:  # a router must keep routing: scoring by stale sets is safe
            logger.exception("the KV-event subscriber stopped")
        finally:
            for _, sock in sockets.values():
                sock.close(linger=0)

    def _handle(self, source: Hashable, frames: list[bytes], last_seq: dict) -> None:
        try:
            seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else None
            batch = self._decoder.decode(frames[-1])
        except Exception:
            self.counts["undecodable"] += 1
            return
        previous = last_seq.get(source)
        if source not in last_seq:
            logger.info("KV events arriving from %s", source)
        elif seq is not None and previous is not None and seq != previous + 1:
            self.counts["gaps"] += 1
        last_seq[source] = seq
        self.counts["batches"] += 1
        self.index.apply(source, batch.events)


__all__ = ["OWNERSHIP", "BlockIndex", "EventSubscriber", "chain"]
