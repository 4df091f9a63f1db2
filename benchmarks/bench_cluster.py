"""Routing a multi-turn chat workload over 2 Serve replicas: random vs pow-2 vs cache-aware.

    python -m benchmarks.bench_cluster [--quick] [--users 12] [--turns 5] [--seed 0] [--json PATH]

Workload (seeded, identical for every router): `users` conversations share one
`--system`-token system prompt. Turn t of a user sends system prompt + the whole history
(every earlier user message and model answer) + a new `--message`-token user message
(a RAG-sized turn), and the model answers `--answer` tokens, which join the history.
Rounds of turns are replayed with the users in a seeded random order per round, two
requests in flight at a time (so the pow-2 router has queue lengths to compare).

Deployment: `raykv.demo.serve_app.build_app(replicas=2, cache_scope="replica")`: each replica
has its OWN raykv namespace (its own StorageManager + CPUStore, an LRU of `--capacity`
chunks), which is what one replica sees on its own node, or in its GPU prefix cache;
on this one machine a shared CPU tier would make every replica see every prefix and
hide the routing. Requests go through a `DeploymentHandle` whose router is one of:
`random` (`raykv.serve.RandomRouter`), `pow2` (Serve's default
`PowerOfTwoChoicesRequestRouter`), `cache_aware` (`raykv.serve.CacheAwareRouter`).

Measured, per router, from each replica's own answer:
* hit tokens: prompt tokens served from the replica's own raykv cache (the looked-up and
  retrieved prefix; a trailing partial chunk and the last token are always prefilled);
* hit rate: hit tokens / prompt tokens;
* mean TTFT: `ttft_s` measured inside the replica (lookup + retrieve + suffix prefill +
  first token), and mean end-to-end request latency seen by the driver.
Goal: cache-aware >= 1.5x the hit tokens of random, and a lower mean TTFT.

Model: the demo Llama architecture, 4 layers, hidden 256, 2 KV heads of 64, vocab 4096,
fp32 on CPU, one torch thread per replica; chunk_size 64.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import Summary, extent, print_table  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402

ROUTERS = ("random", "pow2", "cache_aware")

TITLE = "Cache-aware routing"
CHUNK = 64
MODEL: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
# Bytes of one chunk's KV: K and V x layers x tokens x (kv heads x head dim) x fp32.
CHUNK_BYTES = 2 * MODEL["num_hidden_layers"] * CHUNK * 2 * 64 * 4


@dataclass
class Result:
    """One router's totals."""

    router: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    ttft: list[float] | None = None
    latency: list[float] | None = None
    per_replica: dict[str, int] | None = None


def workload(args: argparse.Namespace) -> list[list[tuple[int, list[int]]]]:
    """Rounds of (user, new message tokens); answers are appended at replay time."""
    rng = random.Random(args.seed)
    vocab = MODEL["vocab_size"]
    rounds = []
    for _ in range(args.turns):
        order = rng.sample(range(args.users), args.users)
        rounds.append([(u, [rng.randrange(vocab) for _ in range(args.message)]) for u in order])
    return rounds


def run_router(router: str, args: argparse.Namespace, rounds: list[Any]) -> Result:
    """Deploy 2 replicas with `router`, replay the workload, tear everything down."""
    from ray import serve

    from raykv.demo.serve_app import build_app

    namespace = f"bench-cluster-{uuid.uuid4().hex[:6]}"
    app_name = f"bench-{router}"
    capacity_gib = args.capacity * CHUNK_BYTES / 1024**3
    app = build_app(
        replicas=2,
        router=router,  # type: ignore[arg-type]
        config={
            "namespace": namespace,
            "chunk_size": CHUNK,
            "kv_dtype": "float32",
            "max_local_cpu_size": capacity_gib,
            "cache_policy": "LRU",
        },
        model=MODEL,
        cache_scope="replica",
        num_cpus=0.5,
        num_threads=1,
        stats_period_s=1.0,
        name_suffix=f"-{router}",
    )
    serve.run(app, name=app_name, route_prefix=None)
    handle = serve.get_deployment_handle(f"KVModelServer-{router}", app_name=app_name)
    rng = random.Random(args.seed + 1)
    vocab = MODEL["vocab_size"]
    system = [random.Random(args.seed + 2).randrange(vocab) for _ in range(args.system)]
    history: dict[int, list[int]] = {u: [] for u in range(args.users)}
    res = Result(router, ttft=[], latency=[], per_replica={})
    replicas: set[str] = set()
    try:
        for turns in rounds:
            for i in range(0, len(turns), args.inflight):
                batch = turns[i : i + args.inflight]
                sent = []
                for user, message in batch:
                    prompt = system + history[user] + message
                    sent.append((user, prompt, time.perf_counter()))
                    sent[-1] += (handle.generate.remote(prompt, args.answer),)
                for user, prompt, t0, response in sent:
                    out = response.result(timeout_s=300)
                    res.latency.append(time.perf_counter() - t0)
                    res.ttft.append(out["ttft_s"])
                    res.requests += 1
                    res.prompt_tokens += len(prompt)
                    res.hit_tokens += out["hit_tokens"]
                    replicas.add(out["replica"])
                    res.per_replica[out["replica"]] = res.per_replica.get(out["replica"], 0) + 1
                    answer = [rng.randrange(vocab) for _ in range(args.answer)]  # seeded "reply"
                    history[user] = prompt[len(system) :] + answer
    finally:
        serve.delete(app_name)
        for rid in replicas:
            shutdown_namespace(f"{namespace}-{rid}")
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 users x 4 turns")
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system", type=int, default=256, help="system prompt tokens")
    parser.add_argument("--message", type=int, default=384, help="user message tokens per turn")
    parser.add_argument("--answer", type=int, default=16, help="generated tokens per turn")
    parser.add_argument("--capacity", type=int, default=130, help="chunks per replica cache")
    parser.add_argument("--inflight", type=int, default=2, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    args = parser.parse_args()
    if args.quick:
        args.users, args.turns = 8, 4
    from ray import serve

    ray.init(
        num_cpus=4,
        object_store_memory=512 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    results = []
    try:
        with socket.socket() as sock:  # a free loopback port for Serve's (unused) HTTP proxy
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        rounds = workload(args)
        for router in args.routers:
            t0 = time.perf_counter()
            results.append(run_router(router, args, rounds))
            print(f"{router}: {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        f"\n{args.users} users x {args.turns} turns, system {args.system}, message "
        f"{args.message}, answer {args.answer}, chunk {CHUNK}, {args.capacity} chunks/replica, "
        f"{args.inflight} in flight, seed {args.seed}\n"
    )
    base = next((r for r in results if r.router == "random"), None)
    rows = []
    for r in results:
        rows.append(
            [
                r.router,
                r.requests,
                r.prompt_tokens,
                r.hit_tokens,
                f"{r.hit_tokens / max(r.prompt_tokens, 1):.2f}",
                f"{r.hit_tokens / base.hit_tokens:.2f}x" if base and base.hit_tokens else "-",
                f"{statistics.mean(r.ttft) * 1000:.1f}",
                f"{statistics.mean(r.latency) * 1000:.1f}",
                "/".join(str(n) for n in sorted(r.per_replica.values())),
            ]
        )
    print_table(
        [
            "router",
            "requests",
            "prompt tok",
            "hit tok",
            "hit rate",
            "vs random",
            "mean TTFT ms",
            "mean latency ms",
            "req/replica",
        ],
        rows,
    )
    summary_of(results).write(args.json)


def summary_of(results: list[Result]) -> Summary:
    """Hit tokens and mean TTFT of every router beside random's, and the routing goal."""
    summary = Summary()
    base = next((r for r in results if r.router == "random"), None)
    for r in results:
        b_hits = base.hit_tokens if base else None
        b_ttft = statistics.mean(base.ttft) * 1000 if base and base.ttft else None
        summary.row(f"{r.router} hit tokens", r.hit_tokens, "tokens", "random router", b_hits)
        ttft = statistics.mean(r.ttft) * 1000 if r.ttft else float("nan")
        rng = extent(r.ttft, 1000) if r.ttft else None
        summary.row(f"{r.router} mean TTFT", ttft, "ms", "random router", b_ttft, rng)
    aware = next((r for r in results if r.router == "cache_aware"), None)
    if base and aware and base.ttft and aware.ttft:
        ratio = aware.hit_tokens / base.hit_tokens if base.hit_tokens else float("inf")
        lower = statistics.mean(aware.ttft) < statistics.mean(base.ttft)
        summary.goal("cache-aware >= 1.5x the hit tokens of random", round(ratio, 3), ratio >= 1.5)
        summary.goal(
            "cache-aware mean TTFT below random's", "lower" if lower else "not lower", lower
        )
    return summary


if __name__ == "__main__":
    main()
