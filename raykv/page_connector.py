"""Page connector: copies whole engine pages (KV blocks) between an engine's per-layer
caches and `PAGES` chunk payloads (what raykv's vLLM connector moves). Exact for any
attention backend, since only whole blocks move."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raykv.errors import InvalidInputError
from raykv.payload import LAYOUT_PAGES, PayloadMeta, buffer_to_tensor


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
        return idx.to(self.device)

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
            for i, layer in enumerate(self.layers):
                torch.index_select(layer, 0, idx, out=host[i])
        else:
            host.copy_(torch.stack([layer.index_select(0, idx) for layer in self.layers]))

    def load(self, buf: Any, meta: PayloadMeta, block_ids: Sequence[int], first: int = 0) -> None:
        """Copy payload blocks `first, first + 1, ...` into `block_ids` of every layer."""
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
        src = buffer_to_tensor(buf, meta)[:, first : first + len(idx)]
        if self.device.type == "cpu" and all(self._rows_view(t) is not None for t in self.layers):
            # numpy's copy runs on the calling thread alone: a loader thread copying
            # beside the forward pass starts no second OpenMP team to fight it.
            rows = idx.numpy()
            for i, layer in enumerate(self.layers):
                self._rows_view(layer)[rows] = (
                    src[i].contiguous().view(torch.uint8).numpy().reshape(len(rows), -1)
                )
            return
        if self.device.type != "cpu":
            src = src.to(self.device)
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, idx, src[i])


__all__ = ["PageConnector"]
