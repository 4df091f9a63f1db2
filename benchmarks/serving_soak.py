"""The serving benchmark's soak (`python -m benchmarks.bench_serving --soak MINUTES`):
multi-round QA with new users arriving for as long as asked, on the `B` engine with a
small CPU tier (it evicts under pressure) above Redis. The CPU store is killed for good at
a third of the run; Redis is stopped at two thirds and restarted 30 s later. Every
process group's RSS and the object store are sampled each minute, HTTP errors counted,
and the time until raykv serves hits again is measured after each fault."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from typing import Any

from benchmarks import loadgen
from benchmarks._util import Summary, print_table
from benchmarks.bench_serving import (
    ARMS,
    CHUNK,
    MODEL_ID,
    actor_memory,
    group_rss,
    llm_config,
    object_store_bytes,
    start_app,
    stop_app,
    tier_settings,
)


def soak(model: str, args: argparse.Namespace, env: dict[str, Any], redis: Any) -> dict:
    """Multi-round QA with new users for `args.soak` minutes on the `B` engine with a small
    CPU tier above Redis; the CPU store is killed for good at 1/3, Redis stopped at 2/3
    (restarted 30 s later). Samples RSS per process group and the object store each
    minute; measures how soon hits come back after each fault."""
    import ray

    import raykv
    from raykv.actors.base import CPU_STORE_NAME

    namespace = f"bench-soak-{uuid.uuid4().hex[:8]}"
    ARMS["soak"] = (1, "pow2", "soak", False)
    control = args.soak_arm == "A"  # plain vLLM, the same load: whose memory grows?
    config = llm_config(args.soak_arm, model, namespace, args, env["redis_url"])
    try:
        start_app(config, env["port"])
    except BaseException:
        stop_app(namespace)  # a half-started app and its actors go with the failure
        raise
    kv = None
    if not control:
        settings = tier_settings("soak", args, env["redis_url"])
        kv = raykv.connect(namespace=namespace, chunk_size=CHUNK, **settings)
    total = args.soak * 60.0
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    results: list[loadgen.Result] = []
    done = threading.Event()

    def hits() -> int:
        return int(kv.stats().get("hit_tokens", 0)) if kv is not None else 0

    def recovery(what: str) -> None:
        """Seconds from `what` until raykv serves a hit again (lookups found tokens)."""
        start, base = time.monotonic(), hits()
        while not done.is_set() and time.monotonic() - start < 120:
            if hits() > base:
                events.append(
                    {
                        "event": what,
                        "at_min": (start - t0) / 60,
                        "hits_after_s": time.monotonic() - start,
                    }
                )
                return
            time.sleep(0.25)
        events.append({"event": what, "at_min": (start - t0) / 60, "hits_after_s": None})

    def monitor() -> None:
        fired = set()
        next_sample = 0.0
        while not done.wait(1.0):
            now = time.monotonic() - t0
            if now >= next_sample:
                samples.append(
                    {
                        "min": now / 60,
                        "rss_mib": group_rss({"redis": redis.proc.pid if redis.proc else 0}),
                        "raykv_mib": actor_memory(),
                        "store_mib": object_store_bytes(),
                        "requests": len(results),
                        "errors": sum(1 for r in results if r.error),
                    }
                )
                next_sample += 60.0
            if control:
                continue  # no raykv: nothing to break
            if now >= total / 3 and "cpu" not in fired:
                fired.add("cpu")
                ray.kill(ray.get_actor(CPU_STORE_NAME, namespace=namespace), no_restart=True)
                recovery("CPU store killed for good")
            if now >= 2 * total / 3 and "redis" not in fired:
                fired.add("redis")
                redis.stop()
                time.sleep(30)
                redis.start()
                recovery("Redis restarted after 30 s down")

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    batch = 0
    try:
        while time.monotonic() - t0 < total:
            sessions = loadgen.workload("mrqa", args.shape, seed=10_000 + batch)
            got, _ = asyncio.run(
                loadgen.drive(env["port"], MODEL_ID, "mrqa", sessions, concurrency=args.concurrency)
            )
            results += got
            batch += 1
    finally:
        done.set()
        watcher.join()
        if kv is not None:
            kv.close()
        stop_app(namespace)
    return {
        "samples": samples,
        "events": events,
        "requests": len(results),
        "errors": sum(1 for r in results if r.error),
        # What the failed requests got (the first few, each once): a soak that counts
        # errors says which.
        "error_texts": list(dict.fromkeys(r.error for r in results if r.error))[:5],
        "minutes": args.soak,
        "arm": args.soak_arm,
    }


def report_soak(soaked: dict[str, Any], summary: Summary) -> None:
    arm = soaked.get("arm", "soak")
    print(f"\n## soak ({arm}): {soaked['minutes']} min, {soaked['requests']} requests, ", end="")
    print(f"{soaked['errors']} errors")
    for text in soaked.get("error_texts", []):
        print(f"- error: {text}")
    groups = sorted({g for s in soaked["samples"] for g in s["rss_mib"]})
    print_table(
        ["minute", *[f"{g} RSS MiB" for g in groups], "object store MiB", "requests", "errors"],
        [
            [
                f"{s['min']:.0f}",
                *(f"{s['rss_mib'].get(g, 0):.0f}" for g in groups),
                f"{s['store_mib']:.0f}",
                s["requests"],
                s["errors"],
            ]
            for s in soaked["samples"]
        ],
    )
    actors = sorted({a for s in soaked["samples"] for a in s.get("raykv_mib", {})})
    if actors:
        print("\nraykv's actors, RSS / USS MiB (USS: without the object-store pages it touched)")
        print_table(
            ["minute", *actors],
            [
                [
                    f"{s['min']:.0f}",
                    *(
                        "{:.0f} / {:.0f}".format(*s["raykv_mib"][a]) if a in s["raykv_mib"] else "-"
                        for a in actors
                    ),
                ]
                for s in soaked["samples"]
            ],
        )
    for e in soaked["events"]:
        back = "never (120 s)" if e["hits_after_s"] is None else f"{e['hits_after_s']:.1f} s"
        print(f"{e['event']} at minute {e['at_min']:.1f}: hits back after {back}")
    summary.goal("soak: HTTP errors == 0", soaked["errors"], soaked["errors"] == 0)
    late = [s for s in soaked["samples"] if s["min"] >= 5]
    if len(late) >= 2 and actors:  # raykv's own memory: the USS of its live actors
        uss = [sum(u for _, u in s.get("raykv_mib", {}).values()) for s in late]
        if uss[0]:
            summary.goal(
                "soak: raykv USS growth after minute 5 <= 5 %",
                round(max(uss) / uss[0] - 1, 3),
                max(uss) / uss[0] <= 1.05,
            )
    if len(late) >= 2:
        for g in groups:
            first, peak = (
                late[0]["rss_mib"].get(g, 0.0),
                max(s["rss_mib"].get(g, 0.0) for s in late),
            )
            if first:
                summary.goal(
                    f"soak: {g} RSS growth after minute 5 <= 5 %",
                    round(peak / first - 1, 3),
                    peak / first <= 1.05,
                )
    for e in soaked["events"]:
        s = e["hits_after_s"]
        summary.goal(
            f"soak: hits back <= 5 s after: {e['event']}",
            "never" if s is None else round(s, 1),
            s is not None and s <= 5,
        )
