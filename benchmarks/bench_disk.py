"""Disk and Redis tier throughput against plain baselines measured in the same run.

    python -m benchmarks.bench_disk [--quick] [--dir PATH] [--no-redis] [--json PATH]

Prints medians (min-max over the repeats, ours and the baseline interleaved) and the
ratio to the baseline (goal: >= 0.8x; "noisy" when the baseline's own spread covers
the gap):

* DiskStore write (put + flush: codec header with XXH3 checksum, temp file, rename, on
  its 2-thread writer pool) vs plain `open/write/close` of the same bytes on 2 threads,
  for 2 MiB and 32 MiB chunks. Neither fsyncs: both measure writes into the page cache.
* DiskStore read (`get` on its 2-thread reader pool: readinto a fresh buffer +
  header/checksum check) vs plain `open/readinto` of the same files on 2 threads:
  once from the page cache ("cached"), once after fsync + posix_fadvise(DONTNEED)
  evicted the files ("uncached", where the kernel allows it).
* Reopening a directory of N small chunk files (index rebuild from names and sizes).
* RemoteStore over redis (codec + pipelined SET NX / MGET + decode) vs raw redis-py
  pipelined SET / MGET of the same bytes, on a local redis-server.

Plain classes only (no Ray): actor round trips are not included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks._util import (
    Summary,
    extent,
    judge,
    median_seconds,
    redis_server_class,
    repeat_seconds,
    spread,
)
from raykv.actors.memory import reuse_freed_buffers
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta, encode
from raykv.tiers.disk import SUFFIX, DiskStore, layout_digest

MiB = 1 << 20
# The DiskStore below runs 2 writer and 2 reader threads (its defaults); the plain
# baseline gets as many, so both sides do the same work with the same concurrency.
IO_THREADS = 2
POOL = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-plain-io")
SUMMARY = Summary()
_context = [""]  # the section being measured, prefixed to row names in the summary

TITLE = "Storage tiers: disk and Redis"


def key(i: int, model: str = "bench") -> CacheKey:
    return CacheKey(model, 1, 0, f"{i:032x}", "bfloat16")


def chunks(n: int, nbytes: int) -> tuple[PayloadMeta, list[np.ndarray]]:
    meta = PayloadMeta("bfloat16", (2, 8, nbytes // (2 * 8 * 2 * 128), 128))
    assert meta.nbytes == nbytes, nbytes
    rng = np.random.default_rng(0)
    return meta, [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def paired(
    ours: Callable[[], object],
    base: Callable[[], object],
    reps: int,
    setup_ours: Callable[[], object] | None = None,
    setup_base: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Times of `ours` and `base`, alternating which goes first so that load drift hits
    both (setups untimed)."""
    a, b = [], []
    for i in range(reps):
        pair = ((ours, setup_ours, a), (base, setup_base, b))
        for fn, setup, out in pair if i % 2 == 0 else pair[::-1]:
            out.append(median_seconds(fn, 1, warmup=0, setup=setup))
    return a, b


def row(label: str, nbytes: int, ours: list[float], base: list[float]) -> None:
    """GB/s of the medians, the min-max of ours, and the goal (>= 0.8x the baseline;
    "noisy" when the baseline's own spread covers the gap)."""
    o, b = spread(ours), spread(base)
    gbs, base_gbs = nbytes / o["median"] / 1e9, nbytes / b["median"] / 1e9
    lo, hi = nbytes / o["max"] / 1e9, nbytes / o["min"] / 1e9
    ratio = gbs / base_gbs
    print(
        f"  {label:<34} {gbs:7.2f} GB/s [{lo:.2f}-{hi:.2f}]   baseline {base_gbs:7.2f} GB/s"
        f"   ratio {ratio:5.2f}x"
    )
    name = f"{_context[0]} {label}".strip()
    baseline = (
        "raw redis-py pipeline"
        if _context[0].startswith("redis")
        else f"plain file I/O on {IO_THREADS} threads"
    )
    SUMMARY.row(name, gbs, "GB/s", baseline, base_gbs, value_range=(lo, hi))
    judge(SUMMARY, f"{name} >= 0.8x {baseline}", ratio, 0.8, True, b["iqr"])


def evict_from_page_cache(paths: list[str]) -> bool:
    """fsync + fadvise(DONTNEED) each file; False if the kernel kept them anyway."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _write_one(path: str, array: np.ndarray) -> str:
    with open(path, "wb", buffering=0) as f:
        f.write(memoryview(array))
    return path


def _read_one(path: str) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        buf = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
        f.readinto(memoryview(buf))
    return buf


def plain_write(directory: str, arrays: list[np.ndarray]) -> list[str]:
    """One file per array, written on `IO_THREADS` threads (as many as the store's pool)."""
    paths = [os.path.join(directory, f"plain-{i}.bin") for i in range(len(arrays))]
    return list(POOL.map(_write_one, paths, arrays))


def plain_read(paths: list[str]) -> list[np.ndarray]:
    """Read whole files into fresh buffers that are kept, as a tier's reader must, on
    `IO_THREADS` threads (as many as the store's read pool)."""
    return list(POOL.map(_read_one, paths))


def bench_disk(root: Path, chunk_bytes: int, total_bytes: int, reps: int) -> None:
    n = max(2, total_bytes // chunk_bytes)
    meta, arrays = chunks(n, chunk_bytes)
    keys = [key(i) for i in range(n)]
    nbytes = n * chunk_bytes
    print(
        f"\n{chunk_bytes // MiB} MiB chunks x {n} ({nbytes / 1e9:.2f} GB per run), median of {reps}"
    )
    plain_dir = root / "plain"
    store_root = root / "store"
    _context[0] = f"disk {chunk_bytes // MiB} MiB"

    def reset() -> None:
        shutil.rmtree(plain_dir, ignore_errors=True)
        shutil.rmtree(store_root, ignore_errors=True)
        plain_dir.mkdir()

    state: dict[str, object] = {}

    def setup_store() -> None:
        reset()
        state["store"] = DiskStore(
            store_root,
            4 * nbytes,
            write_workers=IO_THREADS,
            read_workers=IO_THREADS,
            max_pending_writes=64,
        )

    def ours_write() -> None:
        store = state["store"]
        store.put(keys, [meta] * n, arrays)
        store.flush()

    t_write, t_plain_write = paired(
        ours_write, lambda: plain_write(str(plain_dir), arrays), reps, setup_store, reset
    )
    row("write (put + flush)", nbytes, t_write, t_plain_write)

    reset()
    store = DiskStore(store_root, 4 * nbytes, write_workers=IO_THREADS, read_workers=IO_THREADS)
    store.put(keys, [meta] * n, arrays)
    store.flush()
    paths = plain_write(str(plain_dir), arrays)
    got = store.get(keys[:1])[0]
    assert got is not None and np.array_equal(got[1], arrays[0])
    t_read, t_plain_read = paired(lambda: store.get(keys), lambda: plain_read(paths), reps)
    row("read, page cache (cached)", nbytes, t_read, t_plain_read)

    ours_paths = [store.path_of(k) for k in keys]
    if evict_from_page_cache(ours_paths + paths):
        t_read, t_plain_read = paired(
            lambda: store.get(keys),
            lambda: plain_read(paths),
            reps,
            lambda: evict_from_page_cache(ours_paths),
            lambda: evict_from_page_cache(paths),
        )
        row("read, after fadvise(DONTNEED)", nbytes, t_read, t_plain_read)
    store.close()


def bench_reopen(root: Path, count: int, reps: int) -> None:
    """Reopen time of a directory holding `count` small chunk files."""
    store_root = root / "reopen"
    directory = store_root / layout_digest("bench", "KV_2LTD", "bfloat16", 256)
    meta = PayloadMeta("bfloat16", (2, 1, 1, 64))
    body = np.zeros(meta.nbytes, dtype=np.uint8)
    start = time.perf_counter()
    for i in range(count):
        k = key(i)
        shard = directory / k.chunk_hash[:2]
        if i < 256 or not shard.exists():
            shard.mkdir(parents=True, exist_ok=True)
        (shard / (k.to_string() + SUFFIX)).write_bytes(encode(body, meta, k.to_string()).tobytes())
    made = time.perf_counter() - start
    stores: list[DiskStore] = []

    def reopen() -> None:
        stores.append(DiskStore(store_root, 1 << 40, model_name="bench"))

    times = repeat_seconds(reopen, reps, warmup=0)
    t = statistics.median(times)
    assert len(stores[-1].keys()) == count
    for s in stores:
        s.close()
    print(
        f"\nreopen a directory of {count} chunk files ({meta.nbytes} B bodies, written in "
        f"{made:.1f} s): median {t * 1e3:.0f} ms ({t / count * 1e6:.1f} us per file), "
        f"dentries cached"
    )
    SUMMARY.row(
        f"reopen a directory of {count} chunk files",
        t,
        "s",
        value_range=extent(times),
    )


def bench_redis(root: Path, chunk_bytes: int, total_bytes: int, reps: int) -> None:
    import redis.asyncio as aioredis

    from raykv.config import RayKVConfig
    from raykv.tiers.remote import RemoteStore

    server = redis_server_class()(root)
    server.start()
    url = server.url
    n = max(2, total_bytes // chunk_bytes)
    meta, arrays = chunks(n, chunk_bytes)
    keys = [key(i) for i in range(n)]
    nbytes = n * chunk_bytes
    print(f"\nredis, {chunk_bytes // MiB} MiB chunks x {n} per request, median of {reps}")
    _context[0] = f"redis {chunk_bytes // MiB} MiB"

    async def run() -> None:
        store = RemoteStore(RayKVConfig(remote_url=url, lookup_timeout_ms=60_000))
        raw = aioredis.from_url(url)
        names = [f"raw:{k.to_string()}" for k in keys]

        async def timed(fn_a, fn_b, setup=None) -> tuple[list[float], list[float]]:
            """Times of two coroutines, alternating which goes first so drift hits both."""
            times: tuple[list[float], list[float]] = ([], [])
            for i in range(reps):
                pair = ((fn_a, times[0]), (fn_b, times[1]))
                for fn, out in pair if i % 2 == 0 else pair[::-1]:
                    if setup:
                        await setup()
                    start = time.perf_counter()
                    await fn()
                    out.append(time.perf_counter() - start)
            return times

        async def flush() -> None:
            await raw.flushdb()

        async def ours_put() -> None:
            ack = await store.put(keys, [meta] * n, arrays)
            assert len(ack.accepted) == n, ack.skipped

        async def raw_put() -> None:
            pipe = raw.pipeline(transaction=False)
            for name, a in zip(names, arrays, strict=True):
                pipe.set(name, memoryview(a))
            await pipe.execute()

        t_put, t_raw_put = await timed(ours_put, raw_put, flush)
        await ours_put()
        await raw_put()

        async def ours_get() -> None:
            metas, _ = await store.get_batch(keys)
            assert all(m is not None for m in metas)

        async def raw_get() -> None:
            await raw.mget(names)

        t_get, t_raw_get = await timed(ours_get, raw_get)
        row("put (encode + pipelined SET NX)", nbytes, t_put, t_raw_put)
        row("get (MGET + decode/checksum)", nbytes, t_get, t_raw_get)
        await store.close()
        await raw.aclose()

    try:
        asyncio.run(run())
    finally:
        server.stop()


def main() -> None:
    reuse_freed_buffers()  # as the disk tier's actor does (same process: both sides get it)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repetitions")
    parser.add_argument("--dir", help="directory on the file system to test (default: a temp dir)")
    parser.add_argument("--no-redis", action="store_true", help="skip the redis part")
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    args = parser.parse_args()
    reps = 5 if args.quick else 7
    total = (64 if args.quick else 256) * MiB
    files = 10_000 if args.quick else 100_000
    root = Path(tempfile.mkdtemp(prefix="raykv-bench-", dir=args.dir))
    print(f"raykv disk benchmark in {root} (cpus: {os.cpu_count()})")
    try:
        for size in (2 * MiB, 32 * MiB):
            bench_disk(root, size, total, reps)
        bench_reopen(root, files, reps)
        if not args.no_redis and shutil.which("redis-server"):
            bench_redis(root, 2 * MiB, (16 if args.quick else 64) * MiB, reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gbs = [r for r in SUMMARY.rows if r["unit"] == "GB/s"]
    SUMMARY.plot(
        "disk_gbs",
        "Disk and Redis tiers GB/s (raykv vs same-run baseline)",
        "",
        "GB/s",
        {"raykv": [r["value"] for r in gbs], "baseline": [r["baseline_value"] for r in gbs]},
        kind="bar",
        categories=[str(r["name"]) for r in gbs],
    )
    SUMMARY.write(args.json)


if __name__ == "__main__":
    main()
