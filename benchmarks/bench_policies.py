"""Simulator speed per policy vs libCacheSim and cachetools, measured in one run.

    python -m benchmarks.bench_policies            # 1M-request Zipf-1.0 trace, 1% size
    python -m benchmarks.bench_policies --quick    # 200k requests, fewer repeats
    python -m benchmarks.bench_policies --json out.json   # + a summary with miss-ratio curves

Each figure is a median over repeats. libCacheSim is timed with its own
``process_trace`` on an oracleGeneral file (its default C loop, trace reading
included); cachetools with a plain ``LRUCache`` get/set loop. Also times
``evict`` on 1M entries of which 50% are pinned. With ``--json``, also replays the
same trace through every policy at 0.1%..20% of the unique objects with
``raykv.simulate.run`` (the machinery of ``raykv simulate``) for miss-ratio curves.

Goals: LRU, FIFO, SIEVE and S3-FIFO >= 1.0x libCacheSim's default LRU loop; no
policy below 1M req/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._util import Summary, median_seconds  # noqa: E402
from raykv.policies import known_policies, make_policy  # noqa: E402

TITLE = "Eviction policies"
NOTES = """\
Hand-written analysis (figures quoted here are from the full run of 2026-11-22, not
from this report's run): S3-FIFO reached 0.90x libCacheSim's LRU loop but 2.25x
libCacheSim's own S3-FIFO. ARC, Priority and MRU run close to the 1M req/s line:
they go through the protocol methods, without a fast path. The fast paths
(`Policy.simulate`) are tested to give the same miss counts as the protocol path.
`evict` with 1M entries, every other one pinned: 0.30 us per victim (LRU), 0.44 (LFU),
0.91 (SIEVE), 2.30 (S3-FIFO).

Miss ratios agree with libCacheSim exactly for LRU, FIFO, LFU, SIEVE, CLOCK, ARC and
S3-FIFO (`S3FIFOv0`, move-to-main threshold 2) on Zipf 0.8/1.0/1.2, scan-polluted and
loop traces at 0.1%, 1% and 10% of the unique objects; SLRU within 0.015 of
libCacheSim's 2-segment SLRU (see `tests/conformance/`).
"""
FAST_GOAL = ("lru", "fifo", "sieve", "s3fifo")  # >= 1.0x libCacheSim's LRU loop
CURVE_SIZES = "0.1%,0.5%,1%,2%,5%,10%,20%"

# libCacheSim's class for each of our policies, where it has one.
LCS_NAMES = {
    "lru": "LRU",
    "fifo": "FIFO",
    "lfu": "LFU",
    "sieve": "Sieve",
    "clock": "Clock",
    "arc": "ARC",
    "s3fifo": "S3FIFOv0",
    "slru": "SLRU",
}


def zipf_ids(n: int, m: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = np.arange(1, m + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), m - 1)
    return rng.permutation(m).astype(np.uint64)[ranks] + 1


def libcachesim_runner(ids: np.ndarray, size: int, name: str) -> Callable[[], object] | None:
    try:
        import libcachesim as lcs
    except ImportError:
        return None
    fd, path = tempfile.mkstemp(suffix=".oracleGeneral")
    os.close(fd)
    rec = np.zeros(len(ids), dtype=[("t", "<u4"), ("id", "<u8"), ("s", "<u4"), ("n", "<i8")])
    rec["t"], rec["id"], rec["s"], rec["n"] = np.arange(len(ids)), ids, 1, -1
    rec.tofile(path)
    lp = lcs.libcachesim_python

    def make():
        params = lcs.CommonCacheParams(size)
        if name == "S3FIFOv0":
            return lcs.CacheBase(lp.S3FIFOv0_init(params, "move-to-main-threshold=2"))
        if name == "SLRU":
            return lcs.CacheBase(lp.SLRU_init(params, "seg-size=1:4"))
        return lcs.CacheBase(getattr(lp, f"{name}_init")(params, ""))

    def run():
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        return make().process_trace(reader)

    run.path = path  # type: ignore[attr-defined]
    return run


def cachetools_runner(ids: list, size: int) -> Callable[[], int] | None:
    try:
        from cachetools import LRUCache
    except ImportError:
        return None

    def run() -> int:
        cache, misses = LRUCache(size), 0
        get = cache.get
        for key in ids:
            if get(key) is None:
                misses += 1
                cache[key] = True
        return misses

    return run


def bench_pinned_evict(n: int, repeats: int, summary: Summary) -> None:
    """Microseconds per victim of `evict` when every other entry is pinned."""
    print(f"\nevict with {n:,} entries, 50% pinned (every other key), median of {repeats}:")
    for name in ("lru", "sieve", "s3fifo", "lfu"):
        policy = make_policy(name, n)
        for key in range(n):
            policy.insert(key)

        def can_evict(key: int) -> bool:
            return key & 1 == 1

        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            victims = policy.evict(100, can_evict)
            times.append((time.perf_counter() - t0) / max(1, len(victims)))
            for key in victims:
                policy.insert(key)
        print(f"  {name:7s} {statistics.median(times) * 1e6:8.2f} us per victim")
        summary.row(
            f"evict {name}, {n:,} entries, 50% pinned", statistics.median(times) * 1e6, "us"
        )


def miss_ratio_curves(ids: list, summary: Summary) -> None:
    """Miss ratio of every policy over cache sizes, via `raykv simulate`'s machinery."""
    from raykv import simulate

    sizes = simulate.parse_sizes(CURVE_SIZES, len(set(ids)))
    results = simulate.run(ids, known_policies(), sizes, progress=False)
    print(f"\nmiss ratios over cache sizes ({CURVE_SIZES} of the unique objects):")
    print(simulate.format_table(results))
    series: dict[str, list[list[float]]] = {}
    for r in results:
        series.setdefault(r.policy, []).append([r.size, r.miss_ratio])
    summary.plot(
        "policies_miss_ratio",
        "Miss ratio vs cache size, Zipf-1.0 trace",
        "cache size (objects)",
        "miss ratio",
        series,
        xscale="log",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200k requests, 3 repeats")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", help="write a summary (and miss-ratio curves) to this file")
    args = ap.parse_args(argv)
    summary = Summary()
    n = args.requests or (200_000 if args.quick else 1_000_000)
    repeats = args.repeats or (3 if args.quick else 5)
    ids_np = zipf_ids(n, n // 5, 1.0, seed=1)
    ids = ids_np.tolist()
    unique = len(np.unique(ids_np))
    size = max(1, unique // 100)
    print(
        f"Zipf-1.0 trace: {n:,} requests, {unique:,} unique, size {size} (1%), "
        f"median of {repeats} runs\n"
    )

    base_run = libcachesim_runner(ids_np, size, "LRU")
    base = n / median_seconds(base_run, repeats, warmup=0) if base_run else None
    ct_run = cachetools_runner(ids, size)
    ct = n / median_seconds(ct_run, repeats, warmup=0) if ct_run else None
    if base:
        print(f"baseline libCacheSim LRU process_trace: {base / 1e6:6.2f} M req/s")
    if ct:
        print(f"baseline cachetools.LRUCache loop:      {ct / 1e6:6.2f} M req/s")
    header = f"\n{'policy':9s} {'raykv Mreq/s':>12s} {'vs lcs LRU':>10s} {'lcs same':>9s}"
    print(header + f" {'vs same':>8s} {'vs cachetools':>13s}")
    slowest = (float("inf"), "")
    for name in known_policies():
        policy = make_policy(name, size)
        ours = n / median_seconds(lambda p=policy: p.simulate(ids), repeats, warmup=0)
        same = None
        if name in LCS_NAMES:
            run = libcachesim_runner(ids_np, size, LCS_NAMES[name])
            same = n / median_seconds(run, repeats, warmup=0) if run else None
        cells = [
            f"{ours / 1e6:12.2f}",
            f"{ours / base:9.2f}x" if base else f"{'-':>10s}",
            f"{same / 1e6:9.2f}" if same else f"{'-':>9s}",
            f"{ours / same:7.2f}x" if same else f"{'-':>8s}",
            f"{ours / ct:12.2f}x" if ct else f"{'-':>13s}",
        ]
        print(f"{name:9s} " + " ".join(cells))
        if base:
            summary.row(f"{name} simulate", ours / 1e6, "M req/s", "libCacheSim LRU", base / 1e6)
        elif ct:
            summary.row(f"{name} simulate", ours / 1e6, "M req/s", "cachetools LRU", ct / 1e6)
        else:
            summary.row(f"{name} simulate", ours / 1e6, "M req/s")
        if same:
            summary.row(
                f"{name} simulate",
                ours / 1e6,
                "M req/s",
                f"libCacheSim {LCS_NAMES[name]}",
                same / 1e6,
            )
        if name in FAST_GOAL:
            ratio = round(ours / base, 3) if base else "no libCacheSim"
            met = ours >= base if base else None
            summary.goal(f"{name} >= 1.0x libCacheSim's LRU loop", ratio, met)
        slowest = min(slowest, (ours, name))
    summary.goal(
        "no policy below 1M req/s",
        f"slowest: {slowest[1]} {slowest[0] / 1e6:.2f}",
        slowest[0] >= 1e6,
    )
    bench_pinned_evict(200_000 if args.quick else 1_000_000, repeats, summary)
    if args.json:
        miss_ratio_curves(ids, summary)
    summary.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
