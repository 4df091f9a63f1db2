"""The vLLM connector's worker side moving real bytes on each device the machine has: a
step's saves reach the cache as the bytes its forward wrote (on CUDA: gathered on the
save stream after the forward, into pinned buffers, while the next step may already
overwrite the blocks), and async loads (the loader thread) and in-step loads write
exactly the payload's blocks and nothing else. `get_finished` reports an async load
once; a chunk the cache lacks becomes load errors for its blocks alone.

The real `WorkerSide` and `PageConnector` run; the cache is an in-memory dict of the
stored bytes (`put_chunks` / `get_chunks`, as `test_vllm_deferred_save`). The worker
side never calls vLLM, so on a machine without vLLM (the GPU machine) its metadata
base class is a plain class.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
import types
from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

_STUBS: list[str] = []  # modules standing in for vLLM's while this module imports
if importlib.util.find_spec("vllm") is None:  # only the metadata's base class is vLLM's
    _parts = "vllm.distributed.kv_transfer.kv_connector.v1.base".split(".")
    _STUBS = [".".join(_parts[:i]) for i in range(1, len(_parts) + 1)]
    for _name in _STUBS:
        sys.modules[_name] = types.ModuleType(_name)
    sys.modules[_STUBS[-1]].KVConnectorMetadata = type("KVConnectorMetadata", (), {})

from raykv.client.direct import DiskReader  # noqa: E402
from raykv.client.staging import BufferPool  # noqa: E402
from raykv.integrations import vllm_worker  # noqa: E402
from raykv.integrations.vllm_meta import (  # noqa: E402
    WORKER_COUNTER_METRICS,
    CounterExport,
    LoadSpec,
    RayKVConnectorMetadata,
    SaveSpec,
)
from raykv.integrations.vllm_worker import WorkerSide  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402
from raykv.tiers.chunkfiles import chunk_path  # noqa: E402
from raykv.tiers.disk import DiskStore  # noqa: E402

for _name in _STUBS:  # later modules must see that vLLM is missing (and skip)
    del sys.modules[_name]

BLOCK, CHUNK, BLOCKS = 4, 8, 24  # tokens per block, per chunk; blocks in the cache
SHAPE = (BLOCKS, 2, BLOCK, 16)  # vLLM's per-layer [num_blocks, kv_heads, block, 2 * head]
LAYERS = 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]  # fmt: skip


class DictCache:
    """`hashed_spans`, `put_chunks` and `get_chunks` of a KVCache over a dict."""

    def __init__(self) -> None:
        self.maker = KeyMaker(chunk_size=CHUNK, model_name="m")
        self.chunks: dict[Any, tuple[bytes, Any]] = {}
        self.puts = 0
        self.told: list = []  # read_directly's calls: (keys read unasked, keys gone or bad)

    def read_directly(self, spans: list, bad: Any = ()) -> None:
        self.told.append(([s.key for s in spans], list(bad)))

    def hashed_spans(self, hashes: list, offsets: list) -> list:
        return self.maker.keys_from_hashes(hashes, offsets)

    def put_chunks(self, spans: Any, buffers: Any, metas: Any, prefix: Any = None) -> None:
        for span, buf, meta in zip(spans, buffers, metas, strict=True):
            self.chunks[span.key] = (bytes(buf), meta)
        self.puts += 1

    def get_chunks(
        self, spans: list, lookup_id: str | None = None, timeout: float | None = None
    ) -> tuple[list, list]:
        out = []
        for span in spans:
            if span.key not in self.chunks:
                break
            data, meta = self.chunks[span.key]
            out.append((span, np.frombuffer(data, dtype=np.uint8), meta))  # read-only
        return out, ["cpu"] * len(out)


class Worker(WorkerSide):
    """The worker-side state `RayKVConnector.__init__` makes, without the engine."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            load_timeout_ms=10_000,
            lookup_timeout_ms=3000,
            save_after_step=True,
            disk_direct_reads=False,  # a test hands it a DiskReader itself
            load_wait_ms=0,  # a test sets it
        )
        self._block_size, self._chunk = BLOCK, CHUNK
        self._kv = DictCache()
        self._pages = None
        self._load_errors: set[int] = set()
        self._failed_in_step: deque = deque(maxlen=2)
        self._loads: dict = {}
        self._loader = self._saver = self._gatherer = None
        self._gathers: deque = deque()
        self._buffers = BufferPool(1 << 24)
        self._pending_bytes, self._pending_lock = 0, threading.Lock()
        self._worker_exported = CounterExport(WORKER_COUNTER_METRICS)
        for name in WORKER_COUNTER_METRICS:
            setattr(self, name, 0)
        self.load_log: deque = deque()
        self.save_log: deque = deque()
        self.gather_log: deque = deque()
        self.saved_chunks = self.dropped_saves = 0
        self._connector_metadata: RayKVConnectorMetadata | None = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> RayKVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def step(self, **fields: Any) -> None:
        self._connector_metadata = RayKVConnectorMetadata(**fields)

    def drain(self) -> None:
        """Every save copied and stored (the gather, then the saver thread)."""
        if self._gatherer is not None:
            self._gatherer.submit(lambda: None).result(10)
        self._saver.submit(lambda: None).result(10)

    def close(self) -> None:
        for pool in (self._gatherer, self._saver, self._loader):
            if pool is not None:
                pool.shutdown(wait=True)


def random_bits(device: str, seed: int) -> list[torch.Tensor]:
    """Layers of arbitrary bf16 bit patterns (NaNs too): only bytewise copies keep them."""
    gen = torch.Generator().manual_seed(seed)
    n = int(np.prod(SHAPE))
    return [
        torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=gen)
        .view(torch.bfloat16)
        .reshape(SHAPE)
        .to(device)
        for _ in range(LAYERS)
    ]


def blocks_bytes(layers: list[torch.Tensor], blocks: list[int]) -> bytes:
    """The bytes of `blocks` of every layer, as one payload of them holds them."""
    return b"".join(
        layer[blocks].cpu().contiguous().view(torch.int16).numpy().tobytes() for layer in layers
    )


def hold_the_device(device: str) -> None:
    """Queue a long kernel on the compute stream, so that a copy that does not wait for
    the stream's earlier work would run first and read stale blocks."""
    if device == "cuda":
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles; the host goes on


@pytest.fixture(params=DEVICES)
def worker(request):
    layers = random_bits(request.param, seed=0)
    w = Worker()
    w.register_kv_caches({f"layer.{i}": t for i, t in enumerate(layers)})
    if request.param == "cuda":  # kernels load on first use, which can make the host wait
        save_a_step(w, layers, "cuda", warm_up=True)  # for the device: not in the test
        w._kv.chunks.clear()
        w._kv.puts = w.saved_chunks = 0
    try:
        yield w, layers, request.param
    finally:
        w.close()


SAVED = [3, 7, 1, 9]  # a request's blocks: two chunks of two blocks
HASHES = [b"h0", b"h1"]


def save_a_step(w: Worker, layers: list[torch.Tensor], device: str, warm_up: bool = False) -> bytes:
    """A step whose forward writes the request's blocks and whose next step overwrites
    them at once (they were freed and reallocated): what it saved must be the first.
    On CUDA the forward's writes wait on the compute stream behind a long kernel while
    the host goes on, so a save that did not wait for that stream would copy stale
    blocks; nothing here makes the host wait for the device."""
    fresh = random_bits(device, seed=1)
    want = blocks_bytes(fresh, SAVED)
    idx = torch.tensor(SAVED, device=device)
    hold_the_device(device)
    for layer, new in zip(layers, fresh, strict=True):
        layer.index_copy_(0, idx, new.index_select(0, idx))  # the forward's writes
    if device == "cuda" and not warm_up:
        assert not torch.cuda.current_stream().query()  # still queued when the save starts
    w.step(saves=[SaveSpec("r", HASHES, 0, 2 * CHUNK, SAVED)])
    w.wait_for_save()
    if device == "cpu":  # the next step's handle_preemptions waits for the gather
        w.handle_preemptions(RayKVConnectorMetadata(writes=set(SAVED)))
    for layer in layers:
        layer.index_fill_(0, idx, 0)  # the next step's forward reuses the blocks
    w.drain()
    return want


def test_a_steps_saves_are_the_bytes_its_forward_wrote(worker):
    w, layers, device = worker
    want = save_a_step(w, layers, device)
    assert w._kv.puts == 1 and w.saved_chunks == 2
    got = [w._kv.chunks[s.key][0] for s in w._kv.hashed_spans(HASHES, [CHUNK, 2 * CHUNK])]
    per_chunk = [blocks_bytes_of(want, i) for i in range(2)]
    assert got == per_chunk


def blocks_bytes_of(payload: bytes, chunk: int) -> bytes:
    """Chunk `chunk`'s share of `blocks_bytes(layers, SAVED)` (layer-major, two blocks a
    chunk), as the chunk's own payload lays it out."""
    per_layer = len(payload) // LAYERS
    per_block = per_layer // len(SAVED)
    return b"".join(
        payload[i * per_layer + chunk * 2 * per_block : i * per_layer + (chunk + 1) * 2 * per_block]
        for i in range(LAYERS)
    )


@pytest.mark.parametrize("sync", [False, True], ids=["async", "in-step"])
def test_a_load_writes_the_saved_bytes_into_other_blocks_and_nothing_else(worker, sync):
    w, layers, device = worker
    want = save_a_step(w, layers, device)
    before = [layer.clone() for layer in layers]
    target = [10, 11, 20, 13]
    w.step(loads=[LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=sync)])
    w.handle_preemptions(w._get_connector_metadata())
    w.start_load_kv(None)
    if sync:  # the forward reads the blocks right after start_load_kv
        got = blocks_bytes(layers, target)
        assert "q" not in w._loads
    else:
        reported = wait_reported(w, "q")
        assert reported == {"q"} and w.get_finished(set()) == (None, None)  # once
        got = blocks_bytes(layers, target)
    assert got == want and w.get_block_ids_with_load_errors() == set()
    others = [b for b in range(BLOCKS) if b not in target]
    assert blocks_bytes(layers, others) == blocks_bytes(before, others)
    assert w.loaded_tokens == 2 * CHUNK and w.failed_tokens == 0


@pytest.mark.parametrize("sync", [True, False], ids=["in-step", "async"])
def test_a_load_lands_after_the_earlier_steps_writes_to_its_blocks(worker, sync):
    """The blocks a load is handed may have been freed by a request whose kernels (or
    vLLM's zeroing of them) still wait on the compute stream: the load must land after
    them. On CUDA those writes wait behind a long kernel while the host goes on."""
    w, layers, device = worker
    want = save_a_step(w, layers, device)
    target = [10, 11, 20, 13]
    blocks = torch.tensor(target, device=device)  # (from a list the host would wait)
    engine = contextlib.nullcontext()
    if device == "cuda":  # vLLM's engine thread runs on a stream of its own; the loader
        stream = torch.cuda.Stream()  # thread's current stream is the default one
        stream.wait_stream(torch.cuda.current_stream())
        engine = torch.cuda.stream(stream)
    with engine:
        hold_the_device(device)
        for layer in layers:
            layer.index_fill_(0, blocks, 0)  # an earlier step's
        if device == "cuda":
            assert not torch.cuda.current_stream().query()  # queued when the load starts
        w.step(loads=[LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=sync)])
        w.handle_preemptions(w._get_connector_metadata())
        w.start_load_kv(None)
        if not sync:
            assert wait_reported(w, "q") == {"q"}
        got = blocks_bytes(layers, target)  # read on the engine's stream, after both
    assert got == want


def test_an_async_load_starts_once_and_on_cpu_before_the_forward(worker):
    """On CPU the load starts in handle_preemptions, beside the step's forward (vLLM's
    start_load_kv comes after the forward, a whole step later there); on CUDA after the
    forward's launch. start_load_kv never starts it twice."""
    w, layers, device = worker
    want = save_a_step(w, layers, device)
    reads = []
    get_chunks = w._kv.get_chunks
    w._kv.get_chunks = lambda spans, lookup_id=None, **kw: reads.append(1) or get_chunks(spans)
    target = [10, 11, 20, 13]
    w.step(loads=[LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=False)])
    w.handle_preemptions(w._get_connector_metadata())
    assert ("q" in w._loads) == (device == "cpu")
    w.start_load_kv(None)  # the forward ran in between
    assert wait_reported(w, "q") == {"q"}
    assert reads == [1] and blocks_bytes(layers, target) == want


def test_an_async_load_timed_out_in_its_queue_reads_nothing_and_frees_its_pins(worker):
    """The load time-out counts from the load's submission: one that waited in the
    loader's queue past it (or was aborted there) is reported failed without reading,
    and its lookup's pins are released (its read would have released them)."""
    w, layers, device = worker
    save_a_step(w, layers, device)
    reads, unpinned = [], []
    w._kv.get_chunks = lambda *a, **kw: reads.append(1) or ([], [])
    w._kv.unpin = lambda lookup_id, wait=True: unpinned.append(lookup_id)
    w.config.load_timeout_ms = 50
    spec = LoadSpec("q", "lookup-q", HASHES, 0, 2 * CHUNK, [10, 11, 20, 13], sync=False)
    failed = w._load(spec, threading.Event(), time.perf_counter() - 0.1)
    assert failed == {10, 11, 20, 13} and reads == [] and unpinned == ["lookup-q"]
    assert w.failed_tokens == 2 * CHUNK


def test_an_in_step_load_reads_for_at_most_the_lookup_timeout(worker):
    """A load in the step (the engine waits for it) gives its read `lookup_timeout_ms`:
    the read is bounded by it (a slow manager or object store is a miss, never a step
    held for minutes)."""
    w, layers, device = worker
    save_a_step(w, layers, device)
    timeouts = []
    get_chunks = w._kv.get_chunks
    w._kv.get_chunks = lambda spans, lookup_id=None, timeout=None: (
        timeouts.append(timeout) or get_chunks(spans)
    )
    w.config.lookup_timeout_ms = 200
    target = [10, 11, 20, 13]
    assert w._load(LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=True), None) == set()
    assert len(timeouts) == 1 and 0 < timeouts[0] <= 0.2


def test_a_cpu_load_copies_a_few_chunks_at_a_time_and_ends_between_copies(monkeypatch):
    """On CPU the chunks go `HOST_LOAD_PARTS` to a copy (`PageConnector.load_many`, one
    GIL round trip a layer for a run of them); an abort ends the load between two
    copies, never inside one: the chunks copied are whole, the rest load errors."""
    layers = random_bits("cpu", seed=0)
    w = Worker()
    w.register_kv_caches({f"layer.{i}": t for i, t in enumerate(layers)})
    try:
        want = save_a_step(w, layers, "cpu")
        calls, abort = [], threading.Event()
        real = w._pages.load_many

        def load_many(parts):
            calls.append(len(parts))
            real(parts)
            abort.set()  # the request is aborted while this copy runs

        monkeypatch.setattr(w._pages, "load_many", load_many)
        target = [10, 11, 20, 13]
        spec = LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=False)
        assert w._load(spec, threading.Event()) == set() and calls == [2]  # one copy
        assert blocks_bytes(layers, target) == want
        for layer in layers:
            layer.index_fill_(0, torch.tensor(target), 0)
        calls.clear()
        abort.clear()
        monkeypatch.setattr(vllm_worker, "HOST_LOAD_PARTS", 1)
        assert w._load(spec, abort) == {20, 13} and calls == [1]
        assert blocks_bytes(layers, [10, 11]) == blocks_bytes_of(want, 0)
        assert not any(layer[[20, 13]].view(torch.int16).any() for layer in layers)
    finally:
        w.close()


@pytest.mark.parametrize(
    ("first_s", "second_s", "wait_ms", "reported"),
    [
        (0.0, 0.05, 200, True),  # ends well within the wait: reported by this step
        (0.0, 0.05, 0, False),  # load_wait_ms 0: never waited for
        (0.1, 0.1, 20, False),  # at its rate it ends past the wait: not waited for at all
    ],
)
def test_a_steps_end_waits_only_for_a_load_about_to_end(
    monkeypatch, first_s, second_s, wait_ms, reported
):
    """`load_wait_ms`: `get_finished` waits (that long in all) for the async loads that,
    at their rate so far, end within it, so their requests run a step sooner; a load
    that would not end in time is not waited for (the step's end is not held)."""
    layers = random_bits("cpu", seed=0)
    w = Worker()
    w.config.load_wait_ms = wait_ms
    w.register_kv_caches({f"layer.{i}": t for i, t in enumerate(layers)})
    try:
        save_a_step(w, layers, "cpu")
        real, copies = w._pages.load_many, []

        def load_many(parts):
            time.sleep(first_s if not copies else second_s)
            copies.append(len(parts))
            real(parts)

        monkeypatch.setattr(w._pages, "load_many", load_many)
        monkeypatch.setattr(vllm_worker, "HOST_LOAD_PARTS", 1)  # two copies, one a chunk
        w.step(loads=[LoadSpec("q", None, HASHES, 0, 2 * CHUNK, [10, 11, 20, 13], sync=False)])
        w.handle_preemptions(w._get_connector_metadata())
        progress = w._loads["q"].progress
        deadline = time.monotonic() + 10
        while progress.done == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the first copy is done: the load has a rate
        t0 = time.perf_counter()
        _, done = w.get_finished(set())
        held = time.perf_counter() - t0
        assert (done == {"q"}) == reported and w.load_waits == int(reported)
        assert held < (wait_ms / 1000 + 0.02 if reported else 0.02)
        if not reported:
            wait_reported(w, "q")
        assert w.get_block_ids_with_load_errors() == set()
    finally:
        w.close()


def wait_reported(w: Worker, req_id: str) -> set[str]:
    """`get_finished` each "step" until it reports the async load of `req_id`."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, done = w.get_finished(set())
        if done:
            return done
        time.sleep(0.005)
    raise AssertionError(f"the load of {req_id} was never reported")


@pytest.mark.parametrize("sync", [False, True], ids=["async", "in-step"])
@pytest.mark.parametrize("direct_from", [0, CHUNK], ids=["all-files", "cached-then-file"])
def test_a_load_reads_its_disk_run_from_the_files(worker, sync, direct_from, tmp_path):
    """`disk_direct_reads`: the chunks from `direct_from` on are read from the disk
    tier's files (a real DiskStore wrote them; the cache no longer has them), the rest
    from the cache, and the blocks get the saved bytes. On CUDA from fresh host arrays
    (a copy may still read one), on CPU from the reader's reused buffers."""
    w, layers, device = worker
    want = save_a_step(w, layers, device)
    spans = w._kv.hashed_spans(HASHES, [CHUNK, 2 * CHUNK])
    on_disk = [s.key for s in spans if s.end > direct_from]
    store = DiskStore(tmp_path, 1 << 24, model_name="m")
    held = [w._kv.chunks.pop(k) for k in on_disk]
    store.put(on_disk, [m for _, m in held], [np.frombuffer(b, np.uint8) for b, _ in held])
    assert store.flush(10)
    w._disk = DiskReader(store.directory, reuse=not w._pages.batched)
    target = [10, 11, 20, 13]
    spec = LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=sync, direct_from=direct_from)
    w.step(loads=[spec])
    w.handle_preemptions(w._get_connector_metadata())
    w.start_load_kv(None)
    if not sync:
        assert wait_reported(w, "q") == {"q"}
    assert blocks_bytes(layers, target) == want and w.get_block_ids_with_load_errors() == set()
    assert w._disk.read_bytes > 0 and w.failed_tokens == 0
    os.unlink(chunk_path(store.directory, on_disk[-1]))  # evicted: its blocks fail alone
    w.step(loads=[LoadSpec("r", None, HASHES, 0, 2 * CHUNK, [5, 6, 7, 8], sync, 0, direct_from)])
    w.handle_preemptions(w._get_connector_metadata())
    w.start_load_kv(None)
    if not sync:
        assert wait_reported(w, "r") == {"r"}
    assert w.get_block_ids_with_load_errors() == {7, 8} and w.failed_tokens == CHUNK
    assert w._kv.told == [([], [on_disk[-1]])]  # the gone file: the disk tier drops it
    store.close()


def test_a_chunk_the_cache_lacks_makes_its_blocks_load_errors_only(worker):
    w, layers, device = worker
    want = save_a_step(w, layers, device)
    del w._kv.chunks[w._kv.hashed_spans(HASHES, [CHUNK, 2 * CHUNK])[1].key]
    target = [4, 5, 6, 8]
    w.step(loads=[LoadSpec("q", None, HASHES, 0, 2 * CHUNK, target, sync=False)])
    w.start_load_kv(None)
    assert wait_reported(w, "q") == {"q"}
    assert w.get_block_ids_with_load_errors() == {6, 8}
    assert blocks_bytes(layers, [4, 5]) == blocks_bytes_of(want, 0)
    assert w.loaded_tokens == CHUNK and w.failed_tokens == CHUNK
