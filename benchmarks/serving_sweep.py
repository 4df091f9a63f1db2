"""The serving benchmark's open-loop rate sweep (`python -m benchmarks.bench_serving
--sweep 0.2,0.4,0.8,1.6 [--arms A,B] [--workloads mrqa]`).

Each arm's app starts once; each workload runs open loop at every rate of the sweep, in
increasing order, each rate with new seeds (nothing one rate stored is asked again at the
next). Reported per arm and rate: the achieved requests/s, TTFT p50 / p99, inter-token
p99 and errors. The issue's goal: the highest swept rate whose TTFT p99 stays under 2x
(A)'s TTFT p99 at the lowest swept rate (its lightly loaded p99: say which rate that is),
for (B) at least 3x (A)'s. At the rate nearest 0.7x (A)'s highest, (B)'s TTFT p50 and
p99 against (A)'s are reported beside it (goals 1/4 and 1/2 on multi-round QA)."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from benchmarks._util import Summary, print_table
from benchmarks.bench_serving import ARMS, llm_config, run_workload, start_app, stop_app

# A rate holds while its TTFT p99 stays under this many times (A)'s at the lowest rate.
P99_FACTOR = 2.0


def sweep(model: str, args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    """{arm: {workload: [(rate, summary), ...]}} (or {arm: {"error": ...}})."""
    out: dict[str, Any] = {}
    for arm in args.arms:
        namespace = f"bench-sweep-{uuid.uuid4().hex[:8]}" if ARMS[arm][2] else None
        config = llm_config(arm, model, namespace or "", args, env["redis_url"])
        try:
            start_app(config, env["port"])
        except Exception as exc:  # one arm failing never hides the others
            out[arm] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            stop_app(namespace)  # a half-started app and its actors go before the next
            continue
        try:
            got: dict[str, list] = {}
            for name in args.workloads:
                for k, rate in enumerate(args.sweep):
                    args.rate = rate
                    summary = run_workload(name, 100 + k, args, env)  # new seeds per rate
                    got.setdefault(name, []).append((rate, summary))
                    print(
                        f"  {arm} {name} at {rate} req/s: {summary['rps']:.2f} req/s served, "
                        f"TTFT p99 {summary['ttft_p99'] * 1e3:.0f} ms, "
                        f"{summary['errors']} errors",
                        flush=True,
                    )
            out[arm] = got
        finally:
            args.rate = None
            stop_app(namespace)
    return out


def highest_rate(runs: list[tuple[float, dict]], limit_s: float) -> float | None:
    """The highest rate of a sweep up to which every rate's TTFT p99 stayed under
    `limit_s` with no errors (None if the lowest did not)."""
    best = None
    for rate, s in sorted(runs, key=lambda r: r[0]):
        if s["errors"] or not s["ttft_p99"] < limit_s:
            break
        best = rate
    return best


def report_sweep(results: dict[str, Any], args: argparse.Namespace, summary: Summary) -> None:
    for name in args.workloads:
        rows = []
        for arm, got in results.items():
            if "error" in got:
                print(f"arm {arm}: {got['error']}")
                continue
            for rate, s in got.get(name, []):
                rows.append(
                    [
                        arm,
                        rate,
                        f"{s['rps']:.2f}",
                        f"{s['ttft_p50'] * 1e3:.0f}",
                        f"{s['ttft_p99'] * 1e3:.0f}",
                        f"{s['itl_p99'] * 1e3:.0f}",
                        s["errors"],
                    ]
                )
        print(f"\n## {name}: open loop, rates {args.sweep} req/s")
        print_table(
            ["arm", "rate req/s", "served req/s", "TTFT p50 ms", "p99", "ITL p99 ms", "errors"],
            rows,
        )
        base = results.get("A", {}).get(name) if "error" not in results.get("A", {}) else None
        if not base:
            continue
        low_rate, low = min(base, key=lambda r: r[0])
        limit = P99_FACTOR * low["ttft_p99"]
        best = {
            arm: highest_rate(got[name], limit)
            for arm, got in results.items()
            if "error" not in got and got.get(name)
        }
        print(
            f"highest rate with TTFT p99 < {P99_FACTOR:g}x A's at {low_rate} req/s "
            f"({limit * 1e3:.0f} ms): "
            + ", ".join(f"{a} {r if r is not None else 'none'}" for a, r in best.items())
        )
        a_best = best.get("A")
        for arm, rate in best.items():
            if arm == "A" or rate is None or not a_best:
                continue
            ratio = rate / a_best
            top = rate == max(args.sweep)
            summary.goal(
                f"sweep {name}: highest rate {arm}/A >= 3 (TTFT p99 < 2x A's at {low_rate})"
                + (" (the sweep's top rate: at least this)" if top else ""),
                round(ratio, 2),
                ratio >= 3,
            )
        if a_best:
            near = min(args.sweep, key=lambda r: abs(r - 0.7 * a_best))
            at = {
                arm: dict(got[name]).get(near) for arm, got in results.items() if "error" not in got
            }
            if at.get("A") and at.get("B"):
                for key, goal in (("ttft_p50", 0.25), ("ttft_p99", 0.5)):
                    ratio = at["B"][key] / at["A"][key]
                    summary.goal(
                        f"sweep {name}: B/A {key} at {near} req/s (~0.7x A's highest) <= {goal}",
                        round(ratio, 3),
                        ratio <= goal,
                    )


__all__ = ["highest_rate", "report_sweep", "sweep"]
