"""GPUConnector: bit-exact gather/scatter between KV buffers and KV_2LTD payloads.

Everything runs on CPU; the tests marked `cuda` exercise the stream and pinned-memory
path and are skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raykv.connector import GPUConnector
from raykv.errors import InvalidInputError
from raykv.keys import KeyMaker
from raykv.payload import buffer_to_tensor, decode, encode, tensor_to_buffer

LAYERS, HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 4
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0.0 vs 0.0 or NaN payloads count as differences."""
    return t.contiguous().view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make(layout: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> GPUConnector:
    return GPUConnector(LAYERS, HEADS, HEAD_DIM, dtype, device, layout=layout, block_size=BLOCK)


def filled(conn: GPUConnector, size: int, seed: int = 0) -> list:
    """Buffers full of random values (distinct per slot, layer, K/V)."""
    g = torch.Generator().manual_seed(seed)
    bufs = conn.allocate_buffers(size)
    for buf in bufs:
        for t in buf if conn.layout == "hf" else (buf,):
            t.copy_(torch.randn(t.shape, generator=g).to(conn.dtype))
    return bufs


def token_rows(conn: GPUConnector, buf, kv: int) -> torch.Tensor:
    """A layer's K or V as [num_slots, hidden], slot-indexed (the reference view)."""
    t = buf[kv][0].transpose(0, 1) if conn.layout == "hf" else buf[kv]
    return t.reshape(-1, conn.hidden)


def reference(conn: GPUConnector, bufs, spans, slots) -> list[torch.Tensor]:
    out = []
    for a, b in spans:
        idx = slots[a:b] if slots is not None else torch.arange(a, b)
        per_kv = [
            torch.stack([token_rows(conn, bufs[layer], kv)[idx] for layer in range(LAYERS)])
            for kv in (0, 1)
        ]
        out.append(torch.stack(per_kv))
    return out


def paged_slots(num_tokens: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A vLLM-style slot mapping over randomly chosen, non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)[: -(-num_tokens // BLOCK)]
    slots = blocks[:, None] * BLOCK + torch.arange(BLOCK)
    return slots.reshape(-1)[:num_tokens]


# (layout, buffer size in blocks or tokens, slot mapping factory)
CASES = {
    "paged": ("paged", 40, lambda n: paged_slots(n, 40)),
    "contiguous": ("contiguous", 64, lambda n: None),
    "contiguous-slots": ("contiguous", 64, lambda n: torch.randperm(64)[:n]),
    "hf": ("hf", 64, lambda n: None),
    "hf-slots": ("hf", 64, lambda n: torch.randperm(64)[:n]),
}
SPANS = [(0, 16), (16, 32), (32, 43)]  # two full chunks and a partial one


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_to_payloads_matches_reference_gather_bit_exactly(case: str, dtype: torch.dtype) -> None:
    layout, size, slots_for = CASES[case]
    conn = make(layout, dtype)
    bufs = filled(conn, size)
    slots = slots_for(43)
    payloads = conn.to_payloads(bufs, SPANS, slots)
    assert [tuple(p.shape) for p in payloads] == [conn.payload_shape(b - a) for a, b in SPANS]
    for got, want in zip(payloads, reference(conn, bufs, SPANS, slots), strict=True):
        assert got.device.type == "cpu" and got.is_contiguous()
        assert same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_scatter_into_fresh_buffers_restores_touched_slots_only(
    case: str, dtype: torch.dtype
) -> None:
    layout, size, slots_for = CASES[case]
    conn = make(layout, dtype)
    src = filled(conn, size, seed=1)
    slots = slots_for(43)
    payloads = conn.to_payloads(src, SPANS, slots)
    dst = filled(conn, size, seed=2)  # "untouched" slots keep these values
    before = [[token_rows(conn, buf, kv).clone() for kv in (0, 1)] for buf in dst]
    conn.from_payloads(payloads, dst, [a for a, _ in SPANS], slots)
    touched = slots[:43] if slots is not None else torch.arange(43)
    untouched = torch.ones(token_rows(conn, dst[0], 0).shape[0], dtype=torch.bool)
    untouched[touched] = False
    for layer in range(LAYERS):
        for kv in (0, 1):
            rows = token_rows(conn, dst[layer], kv)
            assert same_bits(rows[touched], token_rows(conn, src[layer], kv)[touched])
            assert same_bits(rows[untouched], before[layer][kv][untouched])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_through_codec_is_bit_exact(dtype: torch.dtype) -> None:
    """buffers -> numpy + meta -> encode/decode -> read-only tensor -> other buffers."""
    conn = make("paged", dtype)
    src = filled(conn, 40)
    slots = paged_slots(48, 40, seed=3)
    spans = KeyMaker(chunk_size=16).keys(list(range(48)))  # ChunkSpans work as spans
    wire = [encode(buf, meta) for buf, meta in conn.to_buffers(src, spans, slots)]
    decoded = [decode(memoryview(w).toreadonly()) for w in wire]
    dst = conn.allocate_buffers(40)
    conn.from_payloads([(d.data, d.meta) for d in decoded], dst, spans, slots)
    again = conn.to_payloads(dst, spans, slots)
    for d, p in zip(decoded, again, strict=True):
        assert same_bits(buffer_to_tensor(d.data, d.meta), p)


def test_spans_in_any_order_and_uneven_lengths() -> None:
    conn = make("paged")
    bufs = filled(conn, 40)
    slots = paged_slots(60, 40)
    spans = [(40, 45), (0, 16), (20, 24), (16, 20), (45, 60)]
    payloads = conn.to_payloads(bufs, spans, slots)
    for got, want in zip(payloads, reference(conn, bufs, spans, slots), strict=True):
        assert same_bits(got, want)
    dst = conn.allocate_buffers(40)
    conn.from_payloads(payloads, dst, [a for a, _ in spans], slots)
    assert all(
        same_bits(a, b) for a, b in zip(conn.to_payloads(dst, spans, slots), payloads, strict=True)
    )


@pytest.mark.parametrize("case", ["paged", "contiguous", "hf"])
def test_layerwise_store_equals_whole_and_copies_after_each_step(case: str) -> None:
    layout, size, slots_for = CASES[case]
    conn = make(layout)
    bufs = filled(conn, size)
    slots = slots_for(43)
    whole = conn.to_payloads(bufs, SPANS, slots)
    payloads, steps = conn.to_payloads_layerwise(bufs, SPANS, slots)
    seen = []
    for layer in steps:
        seen.append(layer)
        # "Compute" writes layer `layer` now; the copy-out must see it.
        for t in bufs[layer] if layout == "hf" else (bufs[layer],):
            t.mul_(2)
    assert seen == list(range(LAYERS))
    for got, want in zip(payloads, whole, strict=True):
        assert same_bits(got, want * 2)


@pytest.mark.parametrize("case", ["paged", "contiguous-slots", "hf"])
def test_layerwise_load_equals_whole_and_has_layer_ready_when_yielded(case: str) -> None:
    layout, size, slots_for = CASES[case]
    conn = make(layout)
    slots = slots_for(43)
    payloads = conn.to_payloads(filled(conn, size), SPANS, slots)
    starts = [a for a, _ in SPANS]
    whole = conn.allocate_buffers(size)
    conn.from_payloads(payloads, whole, starts, slots)
    stepped = conn.allocate_buffers(size)
    for layer in conn.from_payloads_layerwise(payloads, stepped, starts, slots):
        for kv in (0, 1):
            assert same_bits(
                token_rows(conn, stepped[layer], kv), token_rows(conn, whole[layer], kv)
            )


def test_staging_buffer_is_reused_across_calls_and_grows() -> None:
    conn = make("paged")
    bufs = filled(conn, 40)
    slots = paged_slots(43, 40)
    conn.to_payloads(bufs, SPANS, slots)
    first = conn._staging["store"].data_ptr()
    conn.to_payloads(bufs, SPANS[:2], slots)
    assert conn._staging["store"].data_ptr() == first
    conn.to_payloads(bufs, [(0, 150)], paged_slots(150, 40))
    assert conn._staging["store"].numel() >= 2 * 150 * conn.hidden


def test_empty_request_is_a_no_op() -> None:
    conn = make("paged")
    bufs = filled(conn, 8)
    assert conn.to_payloads(bufs, [], torch.zeros(0, dtype=torch.long)) == []
    conn.from_payloads([], bufs, [], torch.zeros(0, dtype=torch.long))


def test_a_second_transfer_while_a_generator_is_open_is_rejected() -> None:
    conn = make("contiguous")
    bufs = filled(conn, 64)
    _, steps = conn.to_payloads_layerwise(bufs, SPANS)
    next(steps)
    with pytest.raises(InvalidInputError, match="already running"):
        conn.to_payloads(bufs, SPANS)
    steps.close()
    conn.to_payloads(bufs, SPANS)  # free again


# ----- input validation -----


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidInputError, match="unknown layout 'ragged'"):
        GPUConnector(2, 2, 8, layout="ragged")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="num_layers must be a positive int, got 0"):
        GPUConnector(0, 2, 8)
    with pytest.raises(InvalidInputError, match="dtype"):
        GPUConnector(2, 2, 8, dtype="float99")


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda b: b[:-1], r"expected KV buffers for 3 layers, got 2"),
        (lambda b: [t.view(2, -1, 2, 2, 8) for t in b], r"must be \[2, num_blocks, 4, 2, 8\]"),
        (lambda b: [t.double() for t in b], r"expected dtype torch.float32, got torch.float64"),
        (lambda b: [t.to("meta") for t in b], r"expected device cpu, got meta"),
        (
            lambda b: [b[0], b[1], b[2][:, :20].clone()],
            r"layer 2 buffer has shape \[2, 20, 4, 2, 8\], but layer 0 has \[2, 40, 4, 2, 8\]",
        ),
        (lambda b: [t[:, ::2] for t in b], "layer 0: paged buffer must be contiguous"),
        (lambda b: b[0], r"one entry per layer"),
    ],
)
def test_bad_buffers_raise_naming_expected_and_actual(mutate, pattern: str) -> None:
    conn = make("paged")
    bufs = filled(conn, 40)
    with pytest.raises(InvalidInputError, match=pattern):
        conn.to_payloads(mutate(bufs), SPANS, paged_slots(43, 40))


@pytest.mark.parametrize(
    ("spans", "slots", "pattern"),
    [
        (SPANS, None, "paged layout needs a slot_mapping"),
        (SPANS, torch.arange(40), r"slot_mapping has 40 entries .* reach token 43"),
        (SPANS, torch.full((43,), 160), r"slots in \[160, 160\] .* valid slots are \[0, 160\)"),
        (SPANS, torch.full((43,), -1), r"slots in \[-1, -1\]"),
        (SPANS, torch.zeros(43), "1-D integer tensor, got dtype torch.float32"),
        (SPANS, torch.zeros(43, 1, dtype=torch.long), r"shape \[43, 1\]"),
        ([(5, 5)], torch.arange(43), r"0 <= start < end, got \[5, 5\)"),
        ([(-1, 3)], torch.arange(43), r"0 <= start < end"),
        (["ab"], torch.arange(43), "span 0 must be"),
    ],
)
def test_bad_spans_and_slot_mappings_raise(spans, slots, pattern: str) -> None:
    conn = make("paged")
    with pytest.raises(InvalidInputError, match=pattern):
        conn.to_payloads(filled(conn, 40), spans, slots)


def test_contiguous_spans_past_capacity_raise() -> None:
    conn = make("contiguous")
    with pytest.raises(InvalidInputError, match="reach token 70 but the buffers hold 64 tokens"):
        conn.to_payloads(filled(conn, 64), [(0, 70)])


def test_bad_payloads_raise() -> None:
    conn = make("paged")
    bufs = filled(conn, 40)
    slots = paged_slots(43, 40)
    good = conn.to_payloads(bufs, SPANS, slots)
    starts = [0, 16, 32]
    cases = [
        ([good[0].half(), *good[1:]], "payload 0: expected dtype torch.float32, got torch.float16"),
        ([good[0][:, :2], *good[1:]], r"\[2, 3, num_tokens>0, 16\], got \[2, 2, 16, 16\]"),
        ([good[0], good[1], "x"], "payload 2 must be a torch.Tensor"),
        ([good[0].to("meta"), *good[1:]], "expected a CPU tensor, got device meta"),
    ]
    for payloads, pattern in cases:
        with pytest.raises(InvalidInputError, match=pattern):
            conn.from_payloads(payloads, bufs, starts, slots)
    with pytest.raises(InvalidInputError, match="3 payloads but 2 starts"):
        conn.from_payloads(good, bufs, starts[:2], slots)
    with pytest.raises(InvalidInputError, match=r"overlap: \[0, 16\) and \[10, 26\)"):
        conn.from_payloads(good, bufs, [0, 10, 32], slots)
    with pytest.raises(InvalidInputError, match="span 1 covers 8 tokens but payload 1 holds 16"):
        conn.from_payloads(good, bufs, [(0, 16), (16, 24), (32, 43)], slots)
    dup = slots.clone()
    dup[20] = dup[3]
    with pytest.raises(InvalidInputError, match="same slot"):
        conn.from_payloads(good, bufs, starts, dup)


def test_accepts_numpy_slot_mapping_and_payload_buffer_pairs() -> None:
    conn = make("paged", torch.bfloat16)
    bufs = filled(conn, 40)
    slots = paged_slots(43, 40).numpy().astype(np.int32)
    payloads = conn.to_payloads(bufs, SPANS, slots)
    pairs = [tensor_to_buffer(p) for p in payloads]
    for arr, _ in pairs:
        arr.setflags(write=False)  # like a zero-copy get from Ray's object store
    dst = conn.allocate_buffers(40)
    conn.from_payloads(pairs, dst, [0, 16, 32], slots)
    assert all(
        same_bits(a, b) for a, b in zip(conn.to_payloads(dst, SPANS, slots), payloads, strict=True)
    )


# ----- CUDA: streams, events, pinned staging -----


@cuda
@pytest.mark.parametrize("layout", ["paged", "hf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_round_trip_is_bit_exact(layout: str, dtype: torch.dtype) -> None:
    conn = make(layout, dtype, "cuda")
    size = 40 if layout == "paged" else 64
    src = [
        tuple(t.cuda() for t in b) if layout == "hf" else b.cuda()
        for b in filled(make(layout, dtype), size)
    ]
    slots = paged_slots(43, 40).cuda() if layout == "paged" else None
    payloads = conn.to_payloads(src, SPANS, slots)
    assert all(p.device.type == "cpu" for p in payloads)
    cpu_src = [tuple(t.cpu() for t in b) if layout == "hf" else b.cpu() for b in src]
    want = reference(
        make(layout, dtype), cpu_src, SPANS, slots.cpu() if slots is not None else None
    )
    assert all(same_bits(a, b) for a, b in zip(payloads, want, strict=True))
    dst = conn.allocate_buffers(size)
    conn.from_payloads(payloads, dst, [0, 16, 32], slots)
    again = conn.to_payloads(dst, SPANS, slots)  # ordered after the load by the events
    assert all(same_bits(a, b) for a, b in zip(again, payloads, strict=True))


@cuda
def test_cuda_layerwise_load_orders_compute_after_each_layer() -> None:
    conn = make("paged", torch.float16, "cuda")
    slots = paged_slots(43, 40).cuda()
    src = [b.cuda() for b in filled(make("paged", torch.float16), 40)]
    payloads = conn.to_payloads(src, SPANS, slots)
    dst = conn.allocate_buffers(40)
    sums = []
    for layer in conn.from_payloads_layerwise(payloads, dst, [0, 16, 32], slots):
        torch.cuda._sleep(1_000_000)  # slow "compute" so the next layer's load overlaps it
        sums.append(dst[layer].double().sum())  # queued on the current stream, after the load
    torch.cuda.synchronize()
    want = [sum(p[:, layer].double().sum() for p in payloads).item() for layer in range(LAYERS)]
    assert [s.item() for s in sums] == pytest.approx(want, rel=1e-9)


@cuda
def test_cuda_pinned_staging_is_allocated_once_and_reused() -> None:
    conn = make("paged", torch.bfloat16, "cuda")
    bufs = [b.cuda() for b in filled(make("paged", torch.bfloat16), 40)]
    slots = paged_slots(43, 40).cuda()
    payloads = conn.to_payloads(bufs, SPANS, slots)
    conn.from_payloads(payloads, bufs, [0, 16, 32], slots)
    pinned = {d: [b.data_ptr() for b in conn._pinned[d]] for d in ("load", "store")}
    assert all(b.is_pinned() for d in ("load", "store") for b in conn._pinned[d])
    for _ in range(3):
        payloads = conn.to_payloads(bufs, SPANS, slots)
        conn.from_payloads(payloads, bufs, [0, 16, 32], slots)
    assert pinned == {d: [b.data_ptr() for b in conn._pinned[d]] for d in ("load", "store")}
    conn.synchronize()


class _RecordingStream:
    """The current stream, recording what it is told to wait for."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)

    def record_event(self, event: object = None) -> object:
        return object()


def test_an_abandoned_layerwise_load_orders_the_current_stream_after_every_queued_layer(
    monkeypatch,
) -> None:
    """Stopped after layer 0, layer 1's copy is already queued on the load stream: the
    current stream must wait for it, or a recompute there races with its writes."""
    conn = make("contiguous")
    payloads = conn.to_payloads(filled(conn, 64), SPANS)
    queued: list[object] = []
    real = conn._load_layer

    def load_layer(*args: object) -> object:
        real(*args)
        queued.append(object())  # a distinct event per layer (CPU's are one no-op)
        return queued[-1]

    monkeypatch.setattr(conn, "_load_layer", load_layer)
    current = _RecordingStream()
    monkeypatch.setattr(conn, "_current_stream", lambda: current)
    steps = conn.from_payloads_layerwise(payloads, conn.allocate_buffers(64), [a for a, _ in SPANS])
    assert next(steps) == 0
    steps.close()
    assert len(queued) == 2  # layers 0 and 1
    assert all(any(w is e for w in current.waited) for e in queued)


def test_an_abandoned_layerwise_store_orders_the_current_stream_after_its_reads(
    monkeypatch,
) -> None:
    conn = make("contiguous")
    store_events: list[object] = []
    real_stream = conn._store_stream

    class _Store:
        def wait_event(self, event: object) -> None:
            real_stream.wait_event(event)

        def record_event(self, event: object = None) -> object:
            store_events.append(object())
            return store_events[-1]

    monkeypatch.setattr(conn, "_store_stream", _Store())
    current = _RecordingStream()
    monkeypatch.setattr(conn, "_current_stream", lambda: current)
    _, steps = conn.to_payloads_layerwise(filled(conn, 64), SPANS)
    next(steps)
    next(steps)  # layer 0's gather was queued
    steps.close()
    assert store_events and current.waited[-1] is store_events[-1]
