"""raykv's Prometheus metrics, through `ray.util.metrics`.

Ray's metrics agent exports them (prefixed `ray_`, counters suffixed `_total`) to
Prometheus and the dashboard's Grafana. Tag keys are fixed per metric. Metrics are
created lazily in the process that records them (each actor has its own), and
recording is a no-op outside a Ray worker, so plain classes stay testable without Ray.

Recording is deferred: a call checks its name and tags (a wrong one raises at once) and
queues the value; a daemon thread hands the queue to Ray every `FLUSH_SECS`, counters
summed per tag set. A Ray metric call costs ~6 us warm and tens of us on cold caches,
and a lookup records four: on the request path they cost more than the lookup's own
work. Ray exports metrics every few seconds, so the delay does not show.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from typing import Any

from raykv.errors import InvalidInputError

logger = logging.getLogger(__name__)

_LATENCY_BOUNDARIES_MS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000]

# name -> (kind, description, tag keys)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "raykv_lookups": ("counter", "Prefix lookups served.", ()),
    "raykv_hit_tokens": ("counter", "Prompt tokens found in the cache.", ()),
    "raykv_miss_tokens": ("counter", "Prompt tokens looked up and not found.", ()),
    "raykv_tier_hit_tokens": ("counter", "Hit tokens served per tier.", ("tier",)),
    "raykv_hit_tokens_by_filler": (
        "counter",
        "A vLLM engine's raykv hit tokens by who stored them: this_engine or another_engine.",
        ("filler",),
    ),
    "raykv_connector_lookups": (
        "counter",
        "A vLLM engine's raykv lookups: sent; from_view (answered from its copy of the CPU "
        "tier's keys, none sent); not_back_in_step (the request waits a step); timed_out "
        "and refused (the cap on lookups in flight): computed.",
        ("outcome",),
    ),
    "raykv_connector_waits": (
        "counter",
        "Engine steps that waited on raykv: a vLLM request for its lookup or for a load in "
        "flight; a worker's step for a save's copy of a block it reuses (save_copy), or at "
        "its end for a load about to end (ending_load, load_wait_ms).",
        ("reason",),
    ),
    "raykv_connector_loads": (
        "counter",
        "A vLLM engine's raykv hits (async load mode) by how they loaded: async or in_step; "
        "recomputed: a load that wrote no block, its request computed instead.",
        ("mode",),
    ),
    "raykv_connector_load_tokens": (
        "counter",
        "Tokens a vLLM engine's raykv loads wrote (loaded) or could not (failed: recomputed).",
        ("result",),
    ),
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


_created: dict[str, Any] = {}


def _metric(name: str) -> Any:
    """The metric object, created on first use in a Ray worker; None outside Ray.

    Only real metric objects are cached, so a call made before `ray.init()` does not
    switch the metric off for the life of the process.
    """
    metric = _created.get(name)
    if metric is not None:
        return metric
    kind, description, tag_keys = METRICS[name]
    try:
        import ray
        from ray.util import metrics as ray_metrics

        if not ray.is_initialized():
            return None
        if kind == "counter":
            metric = ray_metrics.Counter(name, description=description, tag_keys=tag_keys)
        elif kind == "gauge":
            metric = ray_metrics.Gauge(name, description=description, tag_keys=tag_keys)
        else:
            metric = ray_metrics.Histogram(
                name, description=description, boundaries=_LATENCY_BOUNDARIES_MS, tag_keys=tag_keys
            )
    except Exception:  # metrics must never break the data path
        logger.debug("metric %s unavailable", name, exc_info=True)
        return None
    _created[name] = metric
    return metric


def _tags(name: str, tags: dict[str, str]) -> dict[str, str] | None:
    """Check the tags against the metric's fixed tag keys: a mismatch is a programming error."""
    if name not in METRICS:
        raise InvalidInputError(f"unknown metric {name!r}; known: {', '.join(sorted(METRICS))}")
    keys = METRICS[name][2]
    if set(tags) != set(keys):
        raise InvalidInputError(f"metric {name!r} takes tags {sorted(keys)}, got {sorted(tags)}")
    return {k: str(tags[k]) for k in keys} if keys else None


FLUSH_SECS = 1.0
MAX_PENDING = 100_000  # a caller past this many queued values flushes them itself

# (name, method, value, checked tags), in call order: appended and popped without a lock
# (both are atomic on a deque), so a value queued during a flush waits for the next one.
_pending: deque[tuple[str, str, float, dict[str, str] | None]] = deque()
_flusher: threading.Thread | None = None
_flusher_lock = threading.Lock()


def _ray_up() -> bool:
    ray = sys.modules.get("ray")  # never imports Ray: without it nothing is recorded
    return ray is not None and ray.is_initialized()


def _record(name: str, method: str, value: float, tags: dict[str, str]) -> None:
    checked = _tags(name, tags)
    if not _ray_up():
        return
    _pending.append((name, method, value, checked))
    if _flusher is None or not _flusher.is_alive():
        _start_flusher()
    if len(_pending) > MAX_PENDING:
        flush()


def start_flusher() -> None:
    """Start the thread that hands queued values to Ray now, from the calling thread (a
    thread inherits its starter's cores: raykv.cpus), instead of at the first value."""
    if _ray_up():
        _start_flusher()


def _start_flusher() -> None:
    global _flusher
    with _flusher_lock:
        if _flusher is None or not _flusher.is_alive():  # none yet, or lost in a fork
            _flusher = threading.Thread(target=_flush_forever, name="raykv-metrics", daemon=True)
            _flusher.start()


def _flush_forever() -> None:
    while True:
        time.sleep(FLUSH_SECS)
        flush()


def flush() -> None:
    """Hand every queued value to Ray now (counters summed per tag set, gauges at their
    last value, each histogram observation on its own)."""
    batch = [_pending.popleft() for _ in range(len(_pending))]
    if not batch:
        return
    merged: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    observed: list[tuple[str, float, dict[str, str] | None]] = []
    tag_sets: dict[tuple[tuple[str, str], ...], dict[str, str] | None] = {}
    for name, method, value, checked in batch:
        if method == "observe":
            observed.append((name, value, checked))
            continue
        tag_key = tuple(checked.items()) if checked else ()
        tag_sets[tag_key] = checked
        key = (name, method, tag_key)
        merged[key] = merged.get(key, 0.0) + value if method == "inc" else value
    calls = [(n, m, v, tag_sets[t]) for (n, m, t), v in merged.items()]
    calls += [(n, "observe", v, c) for n, v, c in observed]
    for name, method, value, checked in calls:
        metric = _metric(name)
        if metric is None:
            continue
        try:
            getattr(metric, method)(value, tags=checked)
        except Exception:  # a metrics hiccup must never fail a cache operation
            logger.debug("metric %s %s failed", name, method, exc_info=True)


def inc(name: str, value: float = 1.0, **tags: str) -> None:
    """Add `value` to counter `name` (no-op without Ray or for value 0)."""
    if value:
        _record(name, "inc", value, tags)


def set_gauge(name: str, value: float, **tags: str) -> None:
    """Set gauge `name`."""
    _record(name, "set", value, tags)


def observe(name: str, value: float, **tags: str) -> None:
    """Record one observation in histogram `name`."""
    _record(name, "observe", value, tags)
