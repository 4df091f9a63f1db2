"""GPU connector: copies KV between an engine's KV buffers and `KV_2LTD` chunk payloads.

A payload is one chunk of KV for all layers, `[2 (K,V), num_layers, num_tokens,
num_kv_heads * head_dim]`, in host memory (see `raykv.payload`). The engine keeps
its KV in per-layer buffers, in one of three layouts:

- ``paged``: `[2, num_blocks, block_size, num_kv_heads, head_dim]` per layer (the
  classic flash-attention paged layout, as in the demo GPU worker), addressed by a slot
  mapping: token i of the request lives in slot `slot_mapping[i] = block_id *
  block_size + offset`. vLLM (>= 0.26) keeps other per-backend layouts; its connector
  uses `PageConnector`, which copies whole blocks whatever is inside them.
- ``contiguous``: `[2, capacity, num_kv_heads, head_dim]` per layer; token i lives in
  row i (or in row `slot_mapping[i]` when a slot mapping is given).
- ``hf``: a `(keys, values)` pair per layer, each `[1, num_kv_heads, seq_len, head_dim]`
  (Hugging Face's `DynamicCache` layer tensors); addressed like ``contiguous``.

Each transfer does one batched gather (or scatter) per layer for the whole request.
On CUDA, copies run on dedicated streams through pinned host staging buffers that
are allocated once and reused (grown when needed), two per direction so that the
host copy of layer i overlaps the DMA of layer i+1; `torch.cuda.Event`s order the
transfers after the compute that wrote the KV (store) and the compute after the
load (load). On CPU the same code runs with a no-op stream stand-in, so every path
is testable without a GPU.

A connector is not thread-safe: one per engine worker, one transfer at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from raykv.errors import InvalidInputError
from raykv.page_connector import DONE, DoneEvent
from raykv.payload import (
    LAYOUT_KV_2LTD,
    PayloadMeta,
    buffer_to_tensor,
    tensor_to_buffer,
)

Layout = Literal["paged", "contiguous", "hf"]
LAYOUTS: tuple[str, ...] = ("paged", "contiguous", "hf")

SpanLike = Sequence[int]  # a ChunkSpan (start, end, key) or a (start, end) pair
KVBuffers = Sequence[Any]  # per layer: a tensor (paged/contiguous) or a (keys, values) pair (hf)
PayloadLike = torch.Tensor | tuple[Any, PayloadMeta]


class _NullStream:
    """Stand-in for `torch.cuda.Stream` on CPU: work runs synchronously, so ordering is free."""

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> DoneEvent:
        return DONE

    def synchronize(self) -> None:
        return None


@dataclass(slots=True)
class _Plan:
    """A validated transfer: where each span's tokens are in the staging order and in the buffer."""

    num_tokens: int  # total tokens moved (T)
    lengths: list[int]  # tokens per span, in the caller's order
    offsets: list[int]  # where each span starts in the staging order
    groups: list[tuple[int, list[int]]]  # (span length, span indices): equal-length runs
    index: torch.Tensor | None  # buffer rows (on the device), staging order; None: a range
    row_range: tuple[int, int] | None  # [a, b) buffer rows when they are one contiguous range


class GPUConnector:
    """Moves KV between per-layer engine buffers and host `KV_2LTD` chunk payloads.

    `to_payloads` gathers spans of a request into new host tensors; `from_payloads`
    scatters host payloads into the buffers. The `*_layerwise` variants return
    generators that move one layer per step so transfers overlap the model's compute.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str = "cpu",
        layout: Layout = "paged",
        block_size: int = 16,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
        if layout not in LAYOUTS:
            raise InvalidInputError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidInputError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout: Layout = layout
        self.block_size = block_size
        dev = torch.device(device)
        self.is_cuda = dev.type == "cuda"
        if self.is_cuda:
            if not torch.cuda.is_available():
                raise InvalidInputError(f"device {dev} requested but CUDA is not available")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            self._load_stream: Any = torch.cuda.Stream(dev)
            self._store_stream: Any = torch.cuda.Stream(dev)
        elif dev.type == "cpu":
            self._load_stream = self._store_stream = _NullStream()
        else:
            raise InvalidInputError(f"device must be 'cpu' or 'cuda[:N]', got {dev}")
        self.device = dev
        # Device-side rows of one layer, reused; one per direction so a load and a store
        # in flight on their two streams never share memory.
        self._staging = {
            "load": torch.empty(0, dtype=dtype, device=dev),
            "store": torch.empty(0, dtype=dtype, device=dev),
        }
        # Two pinned host buffers per direction, plus the event of their last DMA.
        self._pinned: dict[str, list[torch.Tensor]] = {"load": [], "store": []}
        self._pinned_events: dict[str, list[Any]] = {"load": [None, None], "store": [None, None]}
        self._busy = False

    # ----- shapes -----

    @property
    def hidden(self) -> int:
        """Elements per token per layer and per K or V (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    def payload_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of a `KV_2LTD` payload of `num_tokens` tokens."""
        return (2, self.num_layers, num_tokens, self.hidden)

    def bytes_per_token(self) -> int:
        """Payload bytes per token, all layers, K and V."""
        return 2 * self.num_layers * self.hidden * self.dtype.itemsize

    def allocate_buffers(self, size: int) -> list[Any]:
        """Zeroed KV buffers in this connector's layout: `size` is blocks (paged) or tokens."""
        h, d, dev = self.num_kv_heads, self.head_dim, self.device
        out: list[Any] = []
        for _ in range(self.num_layers):
            if self.layout == "paged":
                out.append(
                    torch.zeros(2, size, self.block_size, h, d, dtype=self.dtype, device=dev)
                )
            elif self.layout == "contiguous":
                out.append(torch.zeros(2, size, h, d, dtype=self.dtype, device=dev))
            else:
                shape = (1, h, size, d)
                out.append(
                    (
                        torch.zeros(shape, dtype=self.dtype, device=dev),
                        torch.zeros(shape, dtype=self.dtype, device=dev),
                    )
                )
        return out

    # ----- store: buffers -> payloads -----

    def to_payloads(
        self,
        kv_buffers: KVBuffers,
        spans: Sequence[SpanLike],
        slot_mapping: Any = None,
    ) -> list[torch.Tensor]:
        """Copy the KV of token spans out of the buffers into new host `KV_2LTD` tensors.

        `spans` are `(start, end)` token ranges of the request (or `ChunkSpan`s);
        token i is read from slot `slot_mapping[i]` (required for ``paged``), or from
        row i when no slot mapping is given. Returns one contiguous CPU tensor per span.
        """
        payloads, steps = self.to_payloads_layerwise(kv_buffers, spans, slot_mapping)
        for _ in steps:
            pass
        return payloads

    def to_buffers(
        self,
        kv_buffers: KVBuffers,
        spans: Sequence[SpanLike],
        slot_mapping: Any = None,
    ) -> list[tuple[np.ndarray, PayloadMeta]]:
        """`to_payloads` as flat uint8 numpy buffers plus metadata (zero-copy views)."""
        return [
            tensor_to_buffer(p, LAYOUT_KV_2LTD)
            for p in self.to_payloads(kv_buffers, spans, slot_mapping)
        ]

    def to_payloads_layerwise(
        self,
        kv_buffers: KVBuffers,
        spans: Sequence[SpanLike],
        slot_mapping: Any = None,
    ) -> tuple[list[torch.Tensor], Iterator[int]]:
        """Layer-by-layer store: returns the (not yet filled) payloads and a generator.

        The generator yields each layer index before copying that layer out: run
        layer i's compute in the loop body, and the copy of layer i starts when the
        loop advances (ordered after that compute by an event). The payloads are
        complete once the generator is exhausted. Inputs are validated here, eagerly.
        """
        buffers = self._check_buffers(kv_buffers)
        ranges = [self._span(s, i) for i, s in enumerate(spans)]
        plan = self._plan(ranges, slot_mapping, self._num_slots(buffers), unique=False)
        blocks: list[torch.Tensor] = []
        payloads: list[torch.Tensor | None] = [None] * len(ranges)
        for length, members in plan.groups:
            block = torch.empty(
                (len(members), *self.payload_shape(length)), dtype=self.dtype, device="cpu"
            )
            blocks.append(block)
            for j, span_idx in enumerate(members):
                payloads[span_idx] = block[j]
        return payloads, self._store_steps(buffers, plan, blocks)  # type: ignore[return-value]

    def _store_steps(
        self, buffers: list[Any], plan: _Plan, blocks: list[torch.Tensor]
    ) -> Iterator[int]:
        self._acquire()
        started = False
        try:
            stream = self._store_stream
            self._record_index(plan, stream)
            pinned = self._pinned_buffers("store", plan.num_tokens)
            pending: tuple[int, Any, torch.Tensor] | None = None  # layer, event, its host rows
            for layer in range(self.num_layers):
                yield layer
                if plan.num_tokens == 0:
                    continue
                started = True
                # Layer `layer`'s KV was written by compute queued on the current stream.
                stream.wait_event(self._current_stream().record_event())
                with self._on(stream):
                    rows = self._gather_layer(buffers[layer], plan)
                    if not self.is_cuda:
                        self._fill_blocks(blocks, plan, layer, DONE, rows)
                        continue
                    host = pinned[layer % 2]
                    host.copy_(rows, non_blocking=True)
                    event = stream.record_event()
                    self._pinned_events["store"][layer % 2] = event
                # Split the previous layer on the host while this layer's DMA runs.
                if pending is not None:
                    self._fill_blocks(blocks, plan, *pending)
                pending = (layer, event, host)
            if pending is not None:
                self._fill_blocks(blocks, plan, *pending)
        finally:
            # Stopped early (or failed), gathers and copies may still read the buffers
            # on the store stream: order the current stream after them, so the caller's
            # next writes to (or frees of) those buffers wait for the reads.
            if plan.num_tokens and started:
                self._current_stream().wait_event(self._store_stream.record_event())
            self._busy = False

    def _fill_blocks(
        self, blocks: list[torch.Tensor], plan: _Plan, layer: int, event: Any, rows: torch.Tensor
    ) -> None:
        """Host side of a store: wait for layer's rows to land, then split them into payloads."""
        event.synchronize()
        for block, (length, members) in zip(blocks, plan.groups, strict=True):
            start = plan.offsets[members[0]]
            part = rows[:, start : start + length * len(members)]
            # [2, n*len, H, D] -> [n, 2, len, H*D]: one strided copy for the whole group.
            block[:, :, layer].copy_(
                part.reshape(2, len(members), length, self.hidden).transpose(0, 1)
            )

    def _gather_layer(self, buffer: Any, plan: _Plan) -> torch.Tensor:
        """One batched gather of a layer's K and V rows into the device staging buffer."""
        rows = self._staging_rows("store", plan.num_tokens)
        for kv, src in enumerate(self._token_major(buffer)):
            if plan.row_range is not None:
                a, b = plan.row_range
                rows[kv].copy_(src[a:b])
            else:
                torch.index_select(src, 0, plan.index, out=rows[kv])
        return rows

    # ----- load: payloads -> buffers -----

    def from_payloads(
        self,
        payloads: Sequence[PayloadLike],
        kv_buffers: KVBuffers,
        starts: Sequence[int | SpanLike],
        slot_mapping: Any = None,
    ) -> None:
        """Scatter host payloads into the buffers; payload j covers tokens from `starts[j]`.

        `starts` holds token offsets (or spans whose length must match the payload's).
        Payloads are `KV_2LTD` CPU tensors or `(uint8 buffer, PayloadMeta)` pairs. On
        CUDA this returns once the copies are queued; the current stream is ordered
        after them, so later compute on it sees the loaded KV.
        """
        for _ in self.from_payloads_layerwise(payloads, kv_buffers, starts, slot_mapping):
            pass

    def from_payloads_layerwise(
        self,
        payloads: Sequence[PayloadLike],
        kv_buffers: KVBuffers,
        starts: Sequence[int | SpanLike],
        slot_mapping: Any = None,
    ) -> Iterator[int]:
        """Layer-by-layer load: a generator that yields layer i once its KV is in place.

        When i is yielded, the current stream already waits on layer i's load, and
        layer i+1's load is in flight: run layer i's compute in the loop body. Stopping
        early leaves the remaining layers unloaded. Inputs are validated here, eagerly.
        """
        buffers = self._check_buffers(kv_buffers)
        tensors = [self._check_payload(p, j) for j, p in enumerate(payloads)]
        if len(starts) != len(tensors):
            raise InvalidInputError(
                f"got {len(tensors)} payloads but {len(starts)} starts; need one start per payload"
            )
        ranges = []
        for j, (t, s) in enumerate(zip(tensors, starts, strict=True)):
            n = t.shape[2]
            if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
                ranges.append(self._span((int(s), int(s) + n), j))
                continue
            start, end = self._span(s, j)
            if end - start != n:
                raise InvalidInputError(
                    f"span {j} covers {end - start} tokens but payload {j} holds {n}"
                )
            ranges.append((start, end))
        plan = self._plan(ranges, slot_mapping, self._num_slots(buffers), unique=True)
        ordered = [tensors[i] for _, members in plan.groups for i in members]
        return self._load_steps(buffers, plan, ordered)

    def _load_steps(
        self, buffers: list[Any], plan: _Plan, ordered: list[torch.Tensor]
    ) -> Iterator[int]:
        self._acquire()
        events: list[Any] = []
        try:
            if plan.num_tokens == 0:
                yield from range(self.num_layers)
                return
            stream = self._load_stream
            # The buffers may still be in use by compute queued before this load.
            stream.wait_event(self._current_stream().record_event())
            self._record_index(plan, stream)
            pinned = self._pinned_buffers("load", plan.num_tokens)
            events.append(self._load_layer(0, buffers, plan, ordered, pinned))
            for layer in range(self.num_layers):
                if layer + 1 < self.num_layers:
                    events.append(self._load_layer(layer + 1, buffers, plan, ordered, pinned))
                self._current_stream().wait_event(events[layer])
                yield layer
        finally:
            # Stopped early (or failed), layer i+1's copy may still run on the load
            # stream: order the current stream after every queued layer, so nothing the
            # caller queues next (a recompute of these slots) races with it.
            for event in events:
                self._current_stream().wait_event(event)
            self._busy = False

    def _load_layer(
        self,
        layer: int,
        buffers: list[Any],
        plan: _Plan,
        ordered: list[torch.Tensor],
        pinned: list[torch.Tensor],
    ) -> Any:
        """Queue one layer's load; returns the event that marks its KV in place."""
        stream = self._load_stream
        if self.is_cuda:
            slot = layer % 2
            previous = self._pinned_events["load"][slot]
            if previous is not None:
                previous.synchronize()  # its last DMA must be done before we overwrite it
            host = pinned[slot]
        else:
            host = self._staging_rows("load", plan.num_tokens)
        flat = host.view(2, plan.num_tokens, self.hidden)
        torch.cat([t[:, layer] for t in ordered], dim=1, out=flat)
        with self._on(stream):
            if self.is_cuda:
                rows = self._staging_rows("load", plan.num_tokens)
                rows.copy_(host, non_blocking=True)
                self._pinned_events["load"][layer % 2] = stream.record_event()
            else:
                rows = host
            for kv, dst in enumerate(self._token_major(buffers[layer])):
                if plan.row_range is not None:
                    a, b = plan.row_range
                    dst[a:b].copy_(rows[kv])
                else:
                    dst.index_copy_(0, plan.index, rows[kv])
            return stream.record_event()

    # ----- validation and planning -----

    def _span(self, span: Any, i: int) -> tuple[int, int]:
        try:
            start, end = int(span[0]), int(span[1])
            ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in span[:2])
        except (TypeError, IndexError, ValueError):
            ok = False
        if not ok:
            raise InvalidInputError(
                f"span {i} must be (start, end) ints or a ChunkSpan, got {span!r:.80}"
            )
        if not 0 <= start < end:
            raise InvalidInputError(f"span {i} must satisfy 0 <= start < end, got [{start}, {end})")
        return start, end

    def _check_buffers(self, kv_buffers: KVBuffers) -> list[Any]:
        if isinstance(kv_buffers, torch.Tensor) or not isinstance(kv_buffers, Sequence):
            raise InvalidInputError(
                "kv_buffers must be a list with one entry per layer, "
                f"got {type(kv_buffers).__name__}"
            )
        buffers = list(kv_buffers)
        if len(buffers) != self.num_layers:
            raise InvalidInputError(
                f"expected KV buffers for {self.num_layers} layers, got {len(buffers)}"
            )
        first: tuple[int, ...] | None = None
        for i, buf in enumerate(buffers):
            tensors = self._layer_tensors(buf, i)
            for t in tensors:
                self._check_tensor(t, i)
                if first is None:
                    first = tuple(t.shape)
                elif tuple(t.shape) != first:
                    raise InvalidInputError(
                        f"layer {i} buffer has shape {list(t.shape)}, but layer 0 has {list(first)}"
                    )
        return buffers

    def _layer_tensors(self, buf: Any, i: int) -> tuple[torch.Tensor, ...]:
        h, d = self.num_kv_heads, self.head_dim
        if self.layout == "hf":
            if not (isinstance(buf, Sequence) and len(buf) == 2):
                raise InvalidInputError(
                    f"layer {i}: the hf layout needs a (keys, values) pair, "
                    f"got {type(buf).__name__}"
                )
            for t in buf:
                if (
                    not isinstance(t, torch.Tensor)
                    or t.dim() != 4
                    or t.shape[0] != 1
                    or (t.shape[1] != h or t.shape[3] != d)
                ):
                    shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise InvalidInputError(
                        f"layer {i}: expected keys/values of shape [1, {h}, seq_len, {d}], "
                        f"got {shape}"
                    )
            return tuple(buf)
        if self.layout == "paged":
            want = f"[2, num_blocks, {self.block_size}, {h}, {d}]"
            ok = isinstance(buf, torch.Tensor) and buf.dim() == 5 and buf.shape[0] == 2
            ok = ok and tuple(buf.shape[2:]) == (self.block_size, h, d)
        else:
            want = f"[2, capacity, {h}, {d}]"
            ok = isinstance(buf, torch.Tensor) and buf.dim() == 4 and buf.shape[0] == 2
            ok = ok and tuple(buf.shape[2:]) == (h, d)
        if not ok:
            got = list(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise InvalidInputError(f"layer {i}: {self.layout} buffer must be {want}, got {got}")
        if not buf.is_contiguous():
            raise InvalidInputError(f"layer {i}: {self.layout} buffer must be contiguous")
        return (buf,)

    def _check_tensor(self, t: torch.Tensor, i: int) -> None:
        if t.dtype != self.dtype:
            raise InvalidInputError(f"layer {i}: expected dtype {self.dtype}, got {t.dtype}")
        if t.device != self.device:
            raise InvalidInputError(f"layer {i}: expected device {self.device}, got {t.device}")

    def _num_slots(self, buffers: list[Any]) -> int:
        if self.layout == "hf":
            return int(buffers[0][0].shape[2])
        shape = buffers[0].shape
        return int(shape[1] * shape[2]) if self.layout == "paged" else int(shape[1])

    def _token_major(self, buf: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer as `[num_slots, H, D]` views (strided for hf)."""
        h, d = self.num_kv_heads, self.head_dim
        if self.layout == "hf":
            return buf[0][0].transpose(0, 1), buf[1][0].transpose(0, 1)
        return buf[0].view(-1, h, d), buf[1].view(-1, h, d)

    def _check_payload(self, p: Any, j: int) -> torch.Tensor:
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], PayloadMeta):
            if p[1].layout != LAYOUT_KV_2LTD:
                raise InvalidInputError(
                    f"payload {j}: expected layout {LAYOUT_KV_2LTD}, got {p[1].layout}"
                )
            p = buffer_to_tensor(p[0], p[1])
        if not isinstance(p, torch.Tensor):
            raise InvalidInputError(
                f"payload {j} must be a torch.Tensor or a (buffer, PayloadMeta) pair, "
                f"got {type(p).__name__}"
            )
        want = self.payload_shape(p.shape[2] if p.dim() == 4 else -1)
        if p.dim() != 4 or tuple(p.shape) != want or p.shape[2] == 0:
            raise InvalidInputError(
                f"payload {j}: expected KV_2LTD shape [2, {self.num_layers}, num_tokens>0, "
                f"{self.hidden}], got {list(p.shape)}"
            )
        if p.dtype != self.dtype:
            raise InvalidInputError(f"payload {j}: expected dtype {self.dtype}, got {p.dtype}")
        if p.device.type != "cpu":
            raise InvalidInputError(f"payload {j}: expected a CPU tensor, got device {p.device}")
        return p

    def _plan(
        self, ranges: list[tuple[int, int]], slot_mapping: Any, num_slots: int, *, unique: bool
    ) -> _Plan:
        lengths = [b - a for a, b in ranges]
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_length.setdefault(n, []).append(i)
        groups = list(by_length.items())
        offsets = [0] * len(ranges)
        order: list[tuple[int, int]] = []
        pos = 0
        for _, members in groups:
            for i in members:
                offsets[i] = pos
                pos += lengths[i]
                order.append(ranges[i])
        if unique:
            sorted_ranges = sorted(ranges)
            for (a0, b0), (a1, b1) in zip(sorted_ranges, sorted_ranges[1:], strict=False):
                if a1 < b0:
                    raise InvalidInputError(
                        f"payload token ranges overlap: [{a0}, {b0}) and [{a1}, {b1})"
                    )
        if slot_mapping is None:
            if self.layout == "paged":
                raise InvalidInputError(
                    "the paged layout needs a slot_mapping (one slot per token)"
                )
            end = max((b for _, b in ranges), default=0)
            if end > num_slots:
                raise InvalidInputError(
                    f"spans reach token {end} but the buffers hold {num_slots} tokens"
                )
            contiguous = all(b0 == a1 for (_, b0), (a1, _) in zip(order, order[1:], strict=False))
            if contiguous and order:
                return _Plan(pos, lengths, offsets, groups, None, (order[0][0], order[-1][1]))
            rows = torch.cat([torch.arange(a, b) for a, b in order]) if order else None
            index = rows.to(self.device) if rows is not None else None
            return _Plan(pos, lengths, offsets, groups, index, None)
        slots = self._check_slot_mapping(slot_mapping, ranges)
        index = torch.cat([slots[a:b] for a, b in order]) if order else None
        if index is not None:
            lo, hi = int(index.min()), int(index.max())
            if lo < 0 or hi >= num_slots:
                raise InvalidInputError(
                    f"slot_mapping has slots in [{lo}, {hi}] for the requested tokens; "
                    f"valid slots are [0, {num_slots})"
                )
            if unique and torch.unique(index).numel() != index.numel():
                raise InvalidInputError("slot_mapping maps two loaded tokens to the same slot")
        return _Plan(pos, lengths, offsets, groups, index, None)

    def _check_slot_mapping(self, slot_mapping: Any, ranges: list[tuple[int, int]]) -> torch.Tensor:
        if not isinstance(slot_mapping, torch.Tensor):
            try:
                slot_mapping = torch.as_tensor(np.asarray(slot_mapping))
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(f"slot_mapping must be 1-D integers: {exc}") from None
        if (
            slot_mapping.dim() != 1
            or slot_mapping.dtype.is_floating_point
            or (slot_mapping.dtype in (torch.bool, torch.complex64, torch.complex128))
        ):
            raise InvalidInputError(
                f"slot_mapping must be a 1-D integer tensor, got dtype {slot_mapping.dtype} "
                f"shape {list(slot_mapping.shape)}"
            )
        end = max((b for _, b in ranges), default=0)
        if end > slot_mapping.numel():
            raise InvalidInputError(
                f"slot_mapping has {slot_mapping.numel()} entries (one per token) but the spans "
                f"reach token {end}"
            )
        return slot_mapping.to(device=self.device, dtype=torch.long)

    # ----- staging and streams -----

    def _staging_rows(self, direction: str, num_tokens: int) -> torch.Tensor:
        """The reused device buffer viewed as `[2, num_tokens, H, D]`; grows when too small.

        On CUDA it is (re)allocated while the direction's stream is current, so the
        caching allocator orders its reuse after that stream's queued work.
        """
        need = 2 * num_tokens * self.hidden
        if self._staging[direction].numel() < need:
            self._staging[direction] = torch.empty(
                _grow(need), dtype=self.dtype, device=self.device
            )
        return self._staging[direction][:need].view(2, num_tokens, self.num_kv_heads, self.head_dim)

    def _pinned_buffers(self, direction: str, num_tokens: int) -> list[torch.Tensor]:
        """Two pinned host `[2, num_tokens, H, D]` buffers for one direction (CUDA only)."""
        if not self.is_cuda:
            return []
        need = 2 * num_tokens * self.hidden
        bufs = self._pinned[direction]
        if not bufs or bufs[0].numel() < need:
            for event in self._pinned_events[direction]:
                if event is not None:
                    event.synchronize()  # the old buffers may still feed a DMA
            size = _grow(need)
            bufs[:] = [torch.empty(size, dtype=self.dtype, pin_memory=True) for _ in range(2)]
            self._pinned_events[direction] = [None, None]
        shape = (2, num_tokens, self.num_kv_heads, self.head_dim)
        return [b[:need].view(shape) for b in bufs]

    def _record_index(self, plan: _Plan, stream: Any) -> None:
        """The index was made on the current stream; keep its memory until `stream` is done."""
        if self.is_cuda and plan.index is not None:
            plan.index.record_stream(stream)

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else _NullStream()

    def _on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def _acquire(self) -> None:
        if self._busy:
            raise InvalidInputError(
                "this GPUConnector is already running a transfer; finish (exhaust) the other "
                "layerwise generator first, or use one connector per concurrent transfer"
            )
        self._busy = True

    def synchronize(self) -> None:
        """Block until every queued load and store of this connector has finished."""
        self._load_stream.synchronize()
        self._store_stream.synchronize()


def _grow(n: int) -> int:
    """Round up to a power of two so a growing workload reallocates O(log n) times."""
    return 1 << max(0, n - 1).bit_length()


__all__ = ["LAYOUTS", "GPUConnector", "Layout"]
