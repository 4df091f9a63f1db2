"""TTFT of the demo Llama model, cold vs warm, per context length and per tier of the prefix.

    python -m benchmarks.bench_ttft [--quick] [--lengths 4096 8192] [--repeats 3] [--json PATH]

For each context length n, each repeat takes a new random n-token prefix and:

* cold: a `ModelWorker.generate` of prefix + a 256-token suffix with nothing cached
  (a full prefill; it also stores the prefix in raykv). Two workers do this, one per
  namespace below, so each repeat gives two cold samples.
* ideal (3 per repeat, interleaved with the warm runs): the suffix-only prefill of a
  new suffix on a `DynamicCache` already holding the prefix's KV (the model's own
  cache, no raykv in the timed part). The ceiling: ideal speedup = cold / ideal.
* warm from cpu / disk / redis (3 each per repeat): `generate` of prefix + a new
  suffix, with the prefix's chunks removed from the tiers above the one under test
  (`manager.remove`) so that every hit comes from it (checked against the retrieve's
  per-tier report). Warm TTFT covers the lookup, the retrieve into the model's cache
  through the connector, the suffix prefill and the first token.

Namespaces: CPU + disk for the cpu and disk rows, CPU + redis for the redis row
(promotion of a redis hit goes to CPU only, so keeping disk out of that namespace
keeps the rows independent). A redis-server is started on a free loopback port and
stopped at the end, even on failure. Everything runs in this process on CPU, fp32,
torch's default threads; the disk tier's files sit in the OS page cache. Before each
timed run, background writes of earlier requests are flushed (`kv.flush()`).

Printed per (length, tier): median cold, warm and ideal seconds, speedup = cold/warm,
ideal speedup = cold/ideal, and the fraction of ideal reached = speedup / ideal
speedup (= ideal/warm). Goals at 4k and 8k: >= 0.8 from CPU, >= 0.6 from disk, >= 0.5
from redis. Then a Markdown section (or, with --json, a summary for `python -m benchmarks`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import Summary, extent, print_table, redis_server_class  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402
from raykv.client.layout import KVTarget  # noqa: E402
from raykv.config import RayKVConfig  # noqa: E402
from raykv.demo.gpu_worker import ModelWorker  # noqa: E402
from raykv.demo.model import cache_from_buffers, prefill_suffix  # noqa: E402

SUFFIX = 256
TIERS = ("cpu", "disk", "redis")
GOALS = {"cpu": 0.8, "disk": 0.6, "redis": 0.5}
WARM_ROUNDS = 3  # ideal and warm samples per prefix (per repeat)

TITLE = "TTFT with the demo model"


@dataclass
class Samples:
    """TTFT samples in seconds of one context length."""

    cold: list[float] = field(default_factory=list)
    ideal: list[float] = field(default_factory=list)
    warm: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TIERS})
    load: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TIERS})


class Bench:
    """Two in-process workers (same seeded model) and the token streams of one run."""

    def __init__(self, disk_dir: str, redis_url: str) -> None:
        base = dict(
            model_name="bench-ttft",
            kv_dtype="float32",
            chunk_size=256,
            max_local_cpu_size=1.0,
            lookup_timeout_ms=10_000,
        )
        tag = uuid.uuid4().hex[:8]
        self.local = ModelWorker(
            RayKVConfig(
                namespace=f"bench-ttft-local-{tag}",
                local_disk=disk_dir,
                max_local_disk_size=2.0,
                **base,
            )
        )
        self.redis = ModelWorker(
            RayKVConfig(namespace=f"bench-ttft-redis-{tag}", remote_url=redis_url, **base)
        )
        self.rng = torch.Generator().manual_seed(0)

    @property
    def namespaces(self) -> list[str]:
        return [w.kv.config.namespace for w in (self.local, self.redis)]

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, 32000, (n,), generator=self.rng)

    def warmup(self) -> None:
        """First calls of each kind are slow (allocator, kernels, actor start): run them once."""
        prefix = self.tokens(512)
        for worker in (self.local, self.redis):
            worker.generate(torch.cat([prefix, self.tokens(64)]), 1)
            worker.generate(torch.cat([prefix, self.tokens(64)]), 1)
        self.forget(prefix)

    def forget(self, prefix: torch.Tensor) -> None:
        """Drop a prefix's chunks from every tier of both namespaces (keeps capacity flat)."""
        for worker in (self.local, self.redis):
            worker.kv.flush()
            keys = [s.key for s in worker.kv.spans(prefix)]
            ray.get(worker.kv._manager.remove.remote(keys))

    def quiesce(self) -> None:
        """Let background disk/redis writes of earlier requests land before a timed run.

        Otherwise a cold run's 64 MiB being written to disk competes with the next timed
        run for the two cores, and the columns measure each other's leftovers.
        """
        for worker in (self.local, self.redis):
            worker.kv.flush()

    def only_in(self, worker: ModelWorker, prefix: torch.Tensor, upper: list[str]) -> None:
        """Remove the prefix from the `upper` tiers so the next hit comes from below."""
        keys = [s.key for s in worker.kv.spans(prefix)]
        ray.get(worker.kv._manager.remove.remote(keys, upper))

    def ideal(self, prefix: torch.Tensor) -> float:
        """Suffix-only prefill on a model cache that already holds the prefix's KV."""
        worker = self.local
        n = len(prefix)
        buffers = worker.connector.allocate_buffers(n)
        assert worker.kv.retrieve(prefix, KVTarget(worker.connector, buffers)).all()
        cache = cache_from_buffers(buffers, worker.model.config)
        self.quiesce()
        t0 = time.perf_counter()
        logits, _ = prefill_suffix(worker.model, cache, self.tokens(SUFFIX), n, logits_to_keep=1)
        int(logits[-1].argmax())
        return time.perf_counter() - t0

    def warm(self, tier: str, prefix: torch.Tensor) -> dict[str, Any]:
        worker = self.redis if tier == "redis" else self.local
        upper = {"cpu": [], "disk": ["cpu"], "redis": ["cpu"]}[tier]
        self.quiesce()
        if upper:
            self.only_in(worker, prefix, upper)
        out = worker.generate(torch.cat([prefix, self.tokens(SUFFIX)]), 1)
        want = {"redis": "remote"}.get(tier, tier)
        if out["hit_tiers"] != {want: len(prefix)}:
            raise RuntimeError(f"{tier} run hit {out['hit_tiers']}, expected all from {want}")
        return out

    def repeat(self, n: int, samples: Samples) -> None:
        prefix = self.tokens(n)
        for worker in (self.local, self.redis):
            self.quiesce()
            out = worker.generate(torch.cat([prefix, self.tokens(SUFFIX)]), 1)
            if out["hit_tokens"]:
                raise RuntimeError("a fresh prefix hit the cache: the cold sample is not cold")
            samples.cold.append(out["ttft_s"])
        # Warm runs are cheap next to the cold prefills: several rounds per prefix,
        # interleaved, so that a burst of noise hits every column alike.
        for _ in range(WARM_ROUNDS):
            samples.ideal.append(self.ideal(prefix))
            for tier in TIERS:
                out = self.warm(tier, prefix)
                samples.warm[tier].append(out["ttft_s"])
                samples.load[tier].append(out["load_s"])
        self.forget(prefix)


def rows_of(results: dict[int, Samples]) -> list[list[Any]]:
    rows = []
    for n, s in results.items():
        cold, ideal = statistics.median(s.cold), statistics.median(s.ideal)
        for tier in TIERS:
            warm = statistics.median(s.warm[tier])
            frac = ideal / warm
            goal = GOALS[tier]
            rows.append(
                [
                    f"{n // 1024}k",
                    tier,
                    round(cold, 3),
                    round(warm, 3),
                    round(statistics.median(s.load[tier]), 3),
                    round(ideal, 3),
                    f"{cold / warm:.1f}x",
                    f"{cold / ideal:.1f}x",
                    f"{frac:.2f}",
                    f"{'met' if frac >= goal else 'MISSED'} (>= {goal})" if n >= 4096 else "-",
                ]
            )
    return rows


def summary_of(results: dict[int, Samples]) -> Summary:
    """Rows (warm TTFT beside cold), goals (fraction of ideal) and the TTFT-vs-length plot."""
    summary = Summary()
    series: dict[str, list[list[float]]] = {"cold (full prefill)": [], "ideal": []}
    for n, s in results.items():
        cold, ideal = statistics.median(s.cold), statistics.median(s.ideal)
        series["cold (full prefill)"].append([n, cold])
        series["ideal"].append([n, ideal])
        summary.row(
            f"{n // 1024}k ideal TTFT (prefix in model cache)",
            ideal,
            "s",
            "cold TTFT",
            cold,
            value_range=extent(s.ideal),
        )
        for tier in TIERS:
            warm = statistics.median(s.warm[tier])
            series.setdefault(f"warm from {tier}", []).append([n, warm])
            summary.row(
                f"{n // 1024}k warm TTFT from {tier}",
                warm,
                "s",
                "cold TTFT",
                cold,
                value_range=extent(s.warm[tier]),
            )
            summary.row(
                f"{n // 1024}k raykv load from {tier}",
                statistics.median(s.load[tier]),
                "s",
                "ideal TTFT",
                ideal,
                value_range=extent(s.load[tier]),
            )
            frac = ideal / warm
            if n < 4096:  # the goals are set at 4k and 8k; shorter contexts only plot
                continue
            summary.goal(
                f"{n // 1024}k from {tier}: fraction of ideal >= {GOALS[tier]}",
                round(frac, 3),
                frac >= GOALS[tier],
            )
    summary.plot(
        "ttft_vs_context",
        "TTFT vs context length per tier (demo model, CPU)",
        "context length (tokens)",
        "TTFT (s)",
        series,
    )
    return summary


HEADERS = [
    "context",
    "tier",
    "cold s",
    "warm s",
    "load s",
    "ideal s",
    "speedup",
    "ideal speedup",
    "fraction of ideal",
    "goal",
]


def markdown(rows: list[list[Any]], args: argparse.Namespace, load: tuple[float, ...]) -> str:
    """The section for docs/BENCHMARKS.md."""
    head = "| " + " | ".join(HEADERS) + " |\n|" + "|".join("---" for _ in HEADERS) + "|\n"
    body = "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows)
    return (
        "## TTFT with the demo model (`python benchmarks/bench_ttft.py`)\n\n"
        f"Run {datetime.date.today()}. Demo Llama (8 layers, hidden 512, 8 heads, 2 KV heads, "
        f"fp32, random weights), {SUFFIX}-token suffix, chunk 256, in-process `ModelWorker` on "
        f"CPU ({torch.get_num_threads()} torch threads), medians over {args.repeats} repeats "
        f"(cold: {2 * args.repeats} samples; ideal and warm: {WARM_ROUNDS * args.repeats}, "
        "interleaved). Ideal = suffix-only prefill on a model cache "
        "already holding the prefix (same run); fraction of ideal = speedup / ideal speedup. "
        "Disk files were in the OS page cache. Load average during the run: "
        f"{', '.join(f'{x:.1f}' for x in load)} (1/5/15 min) on {os.cpu_count()} cores.\n\n"
        + head
        + body
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2k and 4k, 2 repeats")
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="context lengths (default 4096 8192)"
    )
    parser.add_argument("--repeats", type=int, help="repeats per length (default 3)")
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    args = parser.parse_args()
    args.lengths = args.lengths or ([2048, 4096] if args.quick else [4096, 8192])
    args.repeats = args.repeats or (2 if args.quick else 3)

    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, ray {ray.__version__}",
        flush=True,
    )
    redis_server_cls = redis_server_class()
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        server = redis_server_cls(Path(tmp))
        server.start()
        bench: Bench | None = None
        try:
            ray.init(
                address="local",  # a Ray of our own, never a cluster someone else started
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=3 << 30,
                _node_ip_address="127.0.0.1",
            )
            bench = Bench(str(Path(tmp) / "disk"), server.url)
            bench.warmup()
            results: dict[int, Samples] = {}
            for n in args.lengths:
                results[n] = Samples()
                for r in range(args.repeats):
                    t0 = time.perf_counter()
                    bench.repeat(n, results[n])
                    print(
                        f"  {n} tokens, repeat {r + 1}/{args.repeats}: "
                        f"{time.perf_counter() - t0:.1f} s",
                        flush=True,
                    )
            rows = rows_of(results)
            print()
            print_table(HEADERS, rows)
            print()
            if args.json:  # the runner (python -m benchmarks) writes the report itself
                summary_of(results).write(args.json)
            else:
                print(markdown(rows, args, os.getloadavg()))
        finally:
            if bench is not None:
                for ns in bench.namespaces:
                    shutdown_namespace(ns)
            if ray.is_initialized():
                ray.shutdown()
            server.stop()


if __name__ == "__main__":
    main()
