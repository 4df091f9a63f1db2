"""Every arm of the serving benchmark builds its Ray Serve LLM config (no Ray, no engine):
the same engine geometry and pool in every arm, the connector only where raykv is on,
the enlarged pool only in the A+ arms, per-token streaming everywhere."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import vllm_testing as vt

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from benchmarks import bench_serving as bs  # noqa: E402


@pytest.mark.parametrize("arm", sorted(bs.ARMS))
def test_every_arm_builds_its_config(arm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(
        ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1")
    )
    args = argparse.Namespace(pool_mib=48, tier_mib=256, engine_cores="0", disk_dir="/tmp/x")
    cfg = bs.llm_config(arm, "/models/m", "ns" if bs.ARMS[arm][2] else "", args, "redis://h:1/0")
    replicas, _router, tier, enlarged = bs.ARMS[arm]
    engine = cfg.engine_kwargs
    # an enlarged arm's replicas share the tier's bytes, as raykv arms share one tier
    assert engine["kv_cache_memory_bytes"] == (48 + (256 // replicas if enlarged else 0)) << 20
    assert ("kv_transfer_config" in engine) == (tier is not None)
    assert engine["block_size"] == bs.BLOCK and engine["dtype"] == "float32"
    assert cfg.experimental_configs["stream_batching_interval_ms"] == 0
    assert cfg.deployment_config["num_replicas"] == replicas
    if "events" in arm:  # the replicas publish KV events; the router reads raykv's?
        from raykv.integrations.serve_llm import EventsServer

        assert cfg.server_cls is EventsServer
        kwargs = cfg.deployment_config["request_router_config"].request_router_kwargs
        if _router == "events":
            assert kwargs.get("raykv_events", True) == (arm == "2-events")
    else:
        assert cfg.server_cls is None


@pytest.mark.parametrize("arm", ["A+", "B"])
def test_a_step_trace_traces_every_arm_and_gives_raykv_only_to_raykv_arms(
    arm: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import ray

    from benchmarks.step_trace import ENV

    monkeypatch.setattr(
        ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1")
    )
    args = argparse.Namespace(
        pool_mib=48, tier_mib=256, engine_cores="0", disk_dir="/tmp/x", step_trace=str(tmp_path)
    )
    cfg = bs.llm_config(arm, "/models/m", "ns" if bs.ARMS[arm][2] else "", args, "redis://h:1/0")
    transfer = cfg.engine_kwargs["kv_transfer_config"]
    assert transfer["kv_connector_module_path"] == "benchmarks.step_trace"
    raykv_on = bs.ARMS[arm][2] is not None
    assert transfer["kv_connector"] == ("TracingConnector" if raykv_on else "TraceOnlyConnector")
    assert ("kv_connector_extra_config" in transfer) == raykv_on
    assert cfg.runtime_env["env_vars"][ENV] == str(tmp_path / arm)


def test_the_sweep_finds_each_arms_highest_rate_under_twice_as_unloaded_p99() -> None:
    from benchmarks._util import Summary
    from benchmarks.serving_sweep import highest_rate, report_sweep

    def run(p99: float, p50: float = 0.1, errors: int = 0) -> dict:
        return {"rps": 1.0, "ttft_p50": p50, "ttft_p99": p99, "itl_p99": 0.1, "errors": errors}

    a = [(0.2, run(1.0, p50=0.5)), (0.4, run(1.5, p50=0.8)), (0.8, run(3.0))]
    b = [(0.2, run(0.5)), (0.4, run(0.6)), (0.8, run(1.0, errors=1))]
    assert highest_rate(a, 2.0) == 0.4 and highest_rate(b, 2.0) == 0.4  # an error ends it
    assert highest_rate([(0.2, run(3.0))], 2.0) is None
    summary = Summary()
    args = argparse.Namespace(workloads=["mrqa"], sweep=[0.2, 0.4, 0.8])
    report_sweep({"A": {"mrqa": a}, "B": {"mrqa": b}}, args, summary)
    goals = {g["goal"].split(" (")[0]: g for g in summary.goals}
    assert goals["sweep mrqa: highest rate B/A >= 3"]["value"] == 1.0
    assert goals["sweep mrqa: B/A ttft_p50 at 0.2 req/s"]["value"] == 0.2  # 0.7 x 0.4 -> 0.2
