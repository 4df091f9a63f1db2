"""The manager's own memory over many requests, beside a bare Ray actor's over as many
calls (issue #27: memory that stays flat for days).

    python -m benchmarks.bench_memory [--quick] [--requests N] [--json PATH]

A 30-minute serving soak sends the manager a few thousand requests; whether its memory
is flat needs more. Here one client drives N requests of a serving mix straight at the
manager: a pinned lookup that promotes (`fetch_spans`, the vLLM connector's), then a
retrieve of the prefix on a hit or a store of it on a miss, over 400 prompts of 512
tokens (1 MiB of KV each) and a 100 MB CPU tier, so about a quarter hit and every store
evicts. The manager's USS (its own memory, without the object-store pages it touched)
is sampled 12 times.

Baseline, same run: a bare Ray actor with the manager's actor options (threaded,
`max_concurrency` = the manager's thread count, 0 CPUs) called as often as the manager
was (two calls a request: the lookup, then the retrieve or the store), each call
carrying the lookup's own argument (the request's packed spans). A Ray actor's process
grows in its first thousands of calls (its core worker's buffers, each thread of its
pool touching its stack once) and then stays nearly flat: what the manager grows beyond
that is raykv's.

Figures: USS at start, after the warm-up (the first sixth of the requests) and at the
end, for both; the growth after the warm-up in percent and in KiB per 1000 requests.
"""

from __future__ import annotations

import argparse
import os
import random
import time
import uuid
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks._util import Summary, print_table  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402
from raykv.actors.storage_manager import MANAGER_THREADS  # noqa: E402
from raykv.client.kvcache import connect  # noqa: E402
from raykv.config import RayKVConfig  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402
from raykv.wire import PackedSpans  # noqa: E402

TITLE = "The manager's memory over many requests"
PROMPTS, PROMPT_TOKENS, LAYERS, HIDDEN = 400, 512, 2, 128  # 1 MiB of fp32 KV a prompt
SAMPLES = 12


@ray.remote(num_cpus=0, max_concurrency=MANAGER_THREADS)
class Bare:
    """A Ray actor that does nothing: the baseline for what Ray itself grows."""

    def call(self, _arg: Any) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()


def uss_mib(proc: psutil.Process) -> float:
    return proc.memory_full_info().uss / 2**20


def drive_manager(n: int, seed: int) -> tuple[list[list[float]], dict[str, int]]:
    """N requests of the serving mix; [[requests, USS MiB], ...] and the hit counts."""
    cfg = RayKVConfig.load(
        namespace=f"bench-memory-{uuid.uuid4().hex[:8]}",
        chunk_size=64,
        kv_dtype="float32",
        max_local_cpu_size=0.1,
    )
    kv = connect(cfg)
    try:
        proc = psutil.Process(ray.get(kv._manager.__ray_call__.remote(lambda _: os.getpid())))
        rng = random.Random(seed)
        prompts = [[rng.randrange(30_000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
        out = torch.empty(2, LAYERS, PROMPT_TOKENS, HIDDEN)
        curve, hits = [[0, uss_mib(proc)]], {"hits": 0, "stores": 0}
        every = max(1, n // SAMPLES)
        for i in range(n):
            tokens = prompts[rng.randrange(PROMPTS)]
            lookup_id = uuid.uuid4().hex
            found, _ = kv.fetch_spans(kv.spans(tokens), lookup_id, timeout=10)
            if found:
                kv.retrieve(tokens, out, lookup_id=lookup_id)
                hits["hits"] += 1
            else:
                kv.store(tokens, torch.randn(2, LAYERS, PROMPT_TOKENS, HIDDEN))
                hits["stores"] += 1
            if (i + 1) % every == 0:
                curve.append([i + 1, uss_mib(proc)])
        return curve, hits
    finally:
        shutdown_namespace(cfg.namespace)


def drive_bare(n: int) -> list[list[float]]:
    """Two calls a request to a bare actor, each with a request's packed spans."""
    spans = PackedSpans.of(KeyMaker(chunk_size=64).keys(list(range(PROMPT_TOKENS)))).wire()
    bare = Bare.remote()
    try:
        proc = psutil.Process(ray.get(bare.pid.remote()))
        curve = [[0, uss_mib(proc)]]
        every = max(1, n // SAMPLES)
        for i in range(n):
            ray.get(bare.call.remote(spans))
            ray.get(bare.call.remote(spans))
            if (i + 1) % every == 0:
                curve.append([i + 1, uss_mib(proc)])
        return curve
    finally:
        ray.kill(bare)


def growth(curve: list[list[float]], n: int) -> tuple[float, float, float, float, float]:
    """(USS start, after warm-up, end, % after warm-up, KiB per 1000 requests after it)."""
    warm = min(curve, key=lambda p: abs(p[0] - n / 6))
    end = curve[-1]
    pct = (end[1] / warm[1] - 1) * 100
    per_k = (end[1] - warm[1]) * 1024 / max(end[0] - warm[0], 1) * 1000
    return curve[0][1], warm[1], end[1], pct, per_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,200 requests")
    parser.add_argument("--requests", type=int, default=24_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    args = parser.parse_args()
    n = 1_200 if args.quick else args.requests
    if n < SAMPLES:
        parser.error(f"--requests must be at least {SAMPLES}")
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=512 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        t0 = time.perf_counter()
        manager, hits = drive_manager(n, args.seed)
        seconds = time.perf_counter() - t0
        bare = drive_bare(n)
    finally:
        ray.shutdown()
    report(n, manager, bare, hits, seconds, args.json)


def report(
    n: int,
    manager: list[list[float]],
    bare: list[list[float]],
    hits: dict[str, int],
    seconds: float,
    json_path: str | None,
) -> None:
    print(
        f"{n} requests in {seconds:.0f} s ({hits['hits']} hits, {hits['stores']} stores);"
        f" the bare actor got {2 * n} calls\n"
    )
    rows, figures = [], {}
    for name, curve in (("manager", manager), (f"bare Ray actor ({2 * n} calls)", bare)):
        figures[name] = g = growth(curve, n)
        rows.append([name, *(round(v, 1) for v in g)])
    print_table(
        [
            "process",
            "USS start MiB",
            "after warm-up MiB",
            "end MiB",
            "growth after warm-up %",
            "KiB per 1000 requests",
        ],
        rows,
    )
    print("\nUSS MiB by requests served:")
    print_table(
        ["requests", "manager", "bare Ray actor"],
        [[m[0], round(m[1], 1), round(b[1], 1)] for m, b in zip(manager, bare, strict=True)],
    )
    summary = Summary()
    mgr, base = figures["manager"], next(v for k, v in figures.items() if k != "manager")
    summary.row(
        f"manager USS growth after warm-up ({n} requests)",
        mgr[3],
        "%",
        "bare Ray actor, the same calls",
        base[3],
    )
    summary.row(
        "manager USS growth after warm-up, per 1000 requests",
        mgr[4],
        "KiB",
        "bare Ray actor, the same calls",
        base[4],
    )
    summary.row("manager USS at the end", mgr[2], "MiB", "bare Ray actor", base[2])
    summary.plot(
        "memory",
        "USS of the manager and of a bare Ray actor, by requests served",
        "requests",
        "USS (MiB)",
        series={"manager": manager, "bare Ray actor (2 calls a request)": bare},
    )
    summary.write(json_path)


if __name__ == "__main__":
    main()
