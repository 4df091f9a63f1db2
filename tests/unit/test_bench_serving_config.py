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
    assert engine["kv_cache_memory_bytes"] == (48 + (256 if enlarged else 0)) << 20
    assert ("kv_transfer_config" in engine) == (tier is not None)
    assert engine["block_size"] == bs.BLOCK and engine["dtype"] == "float32"
    assert cfg.experimental_configs["stream_batching_interval_ms"] == 0
    assert cfg.deployment_config["num_replicas"] == replicas
