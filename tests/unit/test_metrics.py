"""Metric definitions: fixed tag keys, loud on programming errors, silent without Ray."""

from __future__ import annotations

import pytest

from raykv import metrics
from raykv.errors import InvalidInputError


def test_every_metric_is_a_raykv_name_with_a_known_kind():
    for name, (kind, description, tag_keys) in metrics.METRICS.items():
        assert name.startswith("raykv_") and description
        assert kind in {"counter", "gauge", "histogram"}
        assert isinstance(tag_keys, tuple)


def test_recording_without_ray_is_a_no_op_and_caches_nothing(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(metrics, "_created", {})
    metrics.inc("raykv_lookups")
    metrics.set_gauge("raykv_used_bytes", 5, tier="cpu", policy="lru")
    metrics.observe("raykv_store_latency_ms", 1.5)
    assert metrics._created == {}


@pytest.mark.parametrize(
    "call",
    [
        lambda: metrics.inc("raykv_evictions", tier="cpu"),  # missing policy
        lambda: metrics.inc("raykv_lookups", tier="cpu"),  # extra tag
        lambda: metrics.inc("raykv_no_such_metric"),
    ],
)
def test_wrong_tags_or_names_raise(call):
    with pytest.raises(InvalidInputError):
        call()
