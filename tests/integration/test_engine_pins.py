"""`KVCache` pins against real actors: one pin per pinned lookup (shared prefixes
included), caller-named lookups, `close`, raw `put_chunks`/`get_chunks` payloads (whole
`PAGES` blocks), and attaching to Ray only by explicit address."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from raykv_testing import kv_for

import raykv
from raykv.actors.factory import shutdown_namespace
from raykv.client.attach import attach_ray
from raykv.errors import InvalidInputError
from raykv.page_connector import PageConnector
from raykv.payload import LAYOUT_PAGES, PayloadMeta

pytestmark = pytest.mark.usefixtures("ray_session")

C = 16  # chunk size in tokens
L, HEADS, HEAD_DIM = 2, 2, 8
HIDDEN = HEADS * HEAD_DIM
BLOCK_SIZE = 4  # tokens per engine page: C // BLOCK_SIZE pages per chunk
PAGES_PER_CHUNK = C // BLOCK_SIZE
REPO = Path(__file__).resolve().parents[2]


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n)


def new_settings() -> dict:
    return dict(
        namespace=f"t-pins-{uuid.uuid4().hex[:8]}",
        chunk_size=C,
        kv_dtype="float16",
        max_local_cpu_size=0.01,
        lookup_timeout_ms=2000,
        blocking_timeout_secs=0.5,
    )


@contextlib.contextmanager
def namespace_settings():
    """Settings of a cache (namespace) of its own, whose actors are stopped on exit."""
    fields = new_settings()
    try:
        yield fields
    finally:
        shutdown_namespace(fields["namespace"])


@pytest.fixture
def settings():
    """A cache of its own per test, so pin counts are this test's alone."""
    with namespace_settings() as fields:
        yield fields


@pytest.fixture
def kv(settings):
    with raykv.connect(**settings) as cache:
        yield cache


@pytest.fixture(scope="module")
def shared_settings():
    """One cache for the tests that count no pins (actors start once); distinct prompts."""
    with namespace_settings() as fields:
        yield fields


@pytest.fixture
def shared_kv(shared_settings):
    with raykv.connect(**shared_settings) as cache:
        yield cache


def pin_state(kv) -> tuple[int, int, int]:
    """(open lookups in the manager, leases and pinned entries in the CPU tier)."""
    stats = kv.stats()
    cpu = stats["tiers"]["cpu"]
    return stats["open_lookups"], cpu["leases"], cpu["pinned_entries"]


def wait_for_pins(kv, want: tuple[int, int, int], seconds: float = 5.0) -> None:
    """Poll until the pin state is `want`: pins and releases are sent without waiting."""
    deadline = time.monotonic() + seconds
    while (got := pin_state(kv)) != want:
        assert time.monotonic() < deadline, f"pin state {got}, expected {want}"
        time.sleep(0.05)


def settle_then_check(kv, want: tuple[int, int, int], seconds: float = 0.5) -> None:
    """That the pin state stays `want` (no release is on its way)."""
    time.sleep(seconds)
    assert pin_state(kv) == want


# ----- pins taken by lookups named by the client -----


def test_two_pinned_lookups_sharing_a_prefix_each_hold_their_own_pin(kv):
    system = prompt(100, 2 * C)
    kv.store(system, kv_for(system))
    a = np.concatenate([system, prompt(101, 2 * C)])
    b = np.concatenate([system, prompt(102, 2 * C)])
    # Both hit the same two chunks: the same last hit chunk.
    assert kv.lookup(a, pin=True) == 2 * C
    assert kv.lookup(b, pin=True) == 2 * C
    assert len(kv._pins) == 2
    wait_for_pins(kv, (2, 2, 2))

    dest = torch.zeros(2, L, len(a), HIDDEN, dtype=torch.float16)
    assert kv.retrieve(a, dest).sum() == 2 * C
    assert torch.equal(dest[:, :, : 2 * C], kv_for(system))
    # Only a's pin is released: b's still holds the shared chunks.
    wait_for_pins(kv, (1, 1, 2))
    settle_then_check(kv, (1, 1, 2))
    assert len(kv._pins) == 1

    dest = torch.zeros(2, L, len(b), HIDDEN, dtype=torch.float16)
    assert kv.retrieve(b, dest).sum() == 2 * C
    wait_for_pins(kv, (0, 0, 0))
    assert len(kv._pins) == 0 and not kv._pins._by_key


def test_identical_prompts_pinned_twice_need_two_retrieves(kv):
    cached = prompt(110, 3 * C)
    kv.store(cached, kv_for(cached))
    tokens = np.concatenate([cached, prompt(111, C)])  # a miss after the cached prefix
    assert kv.lookup(tokens, pin=True) == 3 * C
    assert kv.lookup(tokens, pin=True) == 3 * C
    wait_for_pins(kv, (2, 2, 3))
    dest = torch.zeros(2, L, 4 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(tokens, dest).sum() == 3 * C
    wait_for_pins(kv, (1, 1, 3))
    # A retrieve of the hit prefix alone finds the other pin by its last hit chunk.
    assert kv.retrieve(cached, dest).all()
    wait_for_pins(kv, (0, 0, 0))


def test_a_retrieve_of_an_unpinned_prompt_releases_no_pin(kv):
    assert kv.lookup(prompt(140, 2 * C), pin=True) == 0  # a pinned miss opens no pin
    assert not kv._pins
    settle_then_check(kv, (0, 0, 0))
    shared = prompt(120, C)
    kv.store(shared, kv_for(shared))
    longer = np.concatenate([shared, prompt(121, C)])
    kv.store(longer, kv_for(longer))
    assert kv.lookup(shared, pin=True) == C
    wait_for_pins(kv, (1, 1, 1))
    # `longer` ends after the pinned chunk, so its retrieve is the pinned request's.
    dest = torch.zeros(2, L, 2 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(longer, dest).all()
    wait_for_pins(kv, (0, 0, 0))
    # An unrelated prompt's retrieve touches no pin.
    assert kv.lookup(longer, pin=True) == 2 * C
    wait_for_pins(kv, (1, 1, 2))
    other = prompt(122, 2 * C)
    assert not kv.retrieve(other, torch.zeros_like(dest)).any()
    settle_then_check(kv, (1, 1, 2))
    kv.unpin(next(iter(kv._pins)))
    wait_for_pins(kv, (0, 0, 0))


def test_close_releases_every_open_pin(settings, kv):
    system = prompt(130, 2 * C)
    kv.store(system, kv_for(system))
    other = raykv.connect(**settings)
    try:
        assert other.lookup(np.concatenate([system, prompt(131, C)]), pin=True) == 2 * C
        assert other.lookup(np.concatenate([system, prompt(132, C)]), pin=True) == 2 * C
        assert other.lookup(system[:C], pin=True) == C
        wait_for_pins(kv, (3, 3, 2))
        dest = torch.zeros(2, L, 3 * C, HIDDEN, dtype=torch.float16)
        assert other.retrieve(np.concatenate([system, prompt(131, C)]), dest).sum() == 2 * C
        wait_for_pins(kv, (2, 2, 2))
    finally:
        other.close()
    wait_for_pins(kv, (0, 0, 0))
    with pytest.raises(InvalidInputError, match="closed"):
        other.lookup(system)


# ----- caller-named lookups -----


def test_a_caller_named_lookup_is_released_by_get_chunks_with_its_id(kv):
    tokens = prompt(150, 2 * C)
    kv.store(tokens, kv_for(tokens))
    lookup_id = f"x-{uuid.uuid4().hex}"
    assert kv.lookup(tokens, pin=True, lookup_id=lookup_id) == 2 * C
    assert not kv._pins  # the caller's to release, not the client's
    wait_for_pins(kv, (1, 1, 2))

    # A retrieve of the same tokens without the id is another request: the pin stays.
    dest = torch.zeros(2, L, 2 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(tokens, dest).all()
    settle_then_check(kv, (1, 1, 2))
    chunks, tiers = kv.get_chunks(kv.spans(tokens))
    assert len(chunks) == 2 and tiers == ["cpu", "cpu"]
    settle_then_check(kv, (1, 1, 2))

    chunks, tiers = kv.get_chunks(kv.spans(tokens), lookup_id)
    assert len(chunks) == 2 and tiers == ["cpu", "cpu"]
    wait_for_pins(kv, (0, 0, 0))


def test_a_caller_named_lookup_is_released_by_unpin_or_a_retrieve_with_its_id(kv):
    tokens = prompt(160, 2 * C)
    kv.store(tokens, kv_for(tokens))
    first, second = f"y-{uuid.uuid4().hex}", f"z-{uuid.uuid4().hex}"
    assert kv.lookup(tokens, pin=True, lookup_id=first) == 2 * C
    assert kv.lookup(tokens, pin=True, lookup_id=second) == 2 * C
    wait_for_pins(kv, (2, 2, 2))
    kv.unpin(first)
    wait_for_pins(kv, (1, 1, 2))
    dest = torch.zeros(2, L, 2 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(tokens, dest, lookup_id=second).all()
    assert torch.equal(dest, kv_for(tokens))
    wait_for_pins(kv, (0, 0, 0))


def test_client_named_and_caller_named_pins_of_one_prompt_are_independent(kv):
    tokens = prompt(170, 2 * C)
    kv.store(tokens, kv_for(tokens))
    named = f"n-{uuid.uuid4().hex}"
    assert kv.lookup(tokens, pin=True, lookup_id=named) == 2 * C
    assert kv.lookup(tokens, pin=True) == 2 * C
    wait_for_pins(kv, (2, 2, 2))
    dest = torch.zeros(2, L, 2 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(tokens, dest).all()  # releases the client's own pin only
    wait_for_pins(kv, (1, 1, 2))
    settle_then_check(kv, (1, 1, 2))
    kv.unpin(named)
    wait_for_pins(kv, (0, 0, 0))


# ----- raw payloads: put_chunks / get_chunks -----


def page_cache(seed: int, num_blocks: int = 16) -> list[torch.Tensor]:
    """An engine's paged cache: per layer [num_blocks, heads, block_size, 2 * head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen).half()
        for _ in range(L)
    ]


def chunk_pages(conn: PageConnector, n_chunks: int, offset: int = 0):
    """PAGES payloads of chunks 0..n_chunks-1, chunk i in blocks offset + i*P .. +P."""
    out = [
        conn.save(range(offset + i * PAGES_PER_CHUNK, offset + (i + 1) * PAGES_PER_CHUNK))
        for i in range(n_chunks)
    ]
    return [b for b, _ in out], [m for _, m in out]


def test_put_chunks_then_get_chunks_round_trips_raw_pages(shared_kv):
    tokens = prompt(180, 3 * C)
    spans = shared_kv.spans(tokens)
    src = page_cache(1)
    buffers, metas = chunk_pages(PageConnector(src), 3)
    assert metas[0] == PayloadMeta("float16", (L, PAGES_PER_CHUNK, HEADS, BLOCK_SIZE, 16), "PAGES")
    assert shared_kv.put_chunks(spans, buffers, metas) == 3
    assert shared_kv.lookup(tokens) == 3 * C

    chunks, tiers = shared_kv.get_chunks(spans)
    assert tiers == ["cpu"] * 3
    assert [span for span, _, _ in chunks] == spans
    for (_, buf, meta), want, want_meta in zip(chunks, buffers, metas, strict=True):
        assert meta == want_meta and meta.layout == LAYOUT_PAGES
        assert buf.dtype == np.uint8 and buf.ndim == 1
        assert np.array_equal(buf, want)

    # The read-only buffers load straight back into another engine's pages.
    dst = page_cache(2)
    conn = PageConnector(dst)
    for i, (_, buf, meta) in enumerate(chunks):
        conn.load(buf, meta, [15 - i * PAGES_PER_CHUNK - j for j in range(PAGES_PER_CHUNK)])
    for i in range(3):
        for j in range(PAGES_PER_CHUNK):
            for layer in range(L):
                assert torch.equal(
                    dst[layer][15 - i * PAGES_PER_CHUNK - j], src[layer][i * PAGES_PER_CHUNK + j]
                )


def test_get_chunks_returns_the_longest_cached_prefix(shared_kv):
    tokens = prompt(190, 4 * C)
    spans = shared_kv.spans(tokens)
    buffers, metas = chunk_pages(PageConnector(page_cache(3)), 4)
    # Chunks 0, 1 and 3: chunk 2 is missing, so the prefix ends after chunk 1.
    picked = [0, 1, 3]
    stored = shared_kv.put_chunks(
        [spans[i] for i in picked], [buffers[i] for i in picked], [metas[i] for i in picked]
    )
    assert stored == 3
    chunks, tiers = shared_kv.get_chunks(spans)
    assert [span for span, _, _ in chunks] == spans[:2] and tiers == ["cpu", "cpu"]
    assert all(np.array_equal(c[1], b) for c, b in zip(chunks, buffers, strict=False))
    assert shared_kv.lookup(tokens) == 2 * C
    # The first put of a key wins; with chunk 2 in, the whole prompt is a hit.
    assert shared_kv.put_chunks(spans, buffers, metas) == 4
    chunks, _ = shared_kv.get_chunks(spans)
    assert len(chunks) == 4
    assert shared_kv.get_chunks([]) == ([], [])
    assert shared_kv.put_chunks([], [], []) == 0


def test_put_chunks_rejects_bad_lists_metas_and_buffers(shared_kv):
    tokens = prompt(200, 2 * C)
    spans = shared_kv.spans(tokens)
    buffers, metas = chunk_pages(PageConnector(page_cache(4)), 2)
    with pytest.raises(InvalidInputError, match="2 spans, 1 buffers and 2 metas"):
        shared_kv.put_chunks(spans, buffers[:1], metas)
    with pytest.raises(InvalidInputError, match="2 spans, 2 buffers and 1 metas"):
        shared_kv.put_chunks(spans, buffers, metas[:1])
    with pytest.raises(InvalidInputError, match="one buffer and one meta per span"):
        shared_kv.put_chunks(spans[:1], buffers, metas)

    bf16 = PayloadMeta("bfloat16", metas[1].shape, LAYOUT_PAGES)  # same size, other dtype
    assert bf16.nbytes == metas[1].nbytes
    with pytest.raises(InvalidInputError, match="payload 1: meta .* dtype float16"):
        shared_kv.put_chunks(spans, buffers, [metas[0], bf16])
    with pytest.raises(InvalidInputError, match="must be a PayloadMeta"):
        shared_kv.put_chunks(spans, buffers, [metas[0], {"dtype": "float16"}])

    with pytest.raises(InvalidInputError, match=rf"payload 0 .* {metas[0].nbytes} bytes"):
        shared_kv.put_chunks(spans, [buffers[0][:-2], buffers[1]], metas)
    with pytest.raises(InvalidInputError, match="payload 1 must be a flat uint8"):
        shared_kv.put_chunks(spans, [buffers[0], np.concatenate([buffers[1], buffers[1]])], metas)
    as_f16 = buffers[1].view(np.float16)  # the right bytes, but not a uint8 array
    with pytest.raises(InvalidInputError, match="payload 1 must be a flat uint8"):
        shared_kv.put_chunks(spans, [buffers[0], as_f16], metas)
    with pytest.raises(InvalidInputError, match="payload 0 must be a flat uint8"):
        shared_kv.put_chunks(spans, [bytes(buffers[0]), buffers[1]], metas)

    assert shared_kv.lookup(tokens) == 0  # nothing was stored by the rejected calls


# ----- attaching to Ray -----


def test_attach_ray_is_a_no_op_when_ray_is_up(monkeypatch):
    assert ray.is_initialized()
    context = ray.get_runtime_context()
    node, namespace = context.get_node_id(), context.namespace
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    attach_ray(None)
    attach_ray("127.0.0.1:1")  # not even tried: this process is attached already
    assert ray.is_initialized()
    context = ray.get_runtime_context()
    assert (context.get_node_id(), context.namespace) == (node, namespace)


def bare_env() -> dict[str, str]:
    """A child process's environment: this checkout importable, no Ray address and no
    raykv settings inherited, so it attaches only where the test says."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAYKV_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_connect_without_ray_or_an_address_raises_config_error(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        import ray
        import raykv
        from raykv.errors import ConfigError

        try:
            raykv.connect(namespace="t-pins-no-ray")
        except ConfigError as exc:
            print("CONFIG_ERROR:", exc)
            sys.exit(3 if not ray.is_initialized() else 4)
        sys.exit(5)
        """
    )
    env = bare_env()
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "CONFIG_ERROR:" in proc.stdout and "ray_address" in proc.stdout


SEEDED_ENGINE_DRIVER = """
import json, random, sys, time
import ray
from raykv.client.attach import attach_ray

drawn = []
draw = random.getrandbits


def recording(k):
    value = draw(k)
    drawn.append(value)
    return value


random.seed(0)  # as vLLM seeds each worker before its connector attaches to Ray
seeded = random.getstate()
random.getrandbits = recording
attach_ray(sys.argv[1])
random.getrandbits = draw
restored = random.getstate() == seeded
print("attached", flush=True)
sys.stdin.readline()  # both attached: their error listeners poll side by side
cpu = time.process_time()
time.sleep(3.0)
print(json.dumps({"drawn": drawn, "restored": restored, "cpu": time.process_time() - cpu}))
ray.shutdown()
"""


def test_seeded_engines_attach_to_ray_as_drivers_of_their_own(tmp_path):
    """Two processes whose `random` is seeded alike (every vLLM worker: seed 0 by default)
    must not draw the same GCS subscriber ids in `ray.init`: with one id the GCS answers
    each one's long poll at once to serve the other's, and both spin. The seeded state
    comes back unchanged, so an engine samples as it would without raykv."""
    address = ray.get_runtime_context().gcs_address
    env = bare_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SEEDED_ENGINE_DRIVER, address],
            env=env,
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:  # Ray prints nothing to stdout: the first line is the child's
            assert p.stdout.readline().strip() == "attached", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["restored"] for r in reports)
    assert not reports[0]["drawn"] or reports[0]["drawn"] != reports[1]["drawn"]
    # Spinning, each burnt 0.6-2 s of CPU in these 3 s; idle, a few ms.
    assert max(r["cpu"] for r in reports) < 0.4, reports
