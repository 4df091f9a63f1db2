"""Speed of the CPU tier and the StorageManager, each beside a baseline from the same run.

    python -m benchmarks.bench_tiers [--quick] [--json results/bench_tiers.json]

Every figure and its baseline are timed alternately (interleaved) so that both see the
same machine; each row gives the median and the min-max over the repeats, and a goal
is "noisy" when the baseline's own spread covers the gap. Measures:

* CPU put GB/s, 2 MiB and 32 MiB chunks, 16 per request: client `ray.put` + the
  CPUStore's put (which re-puts the batch so that it owns it), direct and through
  the manager, vs one raw batched `ray.put` of the same arrays (also one that holds a
  1 GiB working set, as a cache does) and a numpy memcpy. Also the pull-from-producer
  path (the CPUStore calls a producer actor's `get_batch` and keeps the returned
  object: no re-put).
* CPU get into preallocated buffers: `manager.get` + one `ray.get` of the returned
  refs + a copy of every chunk, vs one trivial actor round trip + a raw batched
  `ray.get` of the same refs + the same copies (ms and GB/s of the same runs).
* lookup latency p50/p99 for 8, 128 and 512 chunks cut over CPU, disk and a `ray://`
  remote, vs one trivial async-actor round trip: once answered from the manager's
  index (it knows every tier's keys), then with the remote third unknown to the index
  (written there by another client), so that every lookup asks the remote tier: asked
  by the manager after its own answer (`client_remote_probe: false`), and asked by the
  client beside the manager (`client_remote_probe`, the default; the whole client call
  timed, packing included).
* prefetch of 512 MiB (128 MiB with --quick) from disk into CPU vs the disk actor's
  own `get_batch` called directly.

Goals: put >= 0.8x raw `ray.put`; get <= 1.0x its baseline; lookup (packed form) <=
2.0x an actor round trip, also when the remote tier is asked (by the client: two
sequential round trips, manager then server, make 2.0x the floor of the other way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import raykv  # noqa: E402
from benchmarks._util import interleave, spread  # noqa: E402
from raykv.actors.cpu_store import CPUStoreActor  # noqa: E402
from raykv.actors.factory import shutdown_namespace
from raykv.actors.storage_manager import get_or_create_manager
from raykv.config import RayKVConfig  # noqa: E402
from raykv.keys import ChunkSpan, KeyMaker  # noqa: E402
from raykv.payload import PayloadMeta  # noqa: E402
from raykv.wire import PackedSpans, RetrieveResult

TITLE = "Storage tiers: CPU tier and StorageManager"

MiB = 1 << 20
GB = 1e9
CHUNKS_PER_REQUEST = 16
GOALS: list[dict] = []  # filled by report() from rows that carry a goal
_counter = [0]


def fresh_tokens(n_tokens: int) -> range:
    """Token ids never used before (a new sequence each call)."""
    _counter[0] += 1
    base = _counter[0] * 10_000_000
    return range(base, base + n_tokens)


def fresh_spans(n: int, chunk_tokens: int = 256) -> list[ChunkSpan]:
    """Keys never seen before. uint8 keys for the uint8 payloads of `meta_for`: tiers
    reject a dtype mismatch."""
    return KeyMaker(chunk_size=chunk_tokens, kv_dtype="uint8").keys(fresh_tokens(n * chunk_tokens))


def meta_for(nbytes: int, tokens: int = 256) -> PayloadMeta:
    return PayloadMeta("uint8", (2, 1, tokens, nbytes // (2 * tokens)))


def paired(fn: Callable[[], object], base: Callable[[], object], reps: int):
    """Times of `fn` and `base`, interleaved (alternating which goes first) so that both
    see the same machine; the noise shows in the spread of each list."""
    return interleave(lambda _i: fn(), lambda _i: base(), reps)


@ray.remote(num_cpus=0)
class Ping:
    async def ping(self) -> None:
        return None


@ray.remote(num_cpus=0)
class Producer:
    """A GPU-worker stand-in holding chunks in its own memory."""

    def __init__(self, nbytes: int, n: int) -> None:
        self._arrays = [np.full(nbytes, i, dtype=np.uint8) for i in range(n)]
        self._meta = meta_for(nbytes)

    @ray.method(num_returns=2)
    def get_batch(self, keys):
        return [self._meta] * len(keys), self._arrays[: len(keys)]


def at(times: list[float], quantile: float) -> float:
    if quantile == 0.5:
        return statistics.median(times)
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(len(ordered) * quantile))]


def report(
    rows: list[dict],
    name: str,
    unit: str,
    base_name: str,
    times: list[float],
    base_times: list[float],
    per_second: float | None = None,
    goal: str = "",
    quantile: float = 0.5,
) -> None:
    """One figure beside its baseline from medians (or another `quantile`) of interleaved
    `times` and `base_times`: `per_second` bytes gives GB/s, else milliseconds. The goal
    is "noisy" when the baseline's own spread (interquartile range over median) covers
    the gap."""

    def conv(t: float) -> float:
        return per_second / t / GB if per_second else t * 1000

    fig, b = spread(times), spread(base_times)
    value, base = conv(at(times, quantile)), conv(at(base_times, quantile))
    lo, hi = sorted((conv(fig["min"]), conv(fig["max"])))
    ratio = value / base if base else float("nan")
    if goal:
        op, limit = goal.split()[1:3]
        met = ratio >= float(limit) if op == ">=" else ratio <= float(limit)
        noisy = abs(ratio - float(limit)) / float(limit) <= b["iqr"]
        GOALS.append(
            {
                "goal": f"{name}: ratio {op} {limit}",
                "value": round(ratio, 3),
                "met": None if noisy else met,
                "noisy": noisy,
            }
        )
    rows.append(
        {
            "name": name,
            "value": value,
            "unit": unit,
            "baseline": base_name,
            "baseline_value": base,
            "ratio": ratio,
            "goal": goal,
            "range": [lo, hi],
        }
    )
    print(
        f"{name:<46} {value:10.3f} {unit:<5} [{lo:.3g}-{hi:.3g}] | {base_name:<34} "
        f"{base:10.3f} | ratio {ratio:6.2f} {goal}",
        flush=True,
    )


def bench_put_get(rows: list[dict], manager, cpu, chunk_mib: int, reps: int) -> None:
    nbytes = chunk_mib * MiB
    total = nbytes * CHUNKS_PER_REQUEST
    arrays = [
        np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
        for i in range(CHUNKS_PER_REQUEST)
    ]
    metas = [meta_for(nbytes)] * CHUNKS_PER_REQUEST
    label = f"{CHUNKS_PER_REQUEST}x{chunk_mib} MiB"

    def raw_put() -> None:
        ray.put(arrays)

    held: list = []
    budget = int(1.0 * 2**30) // total

    def raw_put_held() -> None:
        """ray.put keeping a FIFO working set as large as the tier's budget (as a cache does)."""
        held.append(ray.put(arrays))
        del held[:-budget]

    def memcpy() -> None:
        for a in arrays:
            np.copyto(np.empty_like(a), a)

    def store_direct() -> None:
        keys = [s.key for s in fresh_spans(CHUNKS_PER_REQUEST)]
        ref = ray.put(arrays)
        ack = ray.get(cpu.put.remote(keys, metas, [ref]))
        assert len(ack.accepted) == CHUNKS_PER_REQUEST, ack.skipped

    def store_manager() -> None:
        keys = [s.key for s in fresh_spans(CHUNKS_PER_REQUEST)]
        ref = ray.put(arrays)
        assert ray.get(manager.put.remote(keys, metas, [ref])).stored == CHUNKS_PER_REQUEST

    producer = Producer.remote(nbytes, CHUNKS_PER_REQUEST)
    ray.get(producer.get_batch.options(num_returns=2).remote([])[0])

    def pull() -> None:
        keys = [s.key for s in fresh_spans(CHUNKS_PER_REQUEST)]
        ack = ray.get(cpu.pull.remote(producer, keys))
        assert len(ack.accepted) == CHUNKS_PER_REQUEST

    paths = [
        ("numpy memcpy", memcpy, ""),
        ("CPU put (ray.put + CPUStore.put)", store_direct, "goal >= 0.8"),
        ("manager.put (CPU only)", store_manager, "goal >= 0.8"),
        ("CPUStore.pull from producer", pull, ""),
    ]
    for name, fn, goal in paths:
        t, t_raw = paired(fn, raw_put, reps)
        report(rows, f"{name} {label}", "GB/s", "raw batched ray.put", t, t_raw, total, goal)
        if fn is not memcpy:
            t, t_held = paired(fn, raw_put_held, reps)
            base = "ray.put holding a 1 GiB working set"
            report(rows, f"{name} {label}", "GB/s", base, t, t_held, total)
    held.clear()
    ray.kill(producer)

    # Get into preallocated buffers (what a serving engine does with KV): one manager
    # call, one ray.get of the distinct refs and a copy of every chunk, against one
    # trivial actor round trip, a raw batched ray.get of the same refs and the same copies.
    spans = fresh_spans(CHUNKS_PER_REQUEST)
    ref = ray.put(arrays)
    ray.get(manager.put.remote([s.key for s in spans], metas, [ref]))
    del ref
    refs = list({c.ref for c in RetrieveResult.of(ray.get(manager.get.remote(spans))).chunks})
    ping = Ping.remote()
    ray.get(ping.ping.remote())
    dst = [np.empty_like(a) for a in arrays]

    def get_path() -> None:
        res = RetrieveResult.of(ray.get(manager.get.remote(spans)))
        distinct = list({c.ref: None for c in res.chunks})
        values = dict(zip(distinct, ray.get(distinct), strict=True))
        assert len(res.chunks) == CHUNKS_PER_REQUEST
        for out, c in zip(dst, res.chunks, strict=True):
            np.copyto(out, values[c.ref][c.index])

    def baseline() -> None:
        ray.get(ping.ping.remote())
        got = [a for batch in ray.get(refs) for a in batch]
        for out, a in zip(dst, got, strict=True):
            np.copyto(out, a)

    t_get, t_base = paired(get_path, baseline, reps * 4)
    base = "actor RTT + raw batched ray.get + copy"
    name = f"CPU get into preallocated buffers {label}"
    report(rows, name, "ms", base, t_get, t_base, goal="goal <= 1.0")
    report(rows, name, "GB/s", base, t_get, t_base, total)
    ray.kill(ping)


TAIL_BASE = 900_000_000  # token ids of the remote-only tails (far from fresh_spans')


def bench_lookup(rows: list[dict], tmp: str, reps: int) -> None:
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    config = RayKVConfig.load(
        namespace=ns,
        max_local_cpu_size=1.0,
        local_disk=os.path.join(tmp, "lookup"),
        max_local_disk_size=1.0,
        remote_url=f"ray://kv-{ns}",
        max_remote_size=1.0,
    )
    manager = get_or_create_manager(config)
    ping = Ping.remote()
    ray.get([manager.stats.remote(), ping.ping.remote()])
    probing = raykv.connect(config, client_remote_probe=True)

    def rtt() -> None:
        ray.get(ping.ping.remote())

    nbytes = 4096
    probe_reps = max(20, reps // 4)
    try:
        for n in (8, 128, 512):
            a, b = n // 3, 2 * n // 3
            # Cut one prefix over the tiers: CPU keeps [:a], disk [a:b], remote [b:]. A
            # fresh KVServer can miss its first identity timeout on a loaded box, and
            # the remote tier skips writes while down: then start over with new keys.
            maker = KeyMaker(chunk_size=16, kv_dtype="uint8")
            for _ in range(5):
                head = list(fresh_tokens(n * 16))
                spans = maker.keys(head)
                keys = [s.key for s in spans]
                ref = ray.put([np.zeros(nbytes, np.uint8)] * n)
                ray.get(manager.put.remote(keys, [meta_for(nbytes, 16)] * n, [ref]))
                ray.get(manager.flush.remote(60))
                removed = [
                    ray.get(manager.remove.remote(keys[a:], ["cpu"])),
                    ray.get(manager.remove.remote(keys[:a] + keys[b:], ["disk"])),
                    ray.get(manager.remove.remote(keys[:b], ["remote"])),
                ]
                if removed == [n - a, a + n - b, b]:
                    break
            else:
                raise RuntimeError(f"could not cut {n} chunks over 3 tiers (removed {removed})")
            # Warm-up: on a loaded box the first remote probes can miss their budget.
            deadline = time.monotonic() + 30
            while ray.get(manager.lookup.remote(spans)) != spans[-1].end:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lookup never found all {n} chunks over 3 tiers")
                time.sleep(0.1)
            packed = PackedSpans.of(spans).wire()  # what a KVCache sends
            for form, arg in (("ChunkSpan list", spans), ("packed", packed)):
                t, t_ping = paired(lambda x=arg: ray.get(manager.lookup.remote(x)), rtt, reps)
                name = f"lookup {n} chunks, 3 tiers from the index ({form})"
                goal = "goal <= 2.0" if form == "packed" else ""
                report(rows, f"{name} p50", "ms", "async actor RTT p50", t, t_ping, goal=goal)
                report(rows, f"{name} p99", "ms", "async actor RTT p99", t, t_ping, quantile=0.99)
            # The remote third unknown to the manager's index (written there by another
            # client), so every lookup asks the remote tier: a fresh tail per repeat,
            # since a probe teaches the index what it found.
            remote = ray.get(manager.tier_handles.remote())["remote"]
            tails = []
            for r in range(2 * (probe_reps + 1)):
                tail_tokens = range(TAIL_BASE + r * 100_000, TAIL_BASE + r * 100_000 + (n - b) * 16)
                full = maker.keys(head[: b * 16] + list(tail_tokens))
                tail = [s.key for s in full[b:]]
                ref = ray.put([np.zeros(nbytes, np.uint8)] * len(tail))
                ack = ray.get(remote.put.remote(tail, [meta_for(nbytes, 16)] * len(tail), [ref]))
                assert len(ack.accepted) == len(tail), ack
                tails.append(full)
            it = iter(PackedSpans.of(full).wire() for full in tails[: probe_reps + 1])

            def probed() -> None:
                assert ray.get(manager.lookup.remote(next(it))) == n * 16

            t, t_ping = paired(probed, rtt, probe_reps)
            name = f"lookup {n} chunks, remote third probed by the manager (packed)"
            report(rows, f"{name} p50", "ms", "async actor RTT p50", t, t_ping)
            report(rows, f"{name} p99", "ms", "async actor RTT p99", t, t_ping, quantile=0.99)
            # The same, the client asking the server beside the manager
            # (client_remote_probe): the whole client call, packing the spans included.
            it_client = iter(tails[probe_reps + 1 :])

            def client_probed() -> None:
                assert probing._lookup(next(it_client), False, None) == n * 16

            # The note the client sends the manager afterwards goes from a thread of its
            # own; it is let out between calls (untimed), so neither figure carries it.
            t, t_ping = interleave(
                lambda _i: client_probed(),
                lambda _i: rtt(),
                probe_reps,
                between=lambda: probing._probe.notes.drain(10),
            )
            name = f"lookup {n} chunks, remote third probed by the client"
            report(rows, f"{name} p50", "ms", "async actor RTT p50", t, t_ping, goal="goal <= 2.0")
            report(rows, f"{name} p99", "ms", "async actor RTT p99", t, t_ping, quantile=0.99)
    finally:
        probing.close()
        ray.kill(ping)
        shutdown_namespace(ns)
        try:
            ray.kill(ray.get_actor(f"kv-{ns}", namespace=ns))
        except ValueError:
            pass


def bench_prefetch(rows: list[dict], tmp: str, total_mib: int, reps: int) -> None:
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    config = RayKVConfig.load(
        namespace=ns,
        max_local_cpu_size=2.0,
        local_disk=os.path.join(tmp, "prefetch"),
        max_local_disk_size=2.0,
    )
    manager = get_or_create_manager(config)
    nbytes = 2 * MiB
    n = total_mib * MiB // nbytes
    spans = fresh_spans(n)
    keys = [s.key for s in spans]
    metas = [meta_for(nbytes)] * n
    try:
        for lo in range(0, n, 64):
            part = [
                np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
                for i in range(lo, min(n, lo + 64))
            ]
            ray.get(manager.put.remote(keys[lo : lo + 64], metas[lo : lo + 64], [ray.put(part)]))
            del part
        assert ray.get(manager.flush.remote(300))
        disk = ray.get(manager.tier_handles.remote())["disk"]

        def prefetch(_i: int) -> None:
            lid = uuid.uuid4().hex
            ray.get(manager.prefetch.remote(lid, spans))
            ready = ray.get(manager.wait.remote(lid))
            assert ready == spans[-1].end, ready
            ray.get(manager.unpin.remote(lid))

        def direct(_i: int) -> None:
            metas_ref, arrays_ref = disk.get_batch.options(num_returns=2).remote(keys)
            ray.wait([arrays_ref], fetch_local=False)
            assert all(m is not None for m in ray.get(metas_ref))

        def drop_cpu_copies() -> None:  # untimed: every prefetch reads all of it from disk
            ray.get(manager.remove.remote(keys, ["cpu"]))

        t_pf, t_direct = interleave(prefetch, direct, reps, between=drop_cpu_copies)
        name = f"prefetch {total_mib} MiB disk -> CPU (+wait)"
        report(rows, name, "GB/s", "disk get_batch called directly", t_pf, t_direct, n * nbytes)
    finally:
        shutdown_namespace(ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args()
    reps = 5 if args.quick else 9  # 3 gave bimodal put figures on a 2-core box
    ray.init(
        address="local",
        num_cpus=8,
        object_store_memory=6 << 30,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        namespace="raykv-bench",
    )
    rows: list[dict] = []
    tmp = tempfile.mkdtemp(prefix="raykv-bench-")
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        print(f"ray {ray.__version__}, {os.cpu_count()} cores, object store 6 GiB", flush=True)
        manager = get_or_create_manager(RayKVConfig.load(namespace=ns, max_local_cpu_size=1.0))
        # A CPUStore of its own for the direct paths: evictions it makes must not leave
        # the manager's index holding (and so keeping alive) objects it evicted.
        cpu = CPUStoreActor.options(num_cpus=0).remote(int(1.0 * 2**30), "lru")
        ray.get([manager.stats.remote(), cpu.stats.remote()])
        for chunk_mib in (2, 32):
            bench_put_get(rows, manager, cpu, chunk_mib, reps)
        frag = ray.get(cpu.stats.remote())["fragmentation"]
        print(f"CPU tier fragmentation after the put runs: {frag:.3f}")
        rows.append({"name": "cpu fragmentation", "value": frag})
        shutdown_namespace(ns)
        bench_lookup(rows, tmp, 100 if args.quick else 400)
        bench_prefetch(rows, tmp, 128 if args.quick else 512, 2 if args.quick else 5)
    finally:
        shutdown_namespace(ns)
        ray.shutdown()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary_of(rows), indent=2))


def summary_of(rows: list[dict]) -> dict:
    """The `--json` document: rows, goals and a GB/s bar chart (see benchmarks._util.Summary)."""
    figures = [r for r in rows if "unit" in r]
    gbs = [r for r in figures if r["unit"] == "GB/s" and not r["name"].startswith("numpy")]
    seen: dict[str, dict] = {}
    for r in gbs:  # one bar pair per measurement: the first baseline (raw batched ray.put)
        seen.setdefault(r["name"], r)
    plot = {
        "name": "tiers_cpu_gbs",
        "title": "CPU tier GB/s (raykv vs same-run baseline)",
        "xlabel": "",
        "ylabel": "GB/s",
        "kind": "bar",
        "categories": list(seen),
        "series": {
            "raykv": [r["value"] for r in seen.values()],
            "baseline": [r["baseline_value"] for r in seen.values()],
        },
        "xscale": "linear",
    }
    frag = [r for r in rows if "unit" not in r]
    for r in frag:
        figures.append({"name": r["name"], "value": r["value"], "unit": "", "baseline": ""})
    return {"rows": figures, "goals": GOALS, "plots": [plot]}


if __name__ == "__main__":
    main()
