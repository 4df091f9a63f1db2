"""`Fillers`: who stored the chunks of a vLLM engine's raykv hit (this engine or another);
`CounterExport`: the scheduler's counters as metrics."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from raykv import metrics  # noqa: E402
from raykv.integrations.vllm_meta import (  # noqa: E402
    COUNTER_METRICS,
    WORKER_COUNTER_METRICS,
    CounterExport,
    Fillers,
)

H = [bytes([i]) * 32 for i in range(6)]  # chunk i's hash (chunk i ends at (i + 1) * 4)


def test_hit_tokens_are_split_by_whether_this_engine_saved_each_chunk(monkeypatch):
    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "inc", lambda n, v, **tags: recorded.append((n, v, tags)))
    f = Fillers(chunk=4)
    f.saved(H[1:3])
    f.hit(H[:4], 2, 16)  # tokens 2-16: chunk 0 from token 2, chunks 1-3 whole
    assert (f.here, f.elsewhere) == (8, 6)  # chunks 1, 2 are ours; 0 (half) and 3 are not
    assert recorded == [
        ("raykv_hit_tokens_by_filler", 8, {"filler": "this_engine"}),
        ("raykv_hit_tokens_by_filler", 6, {"filler": "another_engine"}),
    ]
    f.hit(H[:3], 8, 11)  # part of chunk 2 only
    assert (f.here, f.elsewhere) == (11, 6)


def test_only_the_last_saved_chunks_are_remembered():
    f = Fillers(chunk=4, max_chunks=2)
    f.saved(H[:3])  # chunk 0 forgotten
    f.hit(H[:3], 0, 12)
    assert (f.here, f.elsewhere) == (8, 4)


class _Counters:
    def __init__(self) -> None:
        for attr in COUNTER_METRICS:
            setattr(self, attr, 0)


def test_scheduler_counters_reach_metrics_once_a_step_as_their_growth(monkeypatch):
    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "inc", lambda n, v, **tags: recorded.append((n, v, tags)))
    for name, tags in COUNTER_METRICS.values():  # every exported counter is a known metric
        assert set(tags) == set(metrics.METRICS[name][2])
    c, export = _Counters(), CounterExport()
    export.export(c)
    assert recorded == []  # nothing moved: no metric call
    c.lookups, c.waits_for_lookup, c.lookups_not_back_in_step = 3, 2, 1
    export.export(c)
    c.lookups, c.async_loads = 5, 1
    export.export(c)
    export.export(c)
    assert recorded == [
        ("raykv_connector_lookups", 3, {"outcome": "sent"}),
        ("raykv_connector_lookups", 1, {"outcome": "not_back_in_step"}),
        ("raykv_connector_waits", 2, {"reason": "lookup"}),
        ("raykv_connector_lookups", 2, {"outcome": "sent"}),
        ("raykv_connector_loads", 1, {"mode": "async"}),
    ]


def test_worker_counters_reach_metrics_as_loaded_and_failed_tokens(monkeypatch):
    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "inc", lambda n, v, **tags: recorded.append((n, v, tags)))

    class Worker:
        loaded_tokens, failed_tokens, waits_for_gather, load_waits = 0, 0, 0, 0

    w, export = Worker(), CounterExport(WORKER_COUNTER_METRICS)
    w.loaded_tokens, w.failed_tokens, w.waits_for_gather, w.load_waits = 512, 64, 2, 3
    export.export(w)
    assert recorded == [
        ("raykv_connector_load_tokens", 512, {"result": "loaded"}),
        ("raykv_connector_load_tokens", 64, {"result": "failed"}),
        ("raykv_connector_waits", 2, {"reason": "save_copy"}),
        ("raykv_connector_waits", 3, {"reason": "ending_load"}),
    ]
