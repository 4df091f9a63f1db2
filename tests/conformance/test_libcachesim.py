"""Miss ratios agree with libCacheSim (the simulator of the S3-FIFO/SIEVE authors).

Five seeded traces (Zipf 0.8/1.0/1.2, scan-polluted, loop), each at 0.1%,
1% and 10% of its unique objects. Cache size counts objects (every object
has size 1); every request counts, cold start included.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from traces import TRACES, LibCacheSim, loop_trace, scan_trace, zipf_trace

from raykv.policies import make_policy, replay

if os.environ.get("CI"):
    import libcachesim  # noqa: F401  (on CI a missing or broken install must fail, not skip)
else:
    pytest.importorskip("libcachesim", exc_type=ImportError)

FRACTIONS = (0.001, 0.01, 0.1)
EXACT = ("lru", "fifo", "lfu", "sieve", "clock", "arc")


@functools.cache
def _trace(name: str) -> tuple[list, int, LibCacheSim]:
    ids = TRACES[name]()
    return ids.tolist(), len(np.unique(ids)), LibCacheSim(ids)


def _case(trace: str, fraction: float) -> tuple[list, int, LibCacheSim]:
    ids, unique, lib = _trace(trace)
    return ids, max(1, int(unique * fraction)), lib


CASES = [(t, f) for t in TRACES for f in FRACTIONS]


@pytest.mark.parametrize("trace,fraction", CASES)
@pytest.mark.parametrize("policy", EXACT)
def test_exact_miss_count(policy: str, trace: str, fraction: float) -> None:
    ids, size, lib = _case(trace, fraction)
    assert make_policy(policy, size).simulate(ids) == lib.misses(policy, size)


@pytest.mark.parametrize("trace,fraction", CASES)
def test_s3fifo_matches_textbook_s3fifov0(trace: str, fraction: float) -> None:
    ids, size, lib = _case(trace, fraction)
    mine = make_policy("s3fifo", size, move_threshold=2).simulate(ids) / len(ids)
    assert abs(mine - lib.misses("s3fifo", size) / len(ids)) <= 2e-4


@pytest.mark.parametrize("trace,fraction", CASES)
def test_slru_warm_fill_matches_two_segment_slru(trace: str, fraction: float) -> None:
    ids, size, lib = _case(trace, fraction)
    mine = make_policy("slru", size, warm_fill=True).simulate(ids) / len(ids)
    assert abs(mine - lib.misses("slru", size) / len(ids)) <= 0.015


@pytest.mark.parametrize("trace,fraction", [c for c in CASES if c[0] != "loop"])
def test_textbook_slru_is_within_tolerance_off_loops(trace: str, fraction: float) -> None:
    """Default SLRU admits to probation even when cold; only loops tell the two apart."""
    ids, size, lib = _case(trace, fraction)
    mine = make_policy("slru", size).simulate(ids) / len(ids)
    assert abs(mine - lib.misses("slru", size) / len(ids)) <= 0.015


@pytest.mark.parametrize("policy", [*EXACT, "s3fifo", "slru"])
def test_protocol_path_matches_libcachesim_too(policy: str) -> None:
    """The protocol methods (what a store calls), not only the fast path."""
    ids, size, lib = _case("zipf1.0", 0.01)
    ids = ids[:40_000]
    sub = LibCacheSim(np.asarray(ids, dtype=np.uint64))
    try:
        params = {"warm_fill": True} if policy == "slru" else {}
        assert replay(make_policy(policy, size, **params), ids) == sub.misses(policy, size)
    finally:
        sub.close()


@pytest.mark.parametrize("trace,fraction", CASES)
def test_priority_without_priorities_is_libcachesim_lru(trace: str, fraction: float) -> None:
    """Every key at the default level: the order within a level is LRU."""
    ids, size, lib = _case(trace, fraction)
    assert make_policy("priority", size).simulate(ids) == lib.misses("lru", size)
    if trace == "zipf1.0" and fraction == 0.01:  # the protocol path too (slower)
        assert replay(make_policy("priority", size), ids) == lib.misses("lru", size)


# ARC's adaptation is where implementations drift (a real-valued target, the ghost
# bounds): more shapes and cache sizes than the shared traces, both paths exact.
ARC_TRACES = {
    **{
        f"zipf{a}-{s}": (lambda a=a, s=s: zipf_trace(a, seed=200 + s, n=30_000, m=8_000))
        for a in (0.6, 0.9, 1.1)
        for s in range(2)
    },
    "scan-small": lambda: scan_trace(seed=5, n=30_000),
    "loop-small": lambda: loop_trace(seed=7, n=30_000),
}


@pytest.mark.parametrize("fraction", (0.005, 0.05, 0.2, 0.5))
@pytest.mark.parametrize("trace", sorted(ARC_TRACES))
def test_arc_is_exact_on_more_traces_and_sizes(trace: str, fraction: float) -> None:
    ids = ARC_TRACES[trace]()
    size = max(2, int(len(np.unique(ids)) * fraction))
    lib = LibCacheSim(ids)
    try:
        want = lib.misses("arc", size)
    finally:
        lib.close()
    listed = ids.tolist()
    assert make_policy("arc", size).simulate(listed) == want
    assert replay(make_policy("arc", size), listed) == want
