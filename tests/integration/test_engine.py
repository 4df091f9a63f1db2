"""The client API (`raykv.connect`) against real actors: store, lookup, prefetch, retrieve,
masks, pins, layerwise transfer, connector targets and input validation."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import ray
import torch
from raykv_testing import kv_for

import raykv
from raykv.actors.factory import shutdown_namespace
from raykv.errors import InvalidInputError

pytestmark = pytest.mark.usefixtures("ray_session")

C = 16  # chunk size in tokens
L, HEADS, HEAD_DIM = 2, 2, 8
HIDDEN = HEADS * HEAD_DIM


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    """One cache (namespace) for the module: actors start once. Tests use distinct prompts."""
    ns = f"t-eng-{uuid.uuid4().hex[:8]}"
    fields = dict(
        namespace=ns,
        chunk_size=C,
        kv_dtype="float16",
        max_local_cpu_size=0.01,
        local_disk=str(tmp_path_factory.mktemp("disk")),
        max_local_disk_size=0.05,
        use_layerwise=True,
        lookup_timeout_ms=2000,
        blocking_timeout_secs=0.5,
    )
    try:
        yield fields
    finally:
        shutdown_namespace(ns)


VARIANTS = {
    "sync-store": {},
    "staged-store": {"store_staging_size": 0.01},
    "read-cache": {"read_cache_size": 0.01},
}


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def kv(settings, request):
    """A client of the module's cache (cheap: the actors already run). Every test runs with
    synchronous stores, with background stores through a 10 MiB staging ring, and with a
    10 MiB read cache."""
    _SALT[0] = request.param_index
    with raykv.connect(**settings, **VARIANTS[request.param]) as cache:
        yield cache


def wait_until(condition, seconds: float = 10.0) -> None:
    """Poll for a state that a fire-and-forget message brings about."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


_SALT = [0]  # set per `kv` variant, so the variants never share prompts


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, _SALT[0]]).integers(0, 30000, n)


def test_store_then_retrieve_returns_the_same_kv_and_a_prefix_mask(kv):
    tokens = prompt(0, 5 * C + 3)  # the partial chunk is not stored
    full = kv_for(tokens)
    assert kv.store(tokens, full) == 5 * C
    assert kv.lookup(tokens) == 5 * C
    dest = torch.zeros_like(full)
    mask = kv.retrieve(tokens, dest)
    assert mask.tolist() == [True] * 5 * C + [False] * 3
    assert torch.equal(dest[:, :, : 5 * C], full[:, :, : 5 * C])
    assert not dest[:, :, 5 * C :].any()


def test_a_shared_prefix_is_a_hit_for_a_different_suffix(kv):
    base = prompt(1, 4 * C)
    kv.store(base, kv_for(base))
    other = np.concatenate([base[: 2 * C], prompt(2, 3 * C)])
    assert kv.lookup(other) == 2 * C
    dest = torch.zeros(2, L, len(other), HIDDEN, dtype=torch.float16)
    mask = kv.retrieve(other, dest)
    assert mask.sum() == 2 * C
    assert torch.equal(dest[:, :, : 2 * C], kv_for(other)[:, :, : 2 * C])


def test_mask_skips_leading_chunks_on_store(kv):
    tokens = prompt(3, 4 * C)
    mask = np.zeros(len(tokens), dtype=bool)
    mask[2 * C :] = True
    kv.store(tokens, kv_for(tokens), mask=mask)
    assert kv.lookup(tokens) == 0  # chunk 0 is missing, so nothing is a usable prefix
    kv.store(tokens[: 2 * C], kv_for(tokens[: 2 * C]))
    assert kv.lookup(tokens) == 4 * C


def test_retrieve_with_mask_fills_only_unmasked_chunks(kv):
    tokens = prompt(4, 4 * C)
    full = kv_for(tokens)
    kv.store(tokens, full)
    mask = np.zeros(len(tokens), dtype=bool)
    mask[C:] = True
    dest = torch.zeros_like(full)
    hit = kv.retrieve(tokens, dest, mask=mask)
    assert hit.tolist() == [False] * C + [True] * 3 * C
    assert not dest[:, :, :C].any()
    assert torch.equal(dest[:, :, C:], full[:, :, C:])


def test_prefetch_then_wait_reports_ready_tokens_and_retrieve_uses_them(kv):
    tokens = prompt(5, 3 * C)
    kv.store(tokens, kv_for(tokens))
    lookup_id = kv.prefetch(tokens)
    assert kv.wait(lookup_id, timeout=10) == 3 * C
    dest = torch.zeros(2, L, 3 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(tokens, dest, lookup_id=lookup_id).all()
    assert torch.equal(dest, kv_for(tokens))


def test_wait_on_an_unknown_id_is_zero_not_an_error(kv):
    assert kv.wait("no-such-lookup", timeout=0.1) == 0


def test_a_miss_is_a_return_value(kv):
    tokens = prompt(6, 2 * C)
    assert kv.lookup(tokens) == 0
    dest = torch.zeros(2, L, 2 * C, HIDDEN, dtype=torch.float16)
    assert not kv.retrieve(tokens, dest).any()
    assert kv.lookup([]) == 0


def test_pinned_lookup_is_released_by_retrieve(kv):
    tokens = prompt(7, 2 * C)
    kv.store(tokens, kv_for(tokens))
    assert kv.lookup(tokens, pin=True) == 2 * C
    assert kv._pins
    dest = torch.zeros(2, L, 2 * C, HIDDEN, dtype=torch.float16)
    assert kv.retrieve(tokens, dest).all()
    assert not kv._pins
    wait_until(lambda: ray.get(kv._manager.stats.remote())["tiers"]["cpu"]["pinned_entries"] == 0)


def test_disk_hit_after_cpu_eviction_gives_the_same_bytes(kv):
    tokens = prompt(8, 8 * C)
    full = kv_for(tokens)
    kv.store(tokens, full)
    kv.flush()
    ray.get(kv._manager.remove.remote([s.key for s in kv.spans(tokens)], ["cpu"]))
    dest = torch.zeros_like(full)
    hit, tiers = kv.retrieve(tokens, dest, return_tiers=True)
    assert hit.all() and tiers == {"disk": 8 * C}
    assert torch.equal(dest, full)
    _, tiers = kv.retrieve(tokens, torch.zeros_like(full), return_tiers=True)
    assert tiers == {"cpu": 8 * C}  # promoted


def test_the_read_cache_serves_repeat_reads_and_never_a_chunk_the_manager_dropped(settings):
    with raykv.connect(**settings, read_cache_size=0.01) as kv:
        tokens = prompt(30, 4 * C)
        full = kv_for(tokens)
        kv.store(tokens, full)
        for _ in range(3):
            dest = torch.zeros_like(full)
            assert kv.retrieve(tokens, dest).all() and torch.equal(dest, full)
        client = kv.stats()["client"]
        assert client["read_cache_misses"] >= 1 and client["read_cache_hits"] >= 2
        assert client["read_cache_bytes"] > 0
        # Gone from every tier: the held object must not make it a hit.
        kv._manager.remove.remote([s.key for s in kv.spans(tokens)])
        wait_until(lambda: kv.lookup(tokens) == 0)
        assert not kv.retrieve(tokens, torch.zeros_like(full)).any()
        kv.clear()
        assert kv.stats()["client"]["read_cache_bytes"] == 0


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_list_of_chunks_and_connector_targets_round_trip(kv, device):
    tokens = prompt(9, 3 * C)
    full = kv_for(tokens)
    chunks = [full[:, :, i * C : (i + 1) * C].contiguous() for i in range(3)]
    kv.store(tokens, chunks)
    conn = raykv.GPUConnector(
        L, HEADS, HEAD_DIM, torch.float16, device, layout="paged", block_size=4
    )
    buffers = conn.allocate_buffers(32)
    slots = torch.randperm(32 * 4)[: 3 * C]
    assert kv.retrieve(tokens, raykv.KVTarget(conn, buffers, slots)).all()
    out = conn.to_payloads(buffers, [(0, 3 * C)], slots)[0]
    assert torch.equal(out, full)


@pytest.mark.parametrize("device", DEVICES)
def test_layerwise_store_and_retrieve_match_whole_transfers(kv, device):
    tokens = prompt(10 if device == "cpu" else 16, 2 * C)  # each device stores its own
    full = kv_for(tokens)
    conn = raykv.GPUConnector(L, HEADS, HEAD_DIM, torch.float16, device, layout="contiguous")
    src = conn.allocate_buffers(2 * C)
    conn.from_payloads([full], src, [0])
    layers = list(kv.store_layerwise(tokens, raykv.KVTarget(conn, src)))
    assert layers == list(range(L))
    assert kv.lookup(tokens) == 2 * C
    dst = conn.allocate_buffers(2 * C)
    gen = kv.retrieve_layerwise(tokens, raykv.KVTarget(conn, dst))
    seen = []
    try:
        while True:
            seen.append(next(gen))
    except StopIteration as stop:
        hit = stop.value
    assert seen == list(range(L)) and hit.all()
    assert torch.equal(conn.to_payloads(dst, [(0, 2 * C)])[0], full)


@pytest.mark.parametrize(
    "bad_tokens",
    [[[1, 2], [3, 4]], [1.5, 2.5], "abc", [-1, 2]],
)
def test_bad_tokens_raise_invalid_input(kv, bad_tokens):
    with pytest.raises(InvalidInputError):
        kv.lookup(bad_tokens)


def test_bad_kv_raises_with_expected_and_actual(kv):
    tokens = prompt(11, 2 * C)
    with pytest.raises(InvalidInputError, match="dtype torch.float32, expected torch.float16"):
        kv.store(tokens, kv_for(tokens).float())
    with pytest.raises(InvalidInputError, match="covers 16 tokens, expected at least 32"):
        kv.store(tokens, kv_for(tokens)[:, :, :C])
    with pytest.raises(InvalidInputError, match="KV_2LTD"):
        kv.store(tokens, kv_for(tokens)[0])
    with pytest.raises(InvalidInputError, match="got 1 KV chunks for 2 chunks"):
        kv.store(tokens, [kv_for(tokens)[:, :, :C]])
    kv.store(tokens, kv_for(tokens))
    wrong = torch.zeros(2, L + 1, 2 * C, HIDDEN, dtype=torch.float16)
    with pytest.raises(InvalidInputError, match="3 layers x 16 hidden, expected 2 x 16"):
        kv.retrieve(tokens, wrong)


def test_chunks_of_another_layout_under_the_same_model_name_are_a_miss(settings):
    tokens = prompt(15, 2 * C)
    with raykv.connect(**settings) as writer:
        writer.store(tokens, kv_for(tokens))
    with raykv.connect(**settings) as reader:  # a fresh client: its layout comes from dest
        wrong = torch.zeros(2, L + 1, 2 * C, HIDDEN, dtype=torch.float16)
        assert not reader.retrieve(tokens, wrong).any()
        assert not wrong.any()


def test_bad_mask_raises(kv):
    tokens = prompt(12, 2 * C)
    with pytest.raises(InvalidInputError, match="multiple of chunk_size"):
        kv.store(tokens, kv_for(tokens), mask=np.array([False] * 3 + [True] * (2 * C - 3)))


def test_priority_limit_skips_low_priority_requests(settings):
    with raykv.connect(**settings, priority_limit=1) as cache:
        tokens = prompt(13, 2 * C)
        assert cache.store(tokens, kv_for(tokens), priority=5) == 0
        assert cache.lookup(tokens) == 0
        assert cache.store(tokens, kv_for(tokens), priority=1) == 2 * C


def test_closed_client_refuses_requests(kv):
    kv.close()
    with pytest.raises(InvalidInputError, match="closed"):
        kv.lookup(prompt(14, C))


def test_a_staged_store_returns_before_the_put_and_its_own_lookups_see_it(settings):
    with raykv.connect(**settings, store_staging_size=0.01) as kv:
        tokens = prompt(900, 6 * C)
        full = kv_for(tokens)
        assert kv.store(tokens, full) == 6 * C  # accepted: copied into the staging ring
        assert kv.lookup(tokens) == 6 * C  # this client's lookups wait for its stores
        dest = torch.zeros_like(full)
        assert kv.retrieve(tokens, dest).all()
        assert torch.equal(dest, full)
        client = kv.stats()["client"]
        assert client["staged_stores"] == 1 and client["pending_stores"] == 0
        assert client["staging_used_bytes"] == 0  # the ring is free once the put is done


def test_staged_stores_keep_their_bytes_wherever_the_ring_puts_them(settings):
    # The ring's regions start at many offsets (the ring wraps, some stores wait in it),
    # the same offset comes round with another prompt or another chunk length (a trailing
    # partial chunk): the caller's copy goes through a torch view cached per (offset,
    # length), which must never write one store's bytes where another's are read.
    chunk_bytes = 2 * L * C * HIDDEN * 2
    ring = 5 * chunk_bytes + chunk_bytes // 2
    fields = dict(settings, save_unfull_chunk=True)
    with raykv.connect(**fields, store_staging_size=ring / (1 << 30)) as kv:
        rng = np.random.default_rng(7)
        accepted = []
        for i in range(40):
            n = int(rng.integers(1, 3 * C + 1))  # 1-3 chunks, often a partial one
            tokens = prompt(960 + i, n)
            if kv.store(tokens, kv_for(tokens)) == n:
                accepted.append(tokens)
            if i % 3 == 2:
                kv.flush(30)  # sometimes the ring empties and starts at 0 again
        assert len(accepted) >= 20
        for tokens in accepted:
            dest = torch.zeros(2, L, len(tokens), HIDDEN, dtype=torch.float16)
            assert kv.retrieve(tokens, dest).all() and torch.equal(dest, kv_for(tokens))


def test_a_staged_store_that_finds_the_ring_full_is_dropped_and_counted(settings):
    chunk_bytes = 2 * L * C * HIDDEN * 2
    # A ring of one chunk: the second store of a burst finds it still in use.
    with raykv.connect(**settings, store_staging_size=chunk_bytes / (1 << 30)) as kv:
        prompts = [prompt(910 + i, C) for i in range(20)]
        stored = [kv.store(t, kv_for(t)) for t in prompts]
        assert set(stored) <= {0, C} and 0 in stored  # dropped, not waited for
        stats = kv.stats()["client"]
        assert stats["dropped_stores"] == stored.count(0) and stats["pending_stores"] == 0
        for t, n in zip(prompts, stored, strict=True):
            if n:  # what was accepted is served, with the right bytes
                dest = torch.zeros(2, L, C, HIDDEN, dtype=torch.float16)
                assert kv.retrieve(t, dest).all() and torch.equal(dest, kv_for(t))
        # A store bigger than the whole ring is not dropped: it runs in the caller.
        big = prompt(950, 3 * C)
        assert kv.store(big, kv_for(big)) == 3 * C
        assert kv.lookup(big) == 3 * C
