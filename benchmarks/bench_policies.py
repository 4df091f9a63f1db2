"""Eviction-policy speed against libCacheSim and cachetools, three ways, in one run.

    python -m benchmarks.bench_policies            # 1M-request Zipf-1.0 trace, 1% size
    python -m benchmarks.bench_policies --quick    # 200k requests, fewer repeats
    python -m benchmarks.bench_policies --json out.json   # + a summary with miss-ratio curves

Every figure and its baseline read the same oracleGeneral file or the same in-memory
list of ints, and are timed interleaved (alternating which goes first), reported as
min / median / max over the repeats:

1. Whole process: ``raykv simulate --policy P --size N TRACE`` against a Python process
   that imports libCacheSim, reads the same file and runs the same policy with
   ``process_trace``; both start an interpreter, import, read, simulate and print.
   Goal: >= 1.0x for LRU, SIEVE and S3-FIFO (libCacheSim ``S3FIFOv0``, threshold 2).
2. Simulator (``Policy.simulate``, what ``raykv simulate`` runs) with the file read
   (``raykv.simulate.load_trace``) against libCacheSim's ``process_trace`` reading it,
   for every policy beside libCacheSim's same policy (its LRU for MRU and Priority, its
   FIFO for FILO, which it lacks). The loop alone over the in-memory list gives the
   rate for the goal "no policy below 1M req/s".
3. Protocol path (3 repeats; ``raykv.policies.replay``: ``in``, ``touch``, ``evict(1,
   incoming=)``, ``insert``: the calls a tier makes) against libCacheSim's per-request
   loop (``cache.get(req)`` for each id of the same list) and, for LRU, cachetools'
   ``LRUCache``. Goal: >= 1.0x for LRU, FIFO, SIEVE and S3-FIFO.

A goal is "noisy" instead of met/missed when the baseline's interquartile spread is
wider than the gap. Also times ``evict`` on 1M entries of which half are pinned; with
``--json``, replays the trace through every policy at 0.1%..20% of the unique objects
(``raykv.simulate.run``) for miss-ratio curves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._util import Summary, extent, interleave, judge, spread  # noqa: E402
from raykv.policies import known_policies, make_policy, replay  # noqa: E402
from raykv.simulate import load_trace  # noqa: E402

TITLE = "Eviction policies"
CURVE_SIZES = "0.1%,0.5%,1%,2%,5%,10%,20%"
WHOLE_PROCESS = ("lru", "sieve", "s3fifo")
PROTOCOL_GOAL = ("lru", "fifo", "sieve", "s3fifo")

# libCacheSim's policy for each of ours: (init function, parameters, exact twin?).
LCS = {
    "arc": ("ARC", "", True),
    "clock": ("Clock", "", True),
    "fifo": ("FIFO", "", True),
    "filo": ("FIFO", "", False),
    "lfu": ("LFU", "", True),
    "lru": ("LRU", "", True),
    "mru": ("LRU", "", False),
    "priority": ("LRU", "", False),
    "s3fifo": ("S3FIFOv0", "move-to-main-threshold=2", True),
    "sieve": ("Sieve", "", True),
    "slru": ("SLRU", "seg-size=1:4", True),
}

# A whole libCacheSim process: import, read the oracleGeneral file, simulate, print.
LCS_PROCESS = """\
import sys
import libcachesim as lcs
path, name, params, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
init = getattr(lcs.libcachesim_python, name + "_init")
cache = lcs.CacheBase(init(lcs.CommonCacheParams(size), params))
reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
print(cache.process_trace(reader)[0])
"""


def zipf_ids(n: int, m: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = np.arange(1, m + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), m - 1)
    return rng.permutation(m).astype(np.uint64)[ranks] + 1


def write_oracle(ids: np.ndarray, path: str) -> None:
    """libCacheSim's oracleGeneral records: <u4 time, <u8 id, <u4 size, <i8 next."""
    rec = np.zeros(len(ids), dtype=[("t", "<u4"), ("id", "<u8"), ("s", "<u4"), ("n", "<i8")])
    rec["t"], rec["id"], rec["s"], rec["n"] = np.arange(len(ids)), ids, 1, -1
    rec.tofile(path)


def have_libcachesim() -> bool:
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        return False
    return True


def lcs_cache(name: str, size: int):
    import libcachesim as lcs

    init, params, _ = LCS[name]
    fn = getattr(lcs.libcachesim_python, f"{init}_init")
    return lcs.CacheBase(fn(lcs.CommonCacheParams(size), params))


def lcs_file_run(path: str, name: str, size: int) -> Callable[[int], object]:
    import libcachesim as lcs

    def run(_i: int) -> object:
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        return lcs_cache(name, size).process_trace(reader)

    return run


def lcs_request_loop(ids: list, name: str, size: int) -> Callable[[int], int]:
    """libCacheSim through its Python binding, one `get` per request (its per-request path)."""
    import libcachesim as lcs

    def run(_i: int) -> int:
        get = lcs_cache(name, size).get
        req = lcs.Request()
        req.obj_size = 1
        misses = 0
        for key in ids:
            req.obj_id = key
            if not get(req):
                misses += 1
        return misses

    return run


def cachetools_loop(ids: list, size: int) -> Callable[[int], int] | None:
    try:
        from cachetools import LRUCache
    except ImportError:
        return None

    def run(_i: int) -> int:
        cache, misses = LRUCache(size), 0
        get = cache.get
        for key in ids:
            if get(key) is None:
                misses += 1
                cache[key] = True
        return misses

    return run


def record(
    summary: Summary,
    figure: str,
    ours: list[float],
    base: list[float],
    baseline: str,
    n: int,
) -> tuple[float, dict[str, float]]:
    """Rows in M req/s (median, min-max); returns (speed ratio, the baseline's spread)."""
    a, b = spread(ours), spread(base)
    summary.row(
        figure,
        n / a["median"] / 1e6,
        "M req/s",
        baseline,
        n / b["median"] / 1e6,
        (n / a["max"] / 1e6, n / a["min"] / 1e6),
    )
    return b["median"] / a["median"], b


def whole_process(path: str, size: int, n: int, reps: int, summary: Summary) -> None:
    print(f"\n1. whole process, {n:,} requests (seconds, min / median / max of {reps}):")
    for name in WHOLE_PROCESS:
        init, params, _ = LCS[name]
        ours_cmd = [sys.executable, "-m", "raykv", "simulate", "--policy", name]
        ours_cmd += ["--size", str(size), "--no-progress", path]
        base_cmd = [sys.executable, "-c", LCS_PROCESS, path, init, params, str(size)]
        check = subprocess.run([*ours_cmd, "--json"], capture_output=True, text=True, check=True)
        misses = json.loads(check.stdout)["results"][0]["misses"]
        lcs_ratio = float(subprocess.run(base_cmd, capture_output=True, text=True).stdout)
        assert abs(misses / n - lcs_ratio) < 3e-4, (name, misses / n, lcs_ratio)

        def run(cmd: list[str]) -> Callable[[int], object]:
            return lambda _i: subprocess.run(cmd, capture_output=True, check=True)

        ours, base = interleave(run(ours_cmd), run(base_cmd), reps)
        a, b = spread(ours), spread(base)
        ratio = b["median"] / a["median"]
        print(
            f"  {name:7s} raykv simulate {a['min']:.2f} / {a['median']:.2f} / {a['max']:.2f}"
            f"   libCacheSim {init} {b['min']:.2f} / {b['median']:.2f} / {b['max']:.2f}"
            f"   speed ratio {ratio:.2f}x"
        )
        summary.row(
            f"raykv simulate {name}, whole process",
            a["median"],
            "s",
            f"libCacheSim {init} process",
            b["median"],
            (a["min"], a["max"]),
        )
        judge(
            summary,
            f"whole process: raykv simulate {name} >= 1.0x libCacheSim {init}",
            ratio,
            1.0,
            True,
            b["iqr"],
        )


def simulator(
    path: str, ids: list, size: int, n: int, reps: int, summary: Summary, lcs: bool
) -> None:
    print(f"\n2. simulator with the file read (M req/s, median, min-max; {reps} repeats):")
    print(f"{'policy':9s} {'raykv':>18s} {'libCacheSim':>24s} {'ratio':>6s} {'loop only':>18s}")
    slowest = (float("inf"), "")
    for name in known_policies():

        def ours(_i: int, name: str = name) -> int:
            return make_policy(name, size).simulate(load_trace(path))

        init = LCS[name][0]
        if lcs:
            t_ours, t_base = interleave(ours, lcs_file_run(path, name, size), reps)
            ratio, b = record(
                summary, f"{name} simulate (file read)", t_ours, t_base, f"libCacheSim {init}", n
            )
            base_txt = f"{init:>9s} {n / b['median'] / 1e6:5.2f}"
        else:
            t_ours = [_timed(ours) for _ in range(reps)]
            ratio, base_txt = float("nan"), f"{'-':>15s}"
        a = spread(t_ours)
        loop = [
            _timed(lambda _i, name=name: make_policy(name, size).simulate(ids)) for _ in range(reps)
        ]
        lo = spread(loop)
        rate = n / lo["median"]
        summary.row(
            f"{name} simulate (loop only)",
            rate / 1e6,
            "M req/s",
            value_range=(n / lo["max"] / 1e6, n / lo["min"] / 1e6),
        )
        print(
            f"{name:9s} {n / a['median'] / 1e6:5.2f} ({n / a['max'] / 1e6:.2f}-"
            f"{n / a['min'] / 1e6:.2f}) {base_txt:>24s} {ratio:6.2f} "
            f"{rate / 1e6:5.2f} ({n / lo['max'] / 1e6:.2f}-{n / lo['min'] / 1e6:.2f})"
        )
        slowest = min(slowest, (rate, name))
    summary.goal(
        "no policy below 1M req/s (simulator loop)",
        f"slowest: {slowest[1]} {slowest[0] / 1e6:.2f}",
        slowest[0] >= 1e6,
    )


def _timed(fn: Callable[[int], object]) -> float:
    t0 = time.perf_counter()
    fn(0)
    return time.perf_counter() - t0


def protocol(ids: list, size: int, n: int, reps: int, summary: Summary, lcs: bool) -> None:
    print(f"\n3. protocol path vs per-request loops (M req/s, median, min-max; {reps} repeats):")
    for name in known_policies():
        init, _, twin = LCS[name]

        def ours(_i: int, name: str = name) -> int:
            return replay(make_policy(name, size), ids)

        if not lcs:
            t = spread([_timed(ours) for _ in range(reps)])
            print(f"  {name:9s} {n / t['median'] / 1e6:5.2f}")
            summary.row(
                f"{name} protocol path",
                n / t["median"] / 1e6,
                "M req/s",
                value_range=(n / t["max"] / 1e6, n / t["min"] / 1e6),
            )
            continue
        t_ours, t_base = interleave(ours, lcs_request_loop(ids, name, size), reps)
        label = f"libCacheSim {init} get() loop" + ("" if twin else " (nearest)")
        ratio, b = record(summary, f"{name} protocol path", t_ours, t_base, label, n)
        a = spread(t_ours)
        print(
            f"  {name:9s} {n / a['median'] / 1e6:5.2f} ({n / a['max'] / 1e6:.2f}-"
            f"{n / a['min'] / 1e6:.2f})  {label:34s} {n / b['median'] / 1e6:5.2f}  {ratio:5.2f}x"
        )
        if name in PROTOCOL_GOAL:
            judge(
                summary,
                f"protocol path: {name} >= 1.0x libCacheSim's per-request {init}",
                ratio,
                1.0,
                True,
                b["iqr"],
            )
    ct = cachetools_loop(ids, size)
    if ct is not None:
        t_ours, t_base = interleave(lambda _i: replay(make_policy("lru", size), ids), ct, reps)
        ratio, b = record(summary, "lru protocol path", t_ours, t_base, "cachetools LRUCache", n)
        print(f"  lru vs cachetools.LRUCache get/set loop: {ratio:.2f}x")


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
            f"evict {name}, {n:,} entries, 50% pinned",
            statistics.median(times) * 1e6,
            "us",
            value_range=extent(times, 1e6),
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
    repeats = max(3, args.repeats or (3 if args.quick else 5))
    ids_np = zipf_ids(n, n // 5, 1.0, seed=1)
    unique = len(np.unique(ids_np))
    size = max(1, unique // 100)
    lcs = have_libcachesim()
    print(
        f"Zipf-1.0 trace: {n:,} requests, {unique:,} unique, size {size} (1%), "
        f"{repeats} repeats{'' if lcs else ' (libCacheSim not installed: no baselines)'}"
    )
    with tempfile.TemporaryDirectory(prefix="raykv-bench-policies-") as tmp:
        path = str(Path(tmp) / "zipf.oracleGeneral")
        write_oracle(ids_np, path)
        ids = load_trace(path)
        if lcs:
            whole_process(path, size, n, repeats + 2, summary)
        simulator(path, ids, size, n, repeats, summary, lcs)
        protocol(ids, size, n, 3, summary, lcs)  # the slowest section: 3 repeats
    bench_pinned_evict(200_000 if args.quick else 1_000_000, repeats, summary)
    if args.json:
        miss_ratio_curves(ids, summary)
    summary.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
