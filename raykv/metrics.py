"""raykv's Prometheus metrics, through `ray.util.metrics`.

Ray's metrics agent exports them (prefixed `ray_`, counters suffixed `_total`) to
Prometheus and the dashboard's Grafana. Tag keys are fixed per metric. Metrics are
created lazily in the process that records them (each actor has its own), and
recording is a no-op outside a Ray worker, so plain classes stay testable without Ray.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

_LATENCY_BOUNDARIES_MS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000]

# name -> (kind, description, tag keys)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "raykv_lookups": ("counter", "Prefix lookups served.", ()),
    "raykv_hit_tokens": ("counter", "Prompt tokens found in the cache.", ()),
    "raykv_miss_tokens": ("counter", "Prompt tokens looked up and not found.", ()),
    "raykv_tier_hit_tokens": ("counter", "Hit tokens served per tier.", ("tier",)),
    "raykv_stored_bytes": ("counter", "Bytes written per tier.", ("tier",)),
    "raykv_used_bytes": ("gauge", "Bytes held per tier.", ("tier", "policy")),
    "raykv_entries": ("gauge", "Chunks held per tier.", ("tier", "policy")),
    "raykv_evictions": ("counter", "Chunks evicted per tier and policy.", ("tier", "policy")),
    "raykv_remote_errors": ("counter", "Failed or timed-out remote operations.", ("backend",)),
    "raykv_tier_errors": (
        "counter",
        "Failed tier reads/writes (I/O error, corrupt payload, disk full) per tier and kind.",
        ("tier", "kind"),
    ),
    "raykv_skipped_stores": ("counter", "Chunks not cached for lack of room (pinned).", ("tier",)),
    "raykv_prefetch_latency_ms": ("histogram", "Prefetch latency.", ()),
    "raykv_store_latency_ms": ("histogram", "Store latency per request.", ()),
    "raykv_retrieve_latency_ms": ("histogram", "Retrieve latency per request.", ()),
}


@functools.cache
def _metric(name: str) -> Any:
    kind, description, tag_keys = METRICS[name]
    try:
        import ray
        from ray.util import metrics as ray_metrics

        if not ray.is_initialized():
            return None
        if kind == "counter":
            return ray_metrics.Counter(name, description=description, tag_keys=tag_keys)
        if kind == "gauge":
            return ray_metrics.Gauge(name, description=description, tag_keys=tag_keys)
        return ray_metrics.Histogram(
            name, description=description, boundaries=_LATENCY_BOUNDARIES_MS, tag_keys=tag_keys
        )
    except Exception:  # metrics must never break the data path
        logger.debug("metric %s unavailable", name, exc_info=True)
        return None


def _tags(name: str, tags: dict[str, str] | None) -> dict[str, str] | None:
    keys: Sequence[str] = METRICS[name][2]
    return {k: str((tags or {})[k]) for k in keys} if keys else None


def inc(name: str, value: float = 1.0, **tags: str) -> None:
    """Add `value` to counter `name` (no-op without Ray or for value 0)."""
    metric = _metric(name)
    if metric is not None and value:
        try:
            metric.inc(value, tags=_tags(name, tags))
        except Exception:
            logger.debug("metric %s inc failed", name, exc_info=True)


def set_gauge(name: str, value: float, **tags: str) -> None:
    """Set gauge `name`."""
    metric = _metric(name)
    if metric is not None:
        try:
            metric.set(value, tags=_tags(name, tags))
        except Exception:
            logger.debug("metric %s set failed", name, exc_info=True)


def observe(name: str, value: float, **tags: str) -> None:
    """Record one observation in histogram `name`."""
    metric = _metric(name)
    if metric is not None:
        try:
            metric.observe(value, tags=_tags(name, tags))
        except Exception:
            logger.debug("metric %s observe failed", name, exc_info=True)
