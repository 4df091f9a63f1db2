"""Page connector: copies whole engine pages (KV blocks) between an engine's per-layer
caches and `PAGES` chunk payloads (what raykv's vLLM connector moves). Exact for any
attention backend, since only whole blocks move.

On CUDA the batched calls never make the engine's thread wait for the device:

* `load_batch`: a request's chunks are packed layer-major into pinned host slabs
  (torch's caching host allocator: pinned once, reused once its copies are done), each
  sent to the device while the next is packed, and scattered into the blocks there
  through a device buffer of at most `LOAD_DEVICE_BYTES` (a load of a long prefix takes
  no device memory of its own size beside vLLM's pool); the returned event says when
  the blocks hold them (a loader thread waits on it, a synchronous load makes the
  compute stream wait on it). A load starts on the device only after the compute work
  queued when it was asked for (a block vLLM hands a load may still be read, written
  or zeroed by kernels of earlier steps). Async loads run on one load stream, in-step
  loads on their own, so a forward never waits behind another request's async copy.
  A load that fails part-way leaves nothing writing behind the caller's back.
* `save_batch`: a save stream waits for the compute stream's work so far and gathers
  the step's blocks on the device; a copy stream then copies them into the caller's
  pinned buffers. The compute stream waits only for the gather (the blocks may be
  reused in the next step), never for a copy out, and the returned event says when the
  host bytes are there (the saver thread waits on it before it hands them to the cache).

The streams' buffers stay in torch's caching allocator, per stream, outside vLLM's
memory profile: about `LOAD_DEVICE_BYTES` + `LOAD_SLAB_BYTES` for each load stream and
the largest step's save (its gathered blocks) for the save stream.

Written against torch's CUDA API and unit-tested where a CUDA device is present
(tests/unit/test_page_connector.py); on CPU both run the plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raykv.errors import InvalidInputError
from raykv.payload import LAYOUT_PAGES, PayloadMeta, buffer_to_tensor

# (payload buffer, its meta, block ids to fill, first payload block): one `load` call.
LoadPart = tuple[Any, PayloadMeta, Sequence[int], int]
# A CUDA load packs its parts into pinned slabs of about this size, each sent to the
# device as soon as it is packed, so packing and the bus overlap.
LOAD_SLAB_BYTES = 64 << 20
# ... into a device buffer of at most this size, scattered into the blocks once full: a
# long prefix's load (4 GiB for 32k tokens of Llama-3-8B) takes no device memory of its
# own size beside vLLM's pool, and a round costs one scatter launch per layer.
LOAD_DEVICE_BYTES = 256 << 20


def _slabs(parts: list[tuple[Any, torch.Tensor]], blocks: int) -> list[list[Any]]:
    """`parts` (source, block index) in order, grouped into runs of about `blocks` blocks
    (at least one part each)."""
    out: list[list[Any]] = [[]]
    size = 0
    for part in parts:
        if out[-1] and size + len(part[1]) > blocks:
            out.append([])
            size = 0
        out[-1].append(part)
        size += len(part[1])
    return out


class DoneEvent:
    """The event of a copy that finished before it was returned (CPU caches)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE = DoneEvent()


class PageConnector:
    """Copies whole engine pages (KV blocks) between per-layer caches and `PAGES` payloads.

    Every layer's cache is a tensor whose first dim is the block index (vLLM >= 0.26
    keeps per layer a `[num_blocks, ...]` view, strided or not). A payload holds the
    blocks of one chunk for all layers, `[num_layers, num_blocks, *block]`, as raw bytes
    in host memory. Only whole blocks move, so a copy is exact whatever the block
    interior is (vLLM's CPU backend keeps K transposed and packed per instruction set).
    The same code runs on CUDA caches: gathers and scatters run on the device, with one
    host <-> device copy per chunk.
    """

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        layers = list(layers)
        if not layers or not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in layers):
            raise InvalidInputError(
                "layers must be a non-empty list of KV cache tensors [num_blocks, ...]"
            )
        first = layers[0]
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise InvalidInputError(
                    f"layer {i} is {t.dtype}{list(t.shape)} on {t.device}; every layer must "
                    f"match layer 0: {first.dtype}{list(first.shape)} on {first.device}"
                )
        self.layers = layers
        self.num_blocks = int(first.shape[0])
        self.block_shape = tuple(int(d) for d in first.shape[1:])
        self.dtype = first.dtype
        self.dtype_name = str(first.dtype).removeprefix("torch.")
        self.device = first.device
        # Bytes of one block across every layer (what a payload holds per block).
        self.block_nbytes = len(layers) * first[0].numel() * first.element_size()
        self.batched = self.device.type == "cuda"  # load_batch/save_batch use streams
        # On CPU: each layer as numpy rows [num_blocks, block bytes], where its strides
        # allow (None: copies go through torch).
        views = [self._rows_view(t) for t in layers] if self.device.type == "cpu" else []
        self._views: list[np.ndarray] | None = None
        if views and all(v is not None for v in views):
            self._views = views
        if self.batched:
            self._load_stream = torch.cuda.Stream(self.device)  # async loads
            self._step_stream = torch.cuda.Stream(self.device)  # in-step loads
            self._save_stream = torch.cuda.Stream(self.device)  # saves' gathers
            self._copy_stream = torch.cuda.Stream(self.device)  # saves' device->host copies

    def meta(self, num_blocks: int) -> PayloadMeta:
        """The metadata of a payload of `num_blocks` blocks of every layer."""
        return PayloadMeta(
            self.dtype_name, (len(self.layers), num_blocks, *self.block_shape), LAYOUT_PAGES
        )

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        try:
            idx = torch.as_tensor(list(block_ids))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidInputError(f"block_ids must be a list of ints: {exc}") from None
        if idx.dim() != 1 or idx.numel() == 0:
            raise InvalidInputError(f"block_ids must be a non-empty list of ints: {block_ids!r}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise InvalidInputError(f"block_ids must be ints, got {idx.dtype}")
        idx = idx.long()
        if int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks:
            raise InvalidInputError(
                f"block ids must lie in [0, {self.num_blocks}), "
                f"got {int(idx.min())}..{int(idx.max())}"
            )
        return idx  # on the host: checked without touching the device

    def save(
        self, block_ids: Sequence[int], out: np.ndarray | None = None
    ) -> tuple[np.ndarray, PayloadMeta]:
        """A host payload holding `block_ids` of every layer, written into `out` (a flat
        uint8 array of the payload's size, e.g. a reused warm buffer) or a new array. The
        caller may reuse the blocks as soon as this returns."""
        idx = self._index(block_ids)
        meta = self.meta(len(idx))
        if out is None:
            buf = np.empty(meta.nbytes, dtype=np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 1 or out.nbytes != meta.nbytes:
            raise InvalidInputError(f"out must be a flat uint8 array of {meta.nbytes} bytes")
        else:
            buf = out
        self._gather(idx, torch.from_numpy(buf).view(self.dtype).reshape(meta.shape))
        return buf, meta

    def save_chunks(
        self, block_ids: Sequence[int], sizes: Sequence[int], outs: Sequence[np.ndarray]
    ) -> list[PayloadMeta]:
        """`save` of consecutive runs of `block_ids` (`sizes[i]` blocks each) into `outs`:
        the ids are checked and turned into a tensor once for the lot (a step's save of
        many chunks pays that per step, not per chunk)."""
        idx = self._index(block_ids)
        if sum(sizes) != len(idx) or len(sizes) != len(outs):
            raise InvalidInputError(
                f"sizes {list(sizes)} must split the {len(idx)} block ids, one out per size"
            )
        metas, at = [], 0
        for n, out in zip(sizes, outs, strict=True):
            meta = self.meta(n)
            if out.dtype != np.uint8 or out.ndim != 1 or out.nbytes != meta.nbytes:
                raise InvalidInputError(f"out must be a flat uint8 array of {meta.nbytes} bytes")
            self._gather(
                idx[at : at + n], torch.from_numpy(out).view(self.dtype).reshape(meta.shape)
            )
            metas.append(meta)
            at += n
        return metas

    @staticmethod
    def _rows_view(layer: torch.Tensor) -> np.ndarray | None:
        """`layer` as a writable numpy view `[num_blocks, block bytes]`, or None where
        its strides allow no such view (a block's bytes are not contiguous)."""
        try:
            return layer.view(torch.uint8).numpy().reshape(layer.shape[0], -1, copy=False)
        except (RuntimeError, ValueError, TypeError):
            return None

    def _gather(self, idx: torch.Tensor, host: torch.Tensor) -> None:
        """Copy blocks `idx` of every layer into `host` ([num_layers, len(idx), *block])."""
        if self.device.type == "cpu":
            # numpy's copy runs on the calling thread alone (as `load`'s): a save thread
            # copying beside the forward pass starts no second OpenMP team to fight it.
            if self._views is None:
                for i, layer in enumerate(self.layers):
                    torch.index_select(layer, 0, idx, out=host[i])
                return
            rows = idx.numpy()
            for i, view in enumerate(self._views):
                out = host[i].view(torch.uint8).numpy().reshape(len(rows), -1)
                np.take(view, rows, axis=0, out=out, mode="clip")  # ids checked: no clipping
        else:  # blocking, on the current stream: `save_batch` is the engine's path
            idx = idx.to(self.device)
            host.copy_(torch.stack([layer.index_select(0, idx) for layer in self.layers]))

    def save_batch(
        self, block_ids: Sequence[int], sizes: Sequence[int], outs: Sequence[np.ndarray]
    ) -> tuple[list[PayloadMeta], Any]:
        """`save_chunks` that does not wait for the device: the metas, and an event that is
        done once `outs` hold the bytes (on CPU, at once). On CUDA `outs` should be pinned
        host memory (else the device->host copy is synchronous); the blocks may be
        reused by the compute stream's next work as soon as this returns."""
        if not self.batched:
            return self.save_chunks(block_ids, sizes, outs), DONE
        idx = self._index(block_ids)
        if sum(sizes) != len(idx) or len(sizes) != len(outs):
            raise InvalidInputError(
                f"sizes {list(sizes)} must split the {len(idx)} block ids, one out per size"
            )
        metas = [self.meta(n) for n in sizes]
        for meta, out in zip(metas, outs, strict=True):
            if out.dtype != np.uint8 or out.ndim != 1 or out.nbytes != meta.nbytes:
                raise InvalidInputError(f"out must be a flat uint8 array of {meta.nbytes} bytes")
        compute, stream = torch.cuda.current_stream(self.device), self._save_stream
        stream.wait_stream(compute)  # the forward that wrote these blocks comes first
        with torch.cuda.stream(stream):
            didx = idx.pin_memory().to(self.device, non_blocking=True)
            shape = (len(self.layers), len(idx), *self.block_shape)
            gathered = torch.empty(shape, dtype=self.dtype, device=self.device)
            for i, layer in enumerate(self.layers):
                torch.index_select(layer, 0, didx, out=gathered[i])
            gathered_event = stream.record_event()
        # The copies out run on a stream of their own: the next step's gather (which the
        # compute stream waits for) never queues behind this step's copies.
        copy = self._copy_stream
        copy.wait_event(gathered_event)
        gathered.record_stream(copy)  # not reused by the next gather until copied out
        with torch.cuda.stream(copy):
            at = 0
            for n, meta, out in zip(sizes, metas, outs, strict=True):
                host = torch.from_numpy(out).view(self.dtype).reshape(meta.shape)
                host.copy_(gathered[:, at : at + n], non_blocking=True)
                at += n
            copied = copy.record_event()
        compute.wait_event(gathered_event)  # later kernels may overwrite the blocks after it
        return metas, copied

    def load_batch(self, parts: Sequence[LoadPart], after: Any = None) -> Any:
        """`load` of several payloads: an event that is done once the blocks hold them (on
        CPU, at once: `load_many`). On CUDA the parts go through
        pinned slabs of `LOAD_SLAB_BYTES` (the host packs one while the last crosses the
        bus), scattered into the blocks on the device in rounds of `LOAD_DEVICE_BYTES`;
        before the blocks are read,
        wait for the event (`event.synchronize()` on a loader thread, or
        `wait_on_compute(event)` before a forward pass).

        `after` is `compute_event()` recorded on the engine's thread when an async load
        was asked for: the copies run on the load stream once the device got there. None
        is an in-step load for the calling thread's next forward: the copies run on their
        own stream after the work queued on the current stream so far."""
        if not self.batched:
            self.load_many(parts)
            return DONE
        checked = [
            self._checked(buf, meta, block_ids, first) for buf, meta, block_ids, first in parts
        ]
        if not checked:
            return DONE
        # A loader thread starts on device 0: its pinned buffers and copies belong to ours.
        with torch.cuda.device(self.device):
            if after is None:
                stream = self._step_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
            else:
                stream = self._load_stream
                stream.wait_event(after)
            try:
                return self._load_on_device(checked, stream, ahead=after is not None)
            except BaseException:
                # Rounds already queued still write blocks: nothing may read or reuse them
                # before that (the caller reports the load failed once this returns).
                torch.cuda.current_stream(self.device).wait_stream(stream)
                if after is not None:  # a loader thread: its caller may free the blocks
                    stream.synchronize()
                raise

    def compute_event(self) -> Any:
        """An event after the work queued on the calling thread's current stream: what an
        async load asked for now must follow on the device (see `load_batch`)."""
        if not self.batched:
            return DONE
        return torch.cuda.current_stream(self.device).record_event()

    def _load_on_device(
        self, checked: list[tuple[torch.Tensor, torch.Tensor]], stream: Any, ahead: bool
    ) -> Any:
        """The rounds of `load_batch` on `stream`. With `ahead` (a loader thread, which
        may wait), the host packs at most two slabs ahead of the copies: a load waiting
        for the compute stream would otherwise pin a new staging buffer for every slab
        (the caching host allocator reuses one only once its copy ran)."""
        num_layers = len(self.layers)
        row = self.block_nbytes // num_layers
        copies: list[Any] = []  # the events of the slabs' copies, while `ahead`
        # Rounds of up to LOAD_DEVICE_BYTES through one device buffer, each in slabs: the
        # host packs slab k+1 into pinned memory while slab k crosses the bus. A round's
        # buffer is freed to `stream` once scattered and the next round's reuses it (the
        # caching allocator orders reuse on one stream).
        for rnd in _slabs(checked, LOAD_DEVICE_BYTES // self.block_nbytes):
            total = sum(len(idx) for _src, idx in rnd)
            ids = torch.cat([idx for _src, idx in rnd]).pin_memory()
            with torch.cuda.stream(stream):
                dev = torch.empty((num_layers, total, row), dtype=torch.uint8, device=self.device)
                didx = ids.to(self.device, non_blocking=True)
            at = 0
            for group in _slabs(rnd, LOAD_SLAB_BYTES // self.block_nbytes):
                n = sum(len(idx) for _src, idx in group)
                if len(copies) >= 2:
                    copies.pop(0).synchronize()
                staging = torch.empty((num_layers, n, row), dtype=torch.uint8, pin_memory=True)
                k = 0
                for src, idx in group:
                    m = len(idx)
                    part = src.contiguous().view(torch.uint8).reshape(-1, m, row)
                    staging[:, k : k + m].copy_(part)
                    k += m
                with torch.cuda.stream(stream):  # the caching host allocator keeps
                    dev[:, at : at + n].copy_(staging, non_blocking=True)  # `staging` until
                    if ahead:  # this copy ran
                        copies.append(stream.record_event())
                at += n
            with torch.cuda.stream(stream):
                for i, layer in enumerate(self.layers):
                    pages = dev[i].view(self.dtype).reshape(total, *self.block_shape)
                    layer.index_copy_(0, didx, pages)
            del dev, didx, pages  # (`pages` views `dev`)
        return stream.record_event()

    def wait_on_compute(self, event: Any) -> None:
        """Make the compute stream wait for `event` (a synchronous load before a forward
        pass), without making the host wait."""
        if self.batched:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _checked(
        self, buf: Any, meta: PayloadMeta, block_ids: Sequence[int], first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A load part checked: its source blocks [num_layers, n, *block] on the host and
        the (host) index of the blocks they fill."""
        idx = self._index(block_ids)
        if (
            meta.layout != LAYOUT_PAGES
            or meta.dtype != self.dtype_name
            or meta.shape[0] != len(self.layers)
            or tuple(meta.shape[2:]) != self.block_shape
        ):
            raise InvalidInputError(
                f"payload {meta} does not fit this cache: {self.meta(len(idx))}"
            )
        if first < 0 or first + len(idx) > meta.shape[1]:
            raise InvalidInputError(
                f"payload blocks {first}..{first + len(idx)} out of range: it has {meta.shape[1]}"
            )
        return buffer_to_tensor(buf, meta)[:, first : first + len(idx)], idx

    def load(self, buf: Any, meta: PayloadMeta, block_ids: Sequence[int], first: int = 0) -> None:
        """Copy payload blocks `first, first + 1, ...` into `block_ids` of every layer."""
        self.load_many([(buf, meta, block_ids, first)])

    def load_many(self, parts: Sequence[LoadPart]) -> None:
        """`load` of several parts, each checked before any is written.

        On CPU the copies are numpy's: they run on the calling thread alone (a loader
        thread copying beside the forward pass starts no second OpenMP team to fight
        it), and each releases the GIL while it copies. Parts of one shape whose sources
        lie one stride apart in memory (the chunks of one stored batch) go into each
        layer in one copy: a loader thread beside the forward pass then waits for the
        GIL once a layer per run of parts, not once a layer per part (most of such a
        thread's copy time was that wait: docs/BENCHMARKS.md)."""
        checked = [self._checked(buf, meta, ids, first) for buf, meta, ids, first in parts]
        views = self._views
        if views is None:
            for src, idx in checked:
                if self.device.type != "cpu":
                    src, idx = src.to(self.device), idx.to(self.device)
                for i, layer in enumerate(self.layers):
                    layer.index_copy_(0, idx, src[i])
            return
        arrays = [src.view(torch.uint8).numpy().reshape(*src.shape[:2], -1) for src, _ in checked]
        rows = [idx.numpy() for _, idx in checked]
        for a, b in _strided_runs(arrays):
            if b - a == 1:
                src, dst_rows = arrays[a], rows[a]
            else:  # [layers, parts, blocks, bytes] over the parts' own memory, no copy
                first = arrays[a]
                step = arrays[a + 1].ctypes.data - first.ctypes.data
                shape = (first.shape[0], b - a, *first.shape[1:])
                strides = (first.strides[0], step, *first.strides[1:])
                src = np.lib.stride_tricks.as_strided(first, shape, strides, writeable=False)
                dst_rows = np.stack(rows[a:b])
            for i, view in enumerate(views):
                view[dst_rows] = src[i]


def _strided_runs(arrays: list[np.ndarray]) -> list[tuple[int, int]]:
    """[a, b) runs of `arrays` (each [layers, blocks, bytes]) of one shape and strides whose
    data pointers step by one constant: each run reads as one strided array."""
    runs: list[tuple[int, int]] = []
    a = 0
    while a < len(arrays):
        first, b = arrays[a], a + 1
        if b < len(arrays) and _alike(first, arrays[b]):
            step = arrays[b].ctypes.data - first.ctypes.data
            while b < len(arrays) and _alike(first, arrays[b]):
                if arrays[b].ctypes.data - arrays[b - 1].ctypes.data != step:
                    break
                b += 1
        runs.append((a, b))
        a = b
    return runs


def _alike(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and x.strides == y.strides


__all__ = ["DONE", "LoadPart", "PageConnector"]
