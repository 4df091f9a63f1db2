"""How a client's KV looks in memory: the checks of what a caller hands in (a KV_2LTD
tensor, chunk tensors, an engine's buffers through a `GPUConnector`), the copies into
staging memory and out into a destination, and the zero-copy tensors of read chunks.

torch and numpy only (no Ray): `KVCache` holds one `KVLayout`, fixed on first use to the
(num_layers, hidden) of the first KV it sees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raykv.client.staging import copy_buffers
from raykv.config import RayKVConfig
from raykv.connector import GPUConnector, KVBuffers
from raykv.errors import InvalidInputError
from raykv.keys import ChunkSpan
from raykv.payload import PayloadMeta, buffers_to_tensors, tensor_to_buffer

logger = logging.getLogger(__name__)

_RING_VIEWS = 256  # cached torch views of the staging ring (offsets come round)


@dataclass(frozen=True)
class KVTarget:
    """An engine's KV buffers, read and written through a `GPUConnector`.

    `buffers` is one entry per layer in the connector's layout; token i of the request
    lives at `slot_mapping[i]` (required for the paged layout) or at row i.
    """

    connector: GPUConnector
    buffers: KVBuffers
    slot_mapping: Any = None


KVSource = torch.Tensor | Sequence[torch.Tensor] | KVTarget


class KVLayout:
    """The KV layout of one client: dtype from the config, (num_layers, hidden) from the
    first KV it checks; every later KV must match it."""

    def __init__(self, config: RayKVConfig) -> None:
        self.kv_dtype = config.kv_dtype
        self.chunk_size = config.chunk_size
        self.model_name = config.model_name
        self._dtype = getattr(torch, config.kv_dtype)
        self._geometry: tuple[int, int] | None = None  # (num_layers, hidden), set on first use
        self._metas: dict[int, PayloadMeta] = {}  # chunk length -> meta, under that geometry
        # (ring offset, chunk tokens) -> a torch view of the staging ring there
        self._ring_views: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def check_geometry(self, num_layers: int, hidden: int, what: str) -> None:
        if self._geometry is None:
            self._geometry = (num_layers, hidden)
        elif self._geometry != (num_layers, hidden):
            raise InvalidInputError(
                f"{what} has {num_layers} layers x {hidden} hidden, expected "
                f"{self._geometry[0]} x {self._geometry[1]} "
                "(the layout this cache was first used with)"
            )

    def check_kv_tensor(self, kv: torch.Tensor, n_tokens: int, what: str) -> None:
        shape = kv.shape if isinstance(kv, torch.Tensor) else None  # read once: cold reads cost
        if shape is None or len(shape) != 4 or shape[0] != 2:
            got = type(kv).__name__ if shape is None else list(shape)
            raise InvalidInputError(
                f"{what} must be a KV_2LTD tensor [2, num_layers, num_tokens, hidden], got {got}"
            )
        if kv.dtype != self._dtype:
            raise InvalidInputError(
                f"{what} has dtype {kv.dtype}, expected {self._dtype} (config kv_dtype)"
            )
        if shape[2] < n_tokens:
            raise InvalidInputError(
                f"{what} covers {shape[2]} tokens, expected at least {n_tokens}"
            )
        if self._geometry != (shape[1], shape[3]):
            self.check_geometry(shape[1], shape[3], what)

    def check_source(self, kv: KVSource, spans: list[ChunkSpan], n_tokens: int) -> None:
        """Check a store's KV against the prompt and this cache's layout (before any copy)."""
        if isinstance(kv, KVTarget):
            self.check_destination(kv, n_tokens)
        elif isinstance(kv, torch.Tensor):
            self.check_kv_tensor(kv, n_tokens, "kv")
        else:
            self.check_chunks(kv, spans)

    def check_chunks(self, kv: Any, spans: list[ChunkSpan]) -> None:
        if not isinstance(kv, Sequence) or isinstance(kv, (str, bytes)):
            raise InvalidInputError(
                "kv must be a KV_2LTD tensor, a list of chunk tensors or a KVTarget, "
                f"got {type(kv).__name__}"
            )
        if len(kv) != len(spans):
            raise InvalidInputError(
                f"got {len(kv)} KV chunks for {len(spans)} chunks of the prompt "
                f"(chunk_size={self.chunk_size}, mask applied)"
            )
        for j, (chunk, span) in enumerate(zip(kv, spans, strict=True)):
            self.check_kv_tensor(chunk, span.end - span.start, f"KV chunk {j}")
            if chunk.shape[2] != span.end - span.start:
                raise InvalidInputError(
                    f"KV chunk {j} has {chunk.shape[2]} tokens, expected {span.end - span.start}"
                )

    def fill(
        self,
        region: np.ndarray,
        at: int,
        kv: KVSource,
        spans: list[ChunkSpan],
        metas: list[PayloadMeta],
    ) -> None:
        """Copy the chunks of `kv` (checked) into `region` (at offset `at` of the staging
        ring), back to back in span order."""
        if isinstance(kv, KVTarget):  # the connector gathers into new buffers: copy those
            copy_buffers(region, self.payloads(kv, spans))
            return
        off = 0
        whole = isinstance(kv, torch.Tensor)
        views = self._ring_views
        for j, (span, meta) in enumerate(zip(spans, metas, strict=True)):
            n = span.end - span.start
            out = views.get((at + off, n))
            if out is None:  # torch views cost ~0.1 ms on cold caches: one per place
                if len(views) >= _RING_VIEWS:
                    views.clear()
                with torch.inference_mode(False):  # reusable in and out of that mode
                    out = torch.from_numpy(region[off : off + meta.nbytes]).view(self._dtype)
                    out = views[(at + off, n)] = out.view(meta.shape)
            if not whole:
                src = kv[j]
            elif span.start == 0 and n == kv.shape[2]:
                src = kv
            else:
                src = kv.narrow(2, span.start, n)
            out.copy_(src)
            off += meta.nbytes

    def payloads(self, kv: KVSource, spans: list[ChunkSpan]) -> list[np.ndarray]:
        """Flat uint8 buffers of the chunks of a checked `kv` (`_check_source`), in span order."""
        if isinstance(kv, KVTarget):
            return [buf for buf, _ in kv.connector.to_buffers(kv.buffers, spans, kv.slot_mapping)]
        if isinstance(kv, torch.Tensor):
            return [tensor_to_buffer(kv[:, :, s.start : s.end, :])[0] for s in spans]
        return [tensor_to_buffer(chunk)[0] for chunk in kv]

    def meta(self, span: ChunkSpan) -> PayloadMeta:
        """The meta of a chunk of this model's KV (one per chunk length, built once: the
        layout is fixed on first use)."""
        n = span.end - span.start
        meta = self._metas.get(n)
        if meta is None:
            num_layers, hidden = self._geometry  # type: ignore[misc]
            meta = self._metas[n] = PayloadMeta(self.kv_dtype, (2, num_layers, n, hidden))
        return meta

    def materialise(
        self,
        chunks: list[tuple[ChunkSpan, np.ndarray, PayloadMeta]],
        places: list[Any] | None,
        memo: Callable[..., torch.Tensor] | None = None,
    ) -> list[tuple[ChunkSpan, torch.Tensor]]:
        """Zero-copy tensors of the leading chunks that hold this model's KV (of a chunk
        in a batch the read cache holds, the tensor made the first time it was read:
        making one costs ~0.1 ms on cold caches)."""
        good = 0
        for span, buf, meta in chunks:
            want = self.meta(span)
            if meta != want or buf.nbytes != want.nbytes:
                # Not this model's KV (another model under the same model_name, or a hostile
                # writer with a valid checksum): the prefix ends here, the app sees a miss.
                logger.error(
                    "raykv: cached chunk %s is %s (%d bytes), expected %s; treated as a miss "
                    "(do two models share model_name=%r?)",
                    span.key,
                    meta,
                    buf.nbytes,
                    want,
                    self.model_name,
                )
                break
            good += 1
        kept = chunks[:good]
        if places is None or memo is None:
            tensors = buffers_to_tensors([buf for _, buf, _ in kept], [m for _, _, m in kept])
            return [(span, t) for (span, _, _), t in zip(kept, tensors, strict=True)]
        return [
            (span, memo(oid, (index, meta), lambda b=buf, m=meta: buffers_to_tensors([b], [m])[0]))
            for (span, buf, meta), (oid, index) in zip(kept, places, strict=False)
        ]

    def check_destination(self, destination: torch.Tensor | KVTarget, n_tokens: int) -> None:
        """Validate where KV will be written; fixes this client's layout if not yet known."""
        if isinstance(destination, KVTarget):
            conn = destination.connector
            if conn.dtype != self._dtype:
                raise InvalidInputError(
                    f"connector dtype {conn.dtype} != config kv_dtype {self._dtype}"
                )
            self.check_geometry(conn.num_layers, conn.hidden, "the connector")
        else:
            self.check_kv_tensor(destination, n_tokens, "destination")

    def write(
        self, destination: torch.Tensor | KVTarget, chunks: list[tuple[ChunkSpan, torch.Tensor]]
    ) -> None:
        if isinstance(destination, KVTarget):
            conn = destination.connector
            conn.from_payloads(
                [t for _, t in chunks],
                destination.buffers,
                [s.start for s, _ in chunks],
                destination.slot_mapping,
            )
            return
        whole = destination.shape[2]
        for span, tensor in chunks:
            n = span.end - span.start
            part = destination if n == whole else destination.narrow(2, span.start, n)
            part.copy_(tensor)


__all__ = ["KVLayout", "KVSource", "KVTarget"]
