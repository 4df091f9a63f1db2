"""The client's data path: how long `store` blocks the caller and how fast `retrieve`
fills a preallocated destination, at 8, 32 and 128 MiB of fp16 KV (issue #14).

    python -m benchmarks.bench_datapath [--quick] [--json PATH]

Figures and their same-run baselines, timed alternately (interleaved) so both see the
same machine; each is reported as min / median / max over the repeats:

* staged `store` (config `store_staging_size`): the time the caller is blocked, against
  one memcpy of the same bytes into a preallocated buffer (torch `copy_` of the same
  `KV_2LTD` tensor). Goal: <= 1.5x. Every timed call, store or memcpy, follows the same
  untimed work: the background `ray.put` and manager calls drained, one staged store of
  another prompt, drained again. So every repeat finds the ring free and the caches as
  a store leaves them (as in serving); with only a drain between them, half of the
  memcpy's repeats followed the same memcpy with its 8 MiB still in L3, and the
  baseline's median jumped by 2x from run to run. That back-to-back memcpy is reported
  beside it, for reference.
* synchronous `store` (the default): the same store waiting for the object store and
  the manager, against the same memcpy, for comparison.
* `retrieve` into a preallocated destination with the default config (no read cache),
  against one trivial async-actor round trip plus one memcpy of the bytes: the same
  copy a retrieve makes, from the stored chunks in the object store into the same
  destination. Goal: baseline / retrieve >= 0.8. Both rotate over stored prompts of
  384 MiB in all, the baseline copying another prompt than the retrieve beside it, so
  neither finds its source in the CPU caches (until 2026-11-26 the retrieve read one
  prompt over and over, with the read cache on: not the default, and 0.1-0.2 above
  what the default gets at 8-32 MiB). Also against a round trip that carries the
  retrieve's request (its packed spans) as its argument. Each baseline alternates with
  the retrieve alone, with many more repeats than the stores (a retrieve takes
  milliseconds; ~1 s of reads per figure). Then the same retrieve with the read cache
  (config `read_cache_size`) on and off, alternating twice as many times.

* Ray settings for users who start Ray themselves: `ray.put` GB/s at 8/32/128 MiB,
  raykv's synchronous `store` of 32 MiB and the time `ray.init` takes, in fresh
  processes with a 2 GiB object store, with and without `preallocate_plasma_memory`
  (env `RAY_preallocate_plasma_memory=1`), the two alternating over the rounds.

A goal is "noisy" when the baseline's own spread (its interquartile range over its
median) is wider than the gap between the figure and the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np
import ray
import torch

import raykv
from benchmarks._util import Summary, interleave, interleave_all, judge, spread
from raykv.actors.factory import shutdown_namespace
from raykv.payload import buffers_to_tensors

TITLE = "Client data path: store and retrieve against memcpy"

LAYERS, HIDDEN = 8, 1024  # 32 KiB of fp16 K+V per token
CHUNK = 256
SIZES_MIB = (8, 32, 128)
# The retrieve figures rotate over stored prompts of this many MiB in all (this machine's
# L3 is 32 MiB or less): a read of the prompt read just before found it in the caches.
ROTATE_MIB = 384


@ray.remote(num_cpus=0)
class Ping:
    async def ping(self) -> None:
        return None

    async def carry(self, request: object) -> None:
        """A round trip carrying a retrieve's request (its packed spans)."""
        return None


def read_reps(reps: int, mib: int) -> int:
    """Repeats of the retrieve figures: a retrieve takes a few ms, so many more repeats
    than the stores (~1 s of reads per figure) keep the machine's noise out of the median."""
    return max(reps, (reps * 256) // mib)


def tokens_for(n_tokens: int) -> np.ndarray:
    return np.random.default_rng(uuid.uuid4().int % 2**32).integers(0, 30_000, n_tokens)


PREALLOC_ENV = "RAY_preallocate_plasma_memory"
PROBE_STORE_GIB = 2


def probe() -> None:
    """One fresh Ray (settings from the environment): print its figures as JSON."""
    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=PROBE_STORE_GIB << 30,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    out: dict[str, float] = {"start_s": time.perf_counter() - t0}
    try:
        for mib in SIZES_MIB:
            arr = np.random.default_rng(mib).integers(0, 256, mib << 20, dtype=np.uint8)
            held: list = []  # a cache holds what it put: keep a small working set
            times = []
            for _ in range(9):
                t = time.perf_counter()
                held.append(ray.put(arr))
                times.append(time.perf_counter() - t)
                del held[:-4]
            out[f"put_{mib}"] = statistics.median(times)
        ns = f"bench-probe-{uuid.uuid4().hex[:8]}"
        cache = raykv.connect(namespace=ns, chunk_size=CHUNK, kv_dtype="float16")
        n_tokens = 32 * (1 << 20) // (2 * LAYERS * HIDDEN * 2)
        kv = torch.randn(2, LAYERS, n_tokens, HIDDEN).to(torch.float16)
        cache.store(tokens_for(n_tokens), kv)
        times = []
        for _ in range(7):
            t = time.perf_counter()
            assert cache.store(tokens_for(n_tokens), kv) == n_tokens
            times.append(time.perf_counter() - t)
        out["store_32"] = statistics.median(times)
        cache.close()
        shutdown_namespace(ns)
    finally:
        ray.shutdown()
    print("PROBE " + json.dumps(out), flush=True)


def bench_settings(summary: Summary, rounds: int) -> None:
    """Fresh processes with and without plasma preallocation, alternating."""
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for r in range(rounds):
        for prealloc in (False, True) if r % 2 == 0 else (True, False):
            env = dict(os.environ)
            env.pop(PREALLOC_ENV, None)
            if prealloc:
                env[PREALLOC_ENV] = "1"
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_datapath", "--probe"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
            if proc.returncode != 0 or not line:
                raise RuntimeError(f"probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
            runs[prealloc].append(json.loads(line[-1][len("PROBE ") :]))
    what = f"{PREALLOC_ENV}=1"
    for field, label, per_gb in [
        *[(f"put_{m}", f"ray.put {m} MiB", m / 1024) for m in SIZES_MIB],
        ("store_32", "raykv store 32 MiB (synchronous)", 32 / 1024),
        ("start_s", f"ray.init with a {PROBE_STORE_GIB} GiB object store", None),
    ]:
        on = [x[field] for x in runs[True]]
        off = [x[field] for x in runs[False]]
        a, b = spread(on), spread(off)
        if per_gb is None:
            value, base, unit, rng = a["median"], b["median"], "s", (a["min"], a["max"])
        else:
            value, base, unit = per_gb / a["median"], per_gb / b["median"], "GB/s"
            rng = (per_gb / a["max"], per_gb / a["min"])
        summary.row(f"{label}, {what}", value, unit, "the same without it", base, rng)
        print(f"{label:<44} {value:7.2f} {unit:<4} with, {base:7.2f} without ({what})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 8/32 MiB only")
    parser.add_argument("--json", help="write the summary to this JSON file")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.probe:
        probe()
        return
    reps = 5 if args.quick else 11
    sizes = SIZES_MIB[:2] if args.quick else SIZES_MIB
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=4 << 30,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    ns = f"bench-dp-{uuid.uuid4().hex[:8]}"
    summary = Summary()
    common = dict(
        namespace=ns,
        chunk_size=CHUNK,
        kv_dtype="float16",
        max_local_cpu_size=2.0,
        lookup_timeout_ms=10_000,
    )
    staged = raykv.connect(**common, store_staging_size=0.5, read_cache_size=0.5)
    plain = raykv.connect(**common)
    ping = Ping.remote()
    ray.get(ping.ping.remote())
    print(f"ray {ray.__version__}, {os.cpu_count()} cores; KV fp16, {LAYERS} layers x {HIDDEN}")
    try:
        for mib in sizes:
            n_tokens = mib * (1 << 20) // (2 * LAYERS * HIDDEN * 2)
            kv = torch.randn(2, LAYERS, n_tokens, HIDDEN).to(torch.float16)
            copy_dst = torch.empty_like(kv)
            memcpy = lambda _i: copy_dst.copy_(kv)  # noqa: E731
            store_reps = max(reps, (reps * 32) // mib)  # a small store is over in a blink
            prompts = [tokens_for(n_tokens) for _ in range(store_reps + 1)]
            others = iter([tokens_for(n_tokens) for _ in range(2 * store_reps + 1)])

            def store_staged(i: int) -> None:
                assert staged.store(prompts[i], kv) == n_tokens

            def store_plain(i: int) -> None:
                plain.store(tokens_for(n_tokens), kv)

            def after_a_store() -> None:
                # Every timed call, store or memcpy, follows the same untimed work: the
                # staged stores drained, then one staged store of another prompt, drained
                # (as in serving, where a store follows a store, never the same memcpy).
                staged.flush(60)
                assert staged.store(next(others), kv) == n_tokens
                staged.flush(60)

            t_store, t_copy = interleave(store_staged, memcpy, store_reps, between=after_a_store)
            # For reference: the same memcpy repeated back to back, its 8 MiB source and
            # destination still in L3 (what half the baseline's repeats measured when the
            # two alternated with only a drain between them).
            t_b2b = interleave_all([memcpy], store_reps)[0]
            t_sync, t_copy2 = interleave(store_plain, memcpy, reps)
            # retrieve: of one of `held` prompts in turn (together over 3x L3 and more, so
            # each read finds its chunks out of the CPU caches, as in serving), into a
            # preallocated destination.
            held = [tokens_for(n_tokens) for _ in range(max(3, ROTATE_MIB // mib))]
            for prompt in held:
                assert plain.store(prompt, kv) == n_tokens
            dest = torch.empty_like(kv)
            assert plain.lookup(held[0]) == n_tokens
            request = plain._packed(plain.spans(held[0]))  # what a retrieve sends
            # The baseline's memcpy copies what a retrieve copies: a prompt's stored chunks
            # (in the object store, another prompt's than the retrieve next to it read),
            # into the same destination. Copying `kv` instead would give the baseline a
            # source the other baseline just made cache-hot.
            stored = []
            for prompt in held:
                got, _ = plain.get_chunks(plain.spans(prompt))
                tensors = buffers_to_tensors([buf for _, buf, _ in got], [m for _, _, m in got])
                spans = [span for span, _, _ in got]
                stored.append(
                    [
                        (dest[:, :, sp.start : sp.end, :], t)
                        for sp, t in zip(spans, tensors, strict=True)
                    ]
                )

            def copy_stored(i: int) -> None:
                for part, chunk in stored[(i + len(held) // 2) % len(held)]:
                    part.copy_(chunk)

            def retrieve(i: int) -> None:  # the default config: no read cache
                assert plain.retrieve(held[i % len(held)], dest).all()

            def retrieve_cached(i: int) -> None:
                assert staged.retrieve(held[i % len(held)], dest).all()

            def ideal(i: int) -> None:
                ray.get(ping.ping.remote())
                copy_stored(i)

            def ideal_request(i: int) -> None:
                ray.get(ping.carry.remote(request))
                copy_stored(i)

            # Each baseline alternates with the retrieve alone: a third function in the
            # same loop would run the Ping actor twice per round and the manager once,
            # keeping Ping's process warmer on 2 cores.
            t_get, t_ideal = interleave(retrieve, ideal, read_reps(reps, mib))
            t_get2, t_ideal_req = interleave(retrieve, ideal_request, read_reps(reps, mib))
            # The read cache on and off, alone: many alternations of just the two.
            t_ab, t_get_plain = interleave_all(
                [retrieve_cached, retrieve], 2 * read_reps(reps, mib)
            )
            assert torch.equal(dest, kv)
            s, c, y, c2 = spread(t_store), spread(t_copy), spread(t_sync), spread(t_copy2)
            b2b = spread(t_b2b)
            g, i = spread(t_get), spread(t_ideal)
            ab, gp, ir = spread(t_ab), spread(t_get_plain), spread(t_ideal_req)
            g2 = spread(t_get2)
            gb = mib / 1024
            ms = lambda d: f"{d['median'] * 1e3:.2f} ms [{d['min'] * 1e3:.2f}-{d['max'] * 1e3:.2f}]"  # noqa: E731
            print(
                f"{mib:4d} MiB  staged store {ms(s)}  memcpy {ms(c)}  "
                f"ratio {s['median'] / c['median']:.2f}"
            )
            print(f"          memcpy back to back {ms(b2b)}")
            print(
                f"          sync store {ms(y)}  memcpy {ms(c2)}  "
                f"ratio {y['median'] / c2['median']:.2f}"
            )
            print(
                f"          retrieve {ms(g)}  RTT+memcpy {ms(i)}  "
                f"fraction {i['median'] / g['median']:.2f}\n"
                f"          retrieve {ms(g2)}  RTT carrying the request+memcpy {ms(ir)}  "
                f"fraction {ir['median'] / g2['median']:.2f}\n"
                f"          read cache on {ms(ab)}  off {ms(gp)}  "
                f"ratio {ab['median'] / gp['median']:.3f} ({len(t_ab)} alternations)",
                flush=True,
            )
            summary.row(
                f"staged store {mib} MiB (caller blocked)",
                s["median"] * 1e3,
                "ms",
                "memcpy into a preallocated buffer",
                c["median"] * 1e3,
                value_range=(s["min"] * 1e3, s["max"] * 1e3),
            )
            summary.row(
                f"memcpy {mib} MiB repeated back to back (for reference)",
                b2b["median"] * 1e3,
                "ms",
                "memcpy after a store (the staged store's baseline)",
                c["median"] * 1e3,
                value_range=(b2b["min"] * 1e3, b2b["max"] * 1e3),
            )
            summary.row(
                f"sync store {mib} MiB",
                y["median"] * 1e3,
                "ms",
                "memcpy",
                c2["median"] * 1e3,
                value_range=(y["min"] * 1e3, y["max"] * 1e3),
            )
            for fig, base_label, base in (
                (g, "one actor round trip + memcpy", i),
                (g2, "one actor round trip carrying the request + memcpy", ir),
            ):
                summary.row(
                    f"retrieve {mib} MiB into a preallocated tensor",
                    gb / fig["median"],
                    "GB/s",
                    base_label,
                    gb / base["median"],
                    value_range=(gb / fig["max"], gb / fig["min"]),
                )
            summary.row(
                f"retrieve {mib} MiB, read cache on",
                ab["median"] * 1e3,
                "ms",
                "the same retrieve, read cache off",
                gp["median"] * 1e3,
                value_range=(ab["min"] * 1e3, ab["max"] * 1e3),
            )
            noise_c, noise_i = c["iqr"], i["iqr"]
            judge(
                summary,
                f"staged store {mib} MiB blocks <= 1.5x memcpy",
                s["median"] / c["median"],
                1.5,
                False,
                noise_c,
            )
            judge(
                summary,
                f"retrieve {mib} MiB >= 0.8x (RTT + memcpy)",
                i["median"] / g["median"],
                0.8,
                True,
                noise_i,
            )
        summary.plot(
            "datapath",
            "client data path (ms, median)",
            "MiB",
            "ms",
            series={
                name: [[r_mib, r["value"]] for r_mib, r in zip(sizes, rows, strict=True)]
                for name, rows in (
                    ("staged store", [r for r in summary.rows if r["name"].startswith("staged")]),
                    ("sync store", [r for r in summary.rows if r["name"].startswith("sync")]),
                )
            }
            | {
                "memcpy": [
                    [r_mib, r["baseline_value"]]
                    for r_mib, r in zip(
                        sizes,
                        [r for r in summary.rows if r["name"].startswith("staged")],
                        strict=True,
                    )
                ]
            },
            xscale="log",
        )
    finally:
        staged.close()
        plain.close()
        shutdown_namespace(ns)
        ray.shutdown()
    bench_settings(summary, 2 if args.quick else 4)
    summary.write(args.json)


if __name__ == "__main__":
    main()
