"""Ray Serve LLM serving vLLM with raykv (examples/vllm_serve_app.py), over Serve's
OpenAI HTTP API on loopback. Deployment "b" (one engine) and "a" (two replicas behind
raykv's `CacheAwareRouter`) share one raykv namespace: a prompt "a" prefilled is a raykv
hit on "b", and "a"'s router keeps a prefix on the replica whose vLLM cache holds it.
"b" runs as raykv's `EventsServer`: its engine's KV events (vLLM's blocks and raykv's)
reach a subscriber at the endpoint it advertises, as `EventsRouter` reads them."""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_testing as vt

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

import ray  # noqa: E402
from raykv_testing import free_port  # noqa: E402

import raykv  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_serve_app.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_serve_app_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, int, raykv.KVCache]]:
    from ray import serve

    example = load_example()
    model = str(vt.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    namespace = f"t-serve-llm-{uuid.uuid4().hex[:8]}"
    port = free_port()
    common = dict(
        ray_address=ray.get_runtime_context().gcs_address,
        namespace=namespace,
        chunk_size=vt.CHUNK,
        raykv_settings={"max_local_cpu_size": 0.25},
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        kv_cache_memory_bytes=2 << 20,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    kv = None
    try:
        configs = [
            example.llm_config(model, "a", replicas=2, router="cache_aware", **common),
            example.llm_config(model, "b", events=True, **common),
        ]
        serve.run(example.build_app(configs), name="vllm-raykv", route_prefix="/")
        kv = raykv.connect(namespace=namespace, chunk_size=vt.CHUNK)
        yield example, port, kv
    finally:
        if kv is not None:
            kv.close()
        serve.shutdown()
        shutdown_namespace(namespace)


def stored_chunks(kv: raykv.KVCache) -> int:
    return kv.stats()["tiers"]["cpu"]["entries"]


def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def output(reply: dict[str, Any]) -> dict[str, Any]:
    choice = reply["choices"][0]
    steps = choice["logprobs"]["top_logprobs"]
    return {
        "tokens": list(choice["token_ids"]),
        "logprobs": [{int(k.split(":")[-1]): v for k, v in step.items()} for step in steps],
    }


def test_prompt_prefilled_by_replica_a_is_a_raykv_hit_on_replica_b(served):
    example, port, kv = served
    tokens = vt.prompt(31, 4 * vt.CHUNK + 37)
    before = stored_chunks(kv)
    first = example.complete(port, "a", tokens)
    assert example.cached_tokens(first) == 0
    wait_for(lambda: stored_chunks(kv) >= before + 4, "replica a's chunks in raykv")
    # b's first request: where vLLM's attention runs on AMX, raykv loads nothing into an
    # engine before one of its requests has finished (`RayKVConnector.amx_guard`).
    example.complete(port, "b", vt.prompt(30, vt.BLOCK - 8), max_tokens=1)
    second = example.complete(port, "b", tokens)
    assert example.cached_tokens(second) == 4 * vt.CHUNK  # b never saw it: raykv served it
    vt.assert_same_output(output(second), output(first))
    wait_for(lambda: kv.stats()["open_lookups"] == 0, "pins released")
    assert kv.stats()["tiers"]["cpu"]["pinned_entries"] == 0


def test_cache_aware_router_keeps_a_prefix_on_the_replica_that_holds_it(served):
    """Deployment a has two replicas. The replica that served a document holds it in
    vLLM's own prefix cache, and needs no raykv load for the next question on it; the
    other replica would load it from raykv. So raykv's retrieved-token count stays put
    exactly when every follow-up goes to the replica that served the document."""
    example, port, kv = served
    doc = vt.prompt(41, 6 * vt.CHUNK + 10)
    example.complete(port, "a", doc)
    wait_for(lambda: kv.stats()["open_lookups"] == 0, "first request settled")
    retrieved = kv.stats()["retrieved_tokens"]
    for i in range(5):
        reply = example.complete(port, "a", doc + vt.prompt(50 + i, 20))
        assert example.cached_tokens(reply) >= 6 * vt.CHUNK
    assert kv.stats()["retrieved_tokens"] == retrieved, "a follow-up went to the other replica"


def routing_stats(model_id: str) -> dict[str, Any]:
    """The routing stats model `model_id`'s (one) replica advertises."""
    from ray import serve

    app = serve.status().applications["vllm-raykv"]
    name = next(d for d in app.deployments if d.endswith(f":{model_id}"))
    handle = serve.get_deployment_handle(name, app_name="vllm-raykv")
    return handle.record_routing_stats.remote().result(timeout_s=60)


def test_events_server_publishes_its_engines_blocks_and_raykvs_to_a_subscriber(served):
    from raykv.events_index import BlockIndex, EventSubscriber
    from raykv.serve import EVENTS_STATS_KEY, events_endpoints

    example, port, kv = served
    endpoint, replay = events_endpoints(routing_stats("b")[EVENTS_STATS_KEY])
    assert endpoint.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
    index = BlockIndex()
    subscriber = EventSubscriber(index)
    try:
        subscriber.watch({"b": (endpoint, replay)})
        # What the engine published before (the earlier tests' prompts) comes by replay.
        for seed in range(60, 90):
            example.complete(port, "b", vt.prompt(seed, vt.BLOCK + 5), max_tokens=1)
            if index.sizes()["local"]:
                break
        assert index.sizes()["local"], "no KV event reached the subscriber"
        tokens = vt.prompt(91, 4 * vt.CHUNK + 37)
        before = stored_chunks(kv)
        example.complete(port, "b", tokens)
        ids = index.request_ids(tokens)
        assert len(ids) == len(tokens) // vt.BLOCK
        wait_for(lambda: index.matches(ids, ["b"])[0]["b"] >= len(ids) - 1, "vLLM's blocks")
        wait_for(lambda: stored_chunks(kv) >= before + 4, "b's chunks in raykv")
        # raykv's blocks are reported with a step after the CPU tier admitted them
        full = 4 * vt.CHUNK // vt.BLOCK

        def advertised() -> bool:
            example.complete(port, "b", vt.prompt(92, vt.BLOCK), max_tokens=1)
            return index.matches(ids, ["b"])[1] >= full

        wait_for(advertised, "raykv's blocks advertised")
        assert index.counts["orphans"] == 0 and subscriber.counts["undecodable"] == 0
    finally:
        subscriber.close()
