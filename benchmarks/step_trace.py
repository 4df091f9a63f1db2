"""Where a request's time-to-first-token goes, step by step (`bench_serving --step-trace DIR`).

`TracingConnector` is raykv's vLLM connector that also writes, from the scheduler's
process, one JSON line per scheduler step (when it was built, the tokens each request
got in it, the loads it carries) and one each time vLLM asks it about a waiting request
(the first with the request's arrival), to `DIR/<arm>-<pid>.jsonl`;
`TraceOnlyConnector` writes the same for arms without raykv. Read them with

    python -m benchmarks.step_trace DIR

which prints, per arm, for raykv hits (loaded by the connector), vLLM-local hits and
misses apart (a hit's first scheduled step computes fewer than `--hit-below` of its
tokens: the rest was cached): the time from its arrival at the engine's frontend to the
scheduler's first look at it (the step in progress, then any step whose budget running
requests used up), from there to its first scheduled step (raykv's lookup, vLLM's queue;
how often it was asked again meanwhile), the length of that step (to the next step's
start), the tokens that step computed, and how many requests started in it. A debugging
aid for the benchmark, not part of raykv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from raykv.integrations.vllm import RayKVConnector

ENV = "RAYKV_BENCH_STEP_TRACE"  # the file prefix, DIR/<arm>; set per arm by bench_serving


class _Trace:
    """The scheduler's trace file (None where `ENV` is not set or on a worker)."""

    def __init__(self, role: Any) -> None:
        prefix = os.environ.get(ENV)
        self.file = None
        self.seen: set[str] = set()
        if prefix and role == KVConnectorRole.SCHEDULER:
            self.file = open(f"{prefix}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None and not self.file.closed:
            self.file.write(json.dumps(record) + "\n")

    def request(self, request: Any, num_computed_tokens: int, answer: Any) -> None:
        if self.file is None:
            return
        if request.request_id in self.seen:
            # asked again: not scheduled last time (its lookup not back, no free blocks
            # for it, or the step's token budget spent)
            self.write({"ev": "ask", "id": request.request_id, "answer": answer[0]})
        else:
            self.seen.add(request.request_id)
            self.write(
                {
                    "ev": "seen",
                    "t": time.time(),
                    "arrival": getattr(request, "arrival_time", None),  # frontend, time.time()
                    "id": request.request_id,
                    "prompt": request.num_tokens,
                    "local": num_computed_tokens,
                }
            )

    def step(self, scheduler_output: Any, loads: list[Any]) -> None:
        if self.file is not None:
            self.write(
                {
                    "ev": "step",
                    "t": time.time(),
                    "tokens": dict(scheduler_output.num_scheduled_tokens),
                    "loads": [[s.req_id, s.end - s.start, s.sync] for s in loads],
                }
            )


class TracingConnector(RayKVConnector):
    """`RayKVConnector` + the scheduler's step trace (only where `ENV` is set)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._trace = _Trace(role)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        got = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._trace.request(request, num_computed_tokens, got)
        return got

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._trace.step(scheduler_output, self._pending_loads)
        return super().build_connector_meta(scheduler_output)


class TraceOnlyConnector(KVConnectorBase_V1):
    """A connector that only traces (arms without raykv: `A`, `A+`): no hit, no load, no
    save, so vLLM schedules as without a connector."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._trace = _Trace(role)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self._trace.request(request, num_computed_tokens, (0, False))
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._trace.step(scheduler_output, [])
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def analyse(path: Path, hit_below: int) -> dict[str, dict[str, list[float]]]:
    """{"raykv hit" | "vLLM-local hit" | "miss": {figure: values}} for one trace file."""
    seen: dict[str, float] = {}
    arrived: dict[str, float] = {}  # when the engine's frontend took the request
    steps: list[dict[str, Any]] = []
    # Asked again before its first step: answered (a hit or a miss) but not scheduled
    # (no free blocks for it, or the step's token budget spent), or still waiting for
    # its lookup (answer None).
    refused: dict[str, int] = {}
    waiting: dict[str, int] = {}
    running: set[str] = set()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["ev"] == "ask" and rec["id"] not in running:
            into = waiting if rec["answer"] is None else refused
            into[rec["id"]] = into.get(rec["id"], 0) + 1
        elif rec["ev"] == "seen":
            seen.setdefault(rec["id"], rec["t"])
            if rec.get("arrival"):
                arrived.setdefault(rec["id"], rec["arrival"])
        elif rec["ev"] == "step":
            steps.append(rec)
            running.update(rec["tokens"])
    loaded = {load[0] for step in steps for load in step["loads"]}  # raykv hits
    out: dict[str, dict[str, list[float]]] = {"raykv hit": {}, "vLLM-local hit": {}, "miss": {}}
    started: set[str] = set()
    for i, step in enumerate(steps[:-1]):
        length = steps[i + 1]["t"] - step["t"]
        fresh = [r for r in step["tokens"] if r not in started and r in seen]
        for req in fresh:
            started.add(req)
            if step["tokens"][req] >= hit_below:
                kind = "miss"
            else:
                kind = "raykv hit" if req in loaded else "vLLM-local hit"
            figures = out[kind]
            if req in arrived:
                figures.setdefault("arrival to seen ms", []).append(
                    (seen[req] - arrived[req]) * 1e3
                )
            figures.setdefault("seen to scheduled ms", []).append((step["t"] - seen[req]) * 1e3)
            figures.setdefault("asks answered, not scheduled", []).append(refused.get(req, 0))
            figures.setdefault("asks while looking up", []).append(waiting.get(req, 0))
            figures.setdefault("first step ms", []).append(length * 1e3)
            figures.setdefault("tokens in that step", []).append(sum(step["tokens"].values()))
            figures.setdefault("requests starting with it", []).append(len(fresh))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--hit-below", type=int, default=1024)
    args = parser.parse_args()
    for path in sorted(args.dir.glob("*.jsonl")):
        print(f"\n{path.name}")
        for kind, figures in analyse(path, args.hit_below).items():
            n = len(next(iter(figures.values()), []))
            cells = ", ".join(
                f"{name} p50 {statistics.median(v):.0f} / mean {statistics.fmean(v):.1f}"
                for name, v in figures.items()
            )
            print(f"  {kind} ({n}): {cells}")


if __name__ == "__main__":
    main()
