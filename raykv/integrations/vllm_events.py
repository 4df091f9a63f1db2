"""raykv's KV cache events for vLLM's event publisher (`RayKVConnector.take_events`).

vLLM publishes what its prefix cache holds as KV events (`kv_events_config`: ZMQ, one
`KVEventBatch` per step), and KV-aware routers score replicas by them. raykv holds more
than an engine's pool; with events on, the connector reports it beside vLLM's own:

* `BlockStored` (medium "CPU", ownership "raykv", group 0) once raykv's CPU tier has
  admitted a chunk this engine stored: the chunk's vLLM blocks (block hashes, parent,
  token ids, LoRA), as vLLM reports its own blocks (medium "GPU"). A chunk is reported
  only when the manager says the CPU tier took it, so a dropped or refused save is never
  advertised.
* `BlockRemoved` (same medium and ownership) once it left the CPU tier: evicted,
  removed, or lost with a CPU store (when the manager's log cannot say what changed, the
  connector compares what it reported with the CPU tier's keys, `KVCache.cpu_keys`).
  Chunks only a lower tier (disk, remote) holds are not advertised: they load slower,
  and a router that counted them as cached would overrate the replica. Nor are prompts'
  partial last chunks (`save_unfull_chunk`): their blocks are also in the whole chunk
  stored later, and removing one would name blocks the other still holds.

Who advertises a shared chunk: only the engine that stored it (only it knows its blocks'
token ids and parents). Every replica of the namespace can load it, so a router reading
the events should count raykv's blocks (ownership "raykv") as held by every replica that
shares the namespace, not only by the publisher.

How: the scheduler records each planned save's chunks with their event (`planned`); a
thread polls the manager (`KVCache.cpu_events`, every `POLL_S`) for the CPU tier's
admissions and evictions of this engine's keys and turns them into events, which vLLM
publishes with its next step (an engine publishes only when it steps: an idle engine's
evictions wait for its next request). Events trail the tier by up to `POLL_S` + a step.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from raykv.events_index import OWNERSHIP

logger = logging.getLogger(__name__)

POLL_S = 0.5
# Planned saves not yet admitted (each holds its chunk's token ids: ~10 KiB at 256
# tokens), and admitted chunks whose blocks a BlockRemoved must name. Past these, the
# oldest planned are forgotten (a save the tier refused is never admitted) and the
# oldest admitted reported removed (a router then underrates, never overrates).
MAX_PLANNED = 4096
MAX_HELD = 65536


class KVEvents:
    """The connector's KV events: `planned` on the scheduler thread, `take` each step."""

    def __init__(
        self,
        kv: Any,
        identity: tuple[str, int, int, str],
        block_size: int,
        chunk_size: int,
        *,
        poll_s: float = POLL_S,
        max_planned: int = MAX_PLANNED,
        max_held: int = MAX_HELD,
    ) -> None:
        self._kv = kv
        self._identity = identity  # of this engine's rank-0 keys (`CacheKey.identity`)
        self._block = block_size
        self._chunk = chunk_size
        self._poll_s = poll_s
        self._max_planned = max_planned
        self._max_held = max_held
        self._lock = threading.Lock()
        self._planned: OrderedDict[str, BlockStored] = OrderedDict()  # chunk hash -> event
        self._held: OrderedDict[str, list[Any]] = OrderedDict()  # chunk hash -> block hashes
        self._out: list[KVCacheEvent] = []
        self._cursor: tuple[str, int, int] | None = None
        self._stop = threading.Event()
        self._poll()  # the starting cursor, before any save is planned
        self._thread = threading.Thread(target=self._run, name="raykv-kv-events", daemon=True)
        self._thread.start()

    def _extra_keys(self, request: Any, first: int, n: int) -> list | None:
        """The extra keys (LoRA, multimodal, cache salt, prompt embeds) of blocks
        [first, first + n) of `request`, as vLLM's own events carry them: a router
        indexing blocks by their tokens and extras names raykv's blocks as vLLM's."""
        try:
            from vllm.v1.core.kv_cache_utils import (
                generate_block_hash_extra_keys,
                to_event_extra_keys,
            )

            keys, mm = [], 0
            for b in range(first, first + n):
                start = b * self._block
                extra, mm = generate_block_hash_extra_keys(request, start, start + self._block, mm)
                keys.append(extra)
            return to_event_extra_keys(keys)
        except Exception:  # a vLLM without them, or a request it cannot read: none
            return None

    def planned(self, request: Any, keys: list[str], start: int) -> None:
        """Chunks of `request` from token `start` on are being saved; `keys[i]` is the
        chunk hash of chunk i's rank-0 key. Scheduler thread."""
        per = self._chunk // self._block
        blocks = request.block_hashes
        lora = request.lora_request
        events = []
        for i, key in enumerate(keys):
            first = start + i * self._chunk
            b = first // self._block
            events.append(
                (
                    key,
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(h) for h in blocks[b : b + per]],
                        parent_block_hash=maybe_convert_block_hash(blocks[b - 1]) if b else None,
                        token_ids=list(request.all_token_ids[first : first + self._chunk]),
                        block_size=self._block,
                        lora_id=lora.adapter_id if lora else None,
                        medium=MEDIUM_CPU,
                        lora_name=lora.name if lora else None,
                        extra_keys=self._extra_keys(request, b, per),
                        group_idx=0,
                        ownership=OWNERSHIP,
                    ),
                )
            )
        with self._lock:
            for key, event in events:
                self._planned[key] = event
                self._planned.move_to_end(key)
            while len(self._planned) > self._max_planned:
                self._planned.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (vLLM publishes them with its step's)."""
        with self._lock:
            out, self._out = self._out, []
        return out

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._poll()
            except Exception:  # a malformed reply (another version's manager): the
                logger.exception("raykv KV events: a poll failed")  # thread goes on

    def _poll(self) -> None:
        try:
            reply = self._kv.cpu_events(self._cursor, self._identity)
        except Exception as exc:  # a closed or broken client: try again next time
            logger.debug("raykv KV events: polling the manager failed: %r", exc)
            return
        if reply is None:  # a fault (logged by the client): try again next time
            return
        cursor, changes = reply
        with self._lock:
            planned = bool(self._planned)
        if changes is None and (self._cursor is not None or planned):
            # A loss, or a first answer after saves were planned (the first polls
            # failed): compare with what the tier holds instead of starting blind.
            self._resync(cursor)
            return
        with self._lock:
            self._cursor = tuple(cursor)
            if changes is None:  # the first poll: nothing reported or planned yet
                return
            for admitted, key in changes:
                if admitted:
                    self._admitted(key)
                else:
                    self._removed([key])
            self._trim()

    def _resync(self, cursor: Any) -> None:
        """The log cannot say what changed (a CPU store restarted, the ring overflowed):
        compare what was reported and planned with what the CPU tier holds now, taken
        after `cursor`, so events that follow it apply on top. Admissions the log never
        recorded (a chunk stored while the tier's index was rebuilt) are reported too.
        If the keys cannot be read, nothing changes and the next poll tries again (as
        after a failed poll): reporting all removed would never advertise them again."""
        try:
            present = self._kv.cpu_keys(self._identity)
        except Exception as exc:
            logger.debug("raykv KV events: reading the CPU tier's keys failed: %r", exc)
            present = None
        if present is None:
            return
        with self._lock:
            self._cursor = tuple(cursor)
            held = set(present)
            self._removed([k for k in self._held if k not in held])
            for key in [k for k in self._planned if k in held]:
                self._admitted(key)
            self._trim()

    def _trim(self) -> None:
        """Past `max_held`, report the oldest held chunks removed (under the lock)."""
        if len(self._held) > self._max_held:
            self._removed(list(self._held)[: len(self._held) - self._max_held])

    def _admitted(self, key: str) -> None:
        """Report a planned chunk the CPU tier took (under the lock)."""
        event = self._planned.pop(key, None)
        if event is not None:
            self._out.append(event)
            self._held[key] = event.block_hashes
            self._held.move_to_end(key)

    def _removed(self, keys: list[str]) -> None:
        """Report the blocks of the held chunks among `keys` removed (under the lock)."""
        blocks = [b for k in keys for b in self._held.pop(k, ())]
        if blocks:
            self._out.append(
                BlockRemoved(
                    block_hashes=blocks, medium=MEDIUM_CPU, group_idx=0, ownership=OWNERSHIP
                )
            )


__all__ = ["MAX_HELD", "MAX_PLANNED", "OWNERSHIP", "POLL_S", "KVEvents"]
