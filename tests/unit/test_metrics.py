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
    metrics.flush()
    assert metrics._created == {} and not metrics._pending


def test_values_are_queued_and_reach_ray_on_flush_counters_summed(monkeypatch):
    calls: list[tuple[str, str, float, object]] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, method: str):
            return lambda value, tags=None: calls.append((self.name, method, value, tags))

    monkeypatch.setattr(metrics, "_ray_up", lambda: True)
    monkeypatch.setattr(metrics, "_metric", Fake)
    metrics.flush()  # whatever an earlier test left
    calls.clear()
    for _ in range(3):
        metrics.inc("raykv_lookups")
    metrics.inc("raykv_evictions", 2, tier="cpu", policy="lru")
    metrics.inc("raykv_evictions", 5, tier="disk", policy="lru")
    metrics.set_gauge("raykv_used_bytes", 5, tier="cpu", policy="lru")
    metrics.set_gauge("raykv_used_bytes", 7, tier="cpu", policy="lru")
    metrics.observe("raykv_store_latency_ms", 1.5)
    metrics.observe("raykv_store_latency_ms", 2.5)
    assert calls == []  # nothing reaches Ray on the request path
    metrics.flush()
    assert sorted(calls, key=repr) == sorted(
        [
            ("raykv_lookups", "inc", 3.0, None),
            ("raykv_evictions", "inc", 2.0, {"tier": "cpu", "policy": "lru"}),
            ("raykv_evictions", "inc", 5.0, {"tier": "disk", "policy": "lru"}),
            ("raykv_used_bytes", "set", 7, {"tier": "cpu", "policy": "lru"}),
            ("raykv_store_latency_ms", "observe", 1.5, None),
            ("raykv_store_latency_ms", "observe", 2.5, None),
        ],
        key=repr,
    )
    assert metrics._flusher is not None and metrics._flusher.is_alive()  # flushes on its own


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
