"""raykv TTFT demo: a real (small, random-weight) Llama model, cold vs warm time-to-first-token.

    pip install -e ".[demo]"
    python examples/ttft_demo.py [--quick] [--out ttft.png]

Starts a local Ray and a raykv cache (CPU tier), then a `GPUWorker` actor holding the
demo model (on one GPU when the local Ray has one, else on CPU). For each shared-context
length (1k, 4k, 8k tokens; `--quick`: 1k and 4k) it sends two requests with the same
context and different 256-token questions:

* cold: nothing is cached, so the worker prefills the whole prompt (and stores the
  context's KV in raykv, 256 tokens per chunk);
* warm: the worker finds the context in raykv, loads its KV into the model's own
  cache and prefills only the new question (three such requests, each with a new
  question; the table shows their median).

It prints a table (context, cold s, warm s, speedup, hit tokens, tier) and saves a
bar chart to `--out`. About a minute on a 2-core laptop (`--quick`: ~20 s), most of
it the cold 8k prefill. Nothing is downloaded: the model is built from a config.
"""

from __future__ import annotations

import argparse
import os

# Keep this demo's Ray on 127.0.0.1 and quiet.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

import raykv  # noqa: E402
from raykv.demo.gpu_worker import create_gpu_worker  # noqa: E402

QUESTION_TOKENS = 256
WARM_REQUESTS = 3  # warm TTFT is the median of these (cheap, and steadier than one)
NAMESPACE = "raykv-ttft-demo"


def run(contexts: list[int], gpus: float) -> list[dict[str, object]]:
    """Cold then warm request per context length; one row of results each. The model
    worker reserves `gpus` GPUs (Ray hides the GPUs from an actor that reserves none)."""
    config = raykv.RayKVConfig(
        namespace=NAMESPACE,
        model_name="ttft-demo",
        kv_dtype="float32",  # the demo model runs in fp32
        max_local_cpu_size=1.0,
        worker_num_gpus=gpus,
    )
    kv = raykv.connect(config)
    kv.clear()  # a rerun starts cold
    worker = create_gpu_worker(config, seed=0, num_threads=os.cpu_count())
    rng = np.random.default_rng(0)
    rows = []
    try:
        # The first calls of a fresh model pay one-off costs: keep them out of the table.
        warmup = rng.integers(0, 32000, 512)
        for _ in ("cold", "warm"):
            prompt = np.concatenate([warmup, rng.integers(0, 32000, 64)])
            ray.get(worker.generate.remote(prompt, 2))
        for n in contexts:
            context = rng.integers(0, 32000, n)
            results = []
            for _ in range(1 + WARM_REQUESTS):  # the first is cold, the others warm
                prompt = np.concatenate([context, rng.integers(0, 32000, QUESTION_TOKENS)])
                results.append(ray.get(worker.generate.remote(prompt, 4)))
            cold, warm = results[0], results[1:]
            warm_s = float(np.median([w["ttft_s"] for w in warm]))
            rows.append(
                {
                    "context": n,
                    "cold_s": cold["ttft_s"],
                    "warm_s": warm_s,
                    "hit_tokens": warm[-1]["hit_tokens"],
                    "tier": "+".join(warm[-1]["hit_tiers"]) or "-",
                }
            )
            print(f"  {n:>5} tokens: cold {cold['ttft_s']:.2f} s, warm {warm_s:.2f} s")
    finally:
        ray.kill(worker)
        kv.close()
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print(f"\n{'context':>8} {'cold s':>8} {'warm s':>8} {'speedup':>8} {'hit tokens':>11} tier")
    for r in rows:
        speedup = r["cold_s"] / r["warm_s"]  # type: ignore[operator]
        print(
            f"{r['context']:>8} {r['cold_s']:>8.2f} {r['warm_s']:>8.2f} {speedup:>7.1f}x "
            f"{r['hit_tokens']:>11} {r['tier']}"
        )


def plot(rows: list[dict[str, object]], out: str, device: str) -> None:
    """Grouped bars, cold vs warm TTFT per context length, speedup over each pair."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('\nno plot: matplotlib is missing (pip install -e ".[demo]")')
        return
    x = np.arange(len(rows))
    cold = [r["cold_s"] for r in rows]
    warm = [r["warm_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.bar(x - 0.2, cold, 0.4, label="cold (full prefill)", color="#999999")
    ax.bar(x + 0.2, warm, 0.4, label="warm (context KV from raykv)", color="#1f77b4")
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        ax.annotate(f"{c / w:.1f}x", (i + 0.2, w), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [f"{r['context'] // 1024}k" for r in rows])  # type: ignore[operator]
    ax.set_xlabel(f"shared context tokens (+ {QUESTION_TOKENS} new tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"raykv: TTFT of the demo Llama model ({device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"\nplot saved to {os.path.abspath(out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description="raykv TTFT demo: cold vs warm prefill")
    parser.add_argument("--quick", action="store_true", help="1k and 4k contexts only")
    parser.add_argument("--out", default="ttft.png", help="where to save the plot (PNG)")
    args = parser.parse_args()
    contexts = [1024, 4096] if args.quick else [1024, 4096, 8192]

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        print(f"model worker on {'one GPU' if gpus else 'CPU'}")
        rows = run(contexts, gpus)
        print_table(rows)
        plot(rows, args.out, "one GPU" if gpus else "CPU")
    finally:
        ray.shutdown()  # a local Ray: its shutdown stops the cache's (detached) actors too


if __name__ == "__main__":
    main()
