"""examples/warm_cache_ray_data.py: a Ray Data job (map_batches over a vLLM engine with the
raykv connector) fills the cache, and a serving engine started afterwards (a process of
its own) hits from its first request, with the output of an engine nobody warmed. A
warming job of another layout (block size) is named in the serving engine's log."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest
import vllm_testing as vt

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

import ray  # noqa: E402

import raykv  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "warm_cache_ray_data.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("warm_cache_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_replica_started_after_a_ray_data_warming_job_hits_from_its_first_request(
    example, tmp_path
):
    from raykv.demo.model import save_demo_model

    model = save_demo_model(
        str(tmp_path), num_hidden_layers=2, vocab_size=4096, max_position_embeddings=8192
    )
    address = ray.get_runtime_context().gcs_address
    ns = f"t-warm-{uuid.uuid4().hex[:8]}"
    # Three whole chunks and a token each: raykv's hits and vLLM's own cache's then
    # cover the same 768 tokens (vLLM caches whole blocks short of the last token).
    docs = example.documents(3, 3 * 256 + 1)
    assert example.warm(model, address, ns, docs) == 3 * len(docs[0])
    # The same model warmed with another block size: keys apart, named in the log.
    example.warm(model, address, ns, docs[:1], block_size=64)

    warmed = example.run_replica(model, address, ns, docs[1])
    unwarmed = example.run_replica(model, address, ns + "-none", docs[1])
    assert warmed["first"]["cached"] == 3 * 256  # from raykv, on its first request
    assert warmed["repeat"]["cached"] == 3 * 256
    assert unwarmed["first"]["cached"] == 0
    # The same answer from raykv's hits, and from raykv's and vLLM's own hits of one KV
    # (the warmed and unwarmed tokens may differ in a near tie: another thread count).
    example.same_answer(warmed["first"], warmed["repeat"])
    assert unwarmed["repeat"]["cached"] == unwarmed["vllm_hit"]["cached"] == 3 * 256
    example.same_answer(unwarmed["repeat"], unwarmed["vllm_hit"])
    [warning] = warmed["layout_warnings"]
    assert "block size 64" in warning and "block size 32" in warning
    assert unwarmed["layout_warnings"] == []


def test_note_engine_names_the_other_layouts_of_the_same_model():
    with raykv.connect(namespace=f"t-engines-{uuid.uuid4().hex[:8]}") as kv:
        assert kv.note_engine("llama~vllm-aaa", "layout A") == {}
        assert kv.note_engine("other~vllm-ccc", "another model") == {}
        assert kv.note_engine("llama~vllm-bbb", "layout B") == {"llama~vllm-aaa": "layout A"}
        assert kv.note_engine("llama~vllm-aaa", "layout A") == {"llama~vllm-bbb": "layout B"}
