"""Seeded synthetic traces and a libCacheSim runner for the conformance tests."""

from __future__ import annotations

import os
import tempfile
import weakref

import numpy as np

N_REQUESTS = 120_000
N_OBJECTS = 40_000
ORACLE_DTYPE = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def zipf_trace(alpha: float, seed: int, n: int = N_REQUESTS, m: int = N_OBJECTS) -> np.ndarray:
    """``n`` requests over ``m`` objects, popularity ~ rank**-alpha, ids shuffled."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, m + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), m - 1)
    return rng.permutation(m).astype(np.uint64)[ranks] + 1


def scan_trace(seed: int, n: int = N_REQUESTS) -> np.ndarray:
    """A Zipf-1.0 working set polluted by one-pass sequential scans (20% of requests)."""
    rng = np.random.default_rng(seed)
    hot = zipf_trace(1.0, seed + 1, n, N_OBJECTS // 2)
    out = hot.copy()
    pos, next_scan_id = 0, 10_000_000
    while pos < n:
        pos += int(rng.integers(2_000, 6_000))
        length = int(rng.integers(500, 1_500))
        end = min(pos + length, n)
        out[pos:end] = np.arange(next_scan_id, next_scan_id + end - pos, dtype=np.uint64)
        next_scan_id += end - pos
        pos = end
    return out


def loop_trace(seed: int, n: int = N_REQUESTS) -> np.ndarray:
    """Repeated loops over a fixed set of objects, with a little random noise."""
    rng = np.random.default_rng(seed)
    loop = np.arange(1, 20_001, dtype=np.uint64)
    out = np.tile(loop, n // len(loop) + 1)[:n]
    noise = rng.random(n) < 0.05
    out[noise] = rng.integers(100_000, 140_000, int(noise.sum())).astype(np.uint64)
    return out


TRACES = {
    "zipf0.8": lambda: zipf_trace(0.8, seed=8),
    "zipf1.0": lambda: zipf_trace(1.0, seed=10),
    # Steeper Zipf needs more requests and objects to reach 20k unique ids, so
    # that 0.1% still gives S3-FIFO a small queue of 2 (libCacheSim refuses
    # to admit anything into a small queue of 1 object).
    "zipf1.2": lambda: zipf_trace(1.2, seed=12, n=250_000, m=1_000_000),
    "scan": lambda: scan_trace(seed=21),
    "loop": lambda: loop_trace(seed=31),
}


def write_oracle(ids: np.ndarray, path: str) -> None:
    """Write ``ids`` as a libCacheSim oracleGeneral file, every object of size 1."""
    rec = np.zeros(len(ids), dtype=ORACLE_DTYPE)
    rec["time"] = np.arange(len(ids), dtype=np.uint32)
    rec["id"] = ids
    rec["size"] = 1
    rec["next"] = -1
    rec.tofile(path)


class LibCacheSim:
    """Runs libCacheSim policies on one trace; cache size counts objects (size 1 each)."""

    def __init__(self, ids: np.ndarray) -> None:
        import libcachesim as lcs

        self._lcs = lcs
        fd, self.path = tempfile.mkstemp(suffix=".oracleGeneral")
        os.close(fd)
        write_oracle(ids, self.path)
        self.n = len(ids)
        self._cleanup = weakref.finalize(self, _unlink, self.path)

    def close(self) -> None:
        self._cleanup()

    def make(self, policy: str, size: int):
        lcs = self._lcs
        lp = lcs.libcachesim_python
        if policy == "s3fifo":
            params = lcs.CommonCacheParams(size)
            return lcs.CacheBase(lp.S3FIFOv0_init(params, "move-to-main-threshold=2"))
        if policy == "slru":
            return lcs.CacheBase(lp.SLRU_init(lcs.CommonCacheParams(size), "seg-size=1:4"))
        simple = {
            "lru": lcs.LRU,
            "fifo": lcs.FIFO,
            "lfu": lcs.LFU,
            "sieve": lcs.Sieve,
            "arc": lcs.ARC,
        }
        if policy == "clock":
            return lcs.Clock(size, init_freq=0, n_bit_counter=1)
        return simple[policy](size)

    def misses(self, policy: str, size: int) -> int:
        reader = self._lcs.TraceReader(self.path, self._lcs.TraceType.ORACLE_GENERAL_TRACE)
        miss_ratio, _ = self.make(policy, size).process_trace(reader)
        return round(miss_ratio * self.n)


def _unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)
