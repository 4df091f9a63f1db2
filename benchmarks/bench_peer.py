"""The peer tier on a 2-node cluster: a prefix another node holds vs recomputing it.

    python -m benchmarks.bench_peer [--quick] [--prefixes 1024 4096 8192] [--repeats 5]
                                    [--json PATH]

Cluster: `ray.cluster_utils.Cluster` with a head and nodes A and B, each its own raylet
and object store on this machine (objects cross between them as between hosts, over
loopback). raykv runs with ``enable_controller: true``: one StorageManager + CPUStore
per node, and the KVController. A model client actor is pinned to each of A and B (the
demo Llama architecture, 4 layers, hidden 256, 2 KV heads of 64, fp32, one torch
thread, 4 KiB of KV per token, chunk 64 tokens). No disk or remote tier: a chunk is
either in a node's CPU tier or recomputed.

Per prefix length and repetition (a fresh random prefix each time, + a 64-token suffix):
* cold: B generates for a prompt nobody has cached: TTFT = prefill of the whole prompt
  (what a miss costs; the recompute baseline);
* A generates for the prompt (its KV lands in A's CPU tier); the driver waits until the
  controller lists A for the whole prefix;
* peer: B generates for the same prefix + a new suffix: its manager finds the prefix
  on A through the controller and pulls the objects from A's store (`hit_tiers`
  {"peer": n}); TTFT = load + suffix prefill; `load` = lookup + retrieve;
* local: B again (the prefix was promoted into B's CPU tier, a copy made after the peer
  hit was served: the driver flushes B first): `hit_tiers` {"cpu": n};
* raw: B `ray.get`s an object of the same bytes that an actor on A put (moving the bytes
  between the nodes, with nothing of raykv around it: the floor for the peer load);
* fetch: A stores another prefix of the same length (random KV, no prefill); B's client
  makes the connector's lookup (`KVCache.fetch_spans`: one manager call that finds the
  prefix on A and promotes it into B's CPU tier): the time for the chunks to reach this
  node, in the state the raw `ray.get` leaves its bytes in (an object in B's store,
  readable without a copy). The peer load above also copies the KV into the model's
  cache, which a local hit pays too and the raw get does not.

Figures (medians): TTFT cold / peer / local, the peer speedup over recompute, the peer
load and the peer fetch beside the raw cross-node `ray.get` of the same bytes. Goals: a
peer hit is faster than recomputing (speedup > 1) at every length; a peer fetch takes at
most 1.5x the raw get (issue #28).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import Summary, extent, print_table  # noqa: E402
from benchmarks.bench_cluster import MODEL  # noqa: E402  (the same small demo model)
from raykv.actors.controller import wait_listed  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402
from raykv.config import RayKVConfig  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402

TITLE = "Peer tier vs recompute (2-node cluster)"
CHUNK, SUFFIX = 64, 64
# K and V x layers x kv heads x head dim x fp32
BYTES_PER_TOKEN = (
    2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4
)
# 1 GiB each: at 16k tokens (64 MiB) a 512 MiB store filled with the peer's copies, the
# promoted ones and the raw objects, and Ray's puts slowed down (or spilled).
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 1024**3}


@ray.remote(num_cpus=1)
class Client:
    """A serving process on one node: the demo model + raykv (the node's manager)."""

    def __init__(self, config: RayKVConfig) -> None:
        from raykv.demo.gpu_worker import ModelWorker

        self.worker = ModelWorker(config, 0, num_threads=1, **MODEL)

    def generate(self, tokens: list[int]) -> dict[str, Any]:
        out = self.worker.generate(tokens, 1)
        return {k: out[k] for k in ("ttft_s", "load_s", "hit_tokens", "hit_tiers")}

    def flush(self) -> bool:
        return self.worker.kv.flush(30)

    def store_random(self, tokens: list[int]) -> int:
        """Store random KV for `tokens` (a prefix in this node's CPU tier, no prefill)."""
        import torch

        hidden = MODEL["num_key_value_heads"] * MODEL["head_dim"]
        kv = torch.randn(2, MODEL["num_hidden_layers"], len(tokens), hidden)
        return self.worker.kv.store(tokens, kv)

    def fetch_seconds(self, tokens: list[int]) -> tuple[float, list[tuple[str, int]]]:
        """Seconds for the connector's lookup (`fetch_spans`) to bring `tokens`' prefix
        into this node's CPU tier, and where it was found; the pins are released."""
        kv = self.worker.kv
        spans = kv.spans(tokens)
        lookup_id = uuid.uuid4().hex
        t0 = time.perf_counter()
        n, sources = kv.fetch_spans(spans, lookup_id, timeout=30)
        elapsed = time.perf_counter() - t0
        if n:
            kv.unpin(lookup_id)
        return elapsed, sources

    def put(self, nbytes: int) -> list[ray.ObjectRef]:
        """An object of `nbytes` owned here (wrapped in a list: the ref, not the value)."""
        import numpy as np

        return [ray.put(np.ones(nbytes, dtype=np.uint8))]

    def get_seconds(self, refs: list[ray.ObjectRef]) -> float:
        """Seconds to `ray.get` an object another node holds."""
        t0 = time.perf_counter()
        value = ray.get(refs[0])
        elapsed = time.perf_counter() - t0
        assert value.nbytes > 0
        return elapsed


def _node_with(resource: str) -> str:
    for node in ray.nodes():
        if node["Alive"] and resource in node["Resources"]:
            return node["NodeID"]
    raise RuntimeError(f"no live node offers {resource!r}")


def measure(args: argparse.Namespace, cfg: RayKVConfig) -> dict[int, dict[str, list[float]]]:
    node_a, node_b = _node_with("node_a"), _node_with("node_b")
    on = lambda node: NodeAffinitySchedulingStrategy(node, soft=False)  # noqa: E731
    a = Client.options(scheduling_strategy=on(node_a)).remote(cfg)
    b = Client.options(scheduling_strategy=on(node_b)).remote(cfg)
    rng = random.Random(args.seed)
    vocab = MODEL["vocab_size"]
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    ray.get([a.generate.remote(prompt(2 * CHUNK)), b.generate.remote(prompt(2 * CHUNK))])
    results: dict[int, dict[str, list[float]]] = {}
    for n in args.prefixes:
        res = results.setdefault(
            n, {k: [] for k in ("cold", "peer", "local", "load", "raw", "fetch")}
        )
        for _ in range(args.repeats):
            cold = ray.get(b.generate.remote(prompt(n + SUFFIX)))
            assert cold["hit_tokens"] == 0, cold
            prefix = prompt(n)
            ray.get(a.generate.remote(prefix + prompt(SUFFIX)))
            ray.get(a.flush.remote())
            keys = [span.key for span in KeyMaker.from_config(cfg).keys(prefix)]
            if not wait_listed(cfg.namespace, keys, node_a, 60):
                raise RuntimeError("the controller never listed node A for the prefix")
            peer = ray.get(b.generate.remote(prefix + prompt(SUFFIX)))
            ray.get(b.flush.remote())  # B copies what it pulled after serving it
            local = ray.get(b.generate.remote(prefix + prompt(SUFFIX)))
            if peer["hit_tiers"] != {"peer": n} or local["hit_tiers"] != {"cpu": n}:
                raise RuntimeError(f"unexpected tiers: peer {peer}, local {local}")
            refs = ray.get(a.put.remote(n * BYTES_PER_TOKEN))
            raw = ray.get(b.get_seconds.remote(refs))
            del refs
            fresh = prompt(n)
            ray.get(a.store_random.remote(fresh))
            ray.get(a.flush.remote())
            keys = [span.key for span in KeyMaker.from_config(cfg).keys(fresh)]
            if not wait_listed(cfg.namespace, keys, node_a, 60):
                raise RuntimeError("the controller never listed node A for the stored prefix")
            fetch, sources = ray.get(b.fetch_seconds.remote(fresh))
            if sources != [("peer", n)]:
                raise RuntimeError(f"the fetch found {sources}, not a {n}-token peer prefix")
            res["fetch"].append(fetch)
            res["cold"].append(cold["ttft_s"])
            res["peer"].append(peer["ttft_s"])
            res["local"].append(local["ttft_s"])
            res["load"].append(peer["load_s"])
            res["raw"].append(raw)
        print(f"prefix {n}: done", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k and 4k prefixes, 3 repeats")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    args = parser.parse_args()
    if args.quick:
        args.prefixes, args.repeats = [1024, 4096], 3
    if any(n % CHUNK for n in args.prefixes):
        parser.error(f"prefix lengths must be multiples of {CHUNK}")
    from ray.cluster_utils import Cluster

    cfg = RayKVConfig.load(
        namespace=f"bench-peer-{uuid.uuid4().hex[:8]}",
        chunk_size=CHUNK,
        kv_dtype="float32",
        max_local_cpu_size=0.25,
        enable_controller=True,
    )
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "resources": {"head": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(**NODE_ARGS, resources={"node_a": 1})
        cluster.add_node(**NODE_ARGS, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        results = measure(args, cfg)
    finally:
        try:
            if ray.is_initialized():
                shutdown_namespace(cfg.namespace)
        finally:
            ray.shutdown()
            cluster.shutdown()
    report(results, args)


def report(results: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> None:
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    rows = []
    for n, m in med.items():
        mib = n * BYTES_PER_TOKEN / 2**20
        rows.append(
            [
                n,
                f"{mib:.0f}",
                f"{m['cold'] * 1000:.1f}",
                f"{m['peer'] * 1000:.1f}",
                f"{m['local'] * 1000:.1f}",
                f"{m['cold'] / m['peer']:.2f}x",
                f"{m['load'] * 1000:.1f}",
                f"{m['raw'] * 1000:.1f}",
                f"{m['load'] / m['raw']:.2f}x",
                f"{m['fetch'] * 1000:.1f}",
                f"{m['fetch'] / m['raw']:.2f}x",
            ]
        )
    print(f"\nmedians of {args.repeats} repeats; suffix {SUFFIX} tokens, chunk {CHUNK}\n")
    print_table(
        [
            "prefix tok",
            "KV MiB",
            "cold TTFT ms",
            "peer TTFT ms",
            "local TTFT ms",
            "peer speedup",
            "peer load ms",
            "raw ray.get ms",
            "load / raw",
            "peer fetch ms",
            "fetch / raw",
        ],
        rows,
    )
    summary = Summary()
    for n, m in med.items():
        r = results[n]
        summary.row(
            f"{n}-token prefix: TTFT, peer hit",
            m["peer"] * 1000,
            "ms",
            "recompute",
            m["cold"] * 1000,
            value_range=extent(r["peer"], 1000),
        )
        summary.row(
            f"{n}-token prefix: TTFT, local CPU hit",
            m["local"] * 1000,
            "ms",
            "recompute",
            m["cold"] * 1000,
            value_range=extent(r["local"], 1000),
        )
        summary.row(
            f"{n}-token prefix: peer load",
            m["load"] * 1000,
            "ms",
            "raw cross-node ray.get",
            m["raw"] * 1000,
            value_range=extent(r["load"], 1000),
        )
        summary.row(
            f"{n}-token prefix: peer fetch into this node's CPU tier",
            m["fetch"] * 1000,
            "ms",
            "raw cross-node ray.get",
            m["raw"] * 1000,
            value_range=extent(r["fetch"], 1000),
        )
    faster = all(m["peer"] < m["cold"] for m in med.values())
    worst = min(m["cold"] / m["peer"] for m in med.values())
    summary.goal("a peer hit beats recomputing the prefix (speedup > 1)", round(worst, 2), faster)
    slowest = max(m["fetch"] / m["raw"] for m in med.values())
    summary.goal("a peer fetch <= 1.5x a raw cross-node ray.get", round(slowest, 2), slowest <= 1.5)
    summary.plot(
        "peer_ttft",
        "TTFT on node B: recompute vs peer hit vs local hit",
        "prefix tokens",
        "TTFT (ms)",
        series={
            label: [[n, m[key] * 1000] for n, m in med.items()]
            for label, key in (("recompute", "cold"), ("peer", "peer"), ("local CPU", "local"))
        },
    )
    summary.write(args.json)


if __name__ == "__main__":
    main()
