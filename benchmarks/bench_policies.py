"""Simulator speed per policy vs libCacheSim and cachetools, measured in one run.

    python benchmarks/bench_policies.py            # 1M-request Zipf-1.0 trace, 1% size
    python benchmarks/bench_policies.py --quick    # 200k requests, fewer repeats

Each figure is a median over repeats. libCacheSim is timed with its own
``process_trace`` on an oracleGeneral file (its default C loop, trace reading
included); cachetools with a plain ``LRUCache`` get/set loop. Also times
``evict`` on 1M entries of which 50% are pinned.
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
from raykv.policies import known_policies, make_policy  # noqa: E402

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


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def bench_pinned_evict(n: int, repeats: int) -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200k requests, 3 repeats")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
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
    base = n / median_time(base_run, repeats) if base_run else None
    ct_run = cachetools_runner(ids, size)
    ct = n / median_time(ct_run, repeats) if ct_run else None
    if base:
        print(f"baseline libCacheSim LRU process_trace: {base / 1e6:6.2f} M req/s")
    if ct:
        print(f"baseline cachetools.LRUCache loop:      {ct / 1e6:6.2f} M req/s")
    header = f"\n{'policy':9s} {'raykv Mreq/s':>12s} {'vs lcs LRU':>10s} {'lcs same':>9s}"
    print(header + f" {'vs same':>8s} {'vs cachetools':>13s}")
    for name in known_policies():
        policy = make_policy(name, size)
        ours = n / median_time(lambda p=policy: p.simulate(ids), repeats)
        same = None
        if name in LCS_NAMES:
            run = libcachesim_runner(ids_np, size, LCS_NAMES[name])
            same = n / median_time(run, repeats) if run else None
        cells = [
            f"{ours / 1e6:12.2f}",
            f"{ours / base:9.2f}x" if base else f"{'-':>10s}",
            f"{same / 1e6:9.2f}" if same else f"{'-':>9s}",
            f"{ours / same:7.2f}x" if same else f"{'-':>8s}",
            f"{ours / ct:12.2f}x" if ct else f"{'-':>13s}",
        ]
        print(f"{name:9s} " + " ".join(cells))
    bench_pinned_evict(200_000 if args.quick else 1_000_000, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
