"""benchmarks.step_trace: where a request's time-to-first-token went, from a step trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from benchmarks.step_trace import analyse  # noqa: E402


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_hit_and_a_miss_are_timed_from_arrival_to_their_first_step(tmp_path):
    trace = write(
        tmp_path / "B-1.jsonl",
        [
            {"ev": "seen", "t": 10.0, "arrival": 9.5, "id": "miss", "prompt": 2176, "local": 0},
            {"ev": "step", "t": 10.1, "tokens": {"miss": 2048}, "loads": []},
            {"ev": "seen", "t": 11.5, "arrival": 10.2, "id": "hit", "prompt": 2176, "local": 0},
            {"ev": "ask", "id": "hit", "answer": None},  # its lookup not back
            {"ev": "ask", "id": "hit", "answer": 2047},  # a hit, but no room for it
            {"ev": "ask", "id": "hit", "answer": 2047},
            {
                "ev": "step",
                "t": 11.7,
                "tokens": {"miss": 128, "hit": 129},
                "loads": [["hit", 2047, True]],
            },
            {"ev": "step", "t": 11.9, "tokens": {"miss": 1, "hit": 1}, "loads": []},
            {"ev": "ask", "id": "hit", "answer": 0},  # preempted and back: not counted
            {"ev": "step", "t": 12.0, "tokens": {}, "loads": []},
        ],
    )
    got = analyse(trace, hit_below=1024)
    miss, hit = got["miss"], got["raykv hit"]
    assert got["vLLM-local hit"] == {}
    assert miss["arrival to seen ms"] == pytest.approx([500.0])
    assert miss["seen to scheduled ms"] == pytest.approx([100.0])
    assert miss["first step ms"] == pytest.approx([1600.0])
    assert miss["tokens in that step"] == [2048]
    # the hit arrived during the miss's long step: that wait is before the scheduler saw it
    assert hit["arrival to seen ms"] == pytest.approx([1300.0])
    assert hit["seen to scheduled ms"] == pytest.approx([200.0])
    assert hit["asks while looking up"] == [1] and hit["asks answered, not scheduled"] == [2]
    assert miss["asks while looking up"] == [0] and miss["asks answered, not scheduled"] == [0]
    assert hit["first step ms"] == pytest.approx([200.0])
    assert hit["tokens in that step"] == [257] and hit["requests starting with it"] == [1]


def test_a_request_counts_once_at_its_first_step_and_old_traces_have_no_arrival(tmp_path):
    trace = write(
        tmp_path / "B-2.jsonl",
        [
            {"ev": "seen", "t": 1.0, "id": "a", "prompt": 300, "local": 0},
            {"ev": "step", "t": 1.0, "tokens": {"a": 300}, "loads": []},
            {"ev": "step", "t": 1.2, "tokens": {"a": 1}, "loads": []},
            {"ev": "step", "t": 1.3, "tokens": {}, "loads": []},
        ],
    )
    got = analyse(trace, hit_below=1024)
    assert got["miss"] == {} and got["raykv hit"] == {}  # no load: vLLM's own cache had it
    assert got["vLLM-local hit"]["first step ms"] == pytest.approx([200.0])
    assert "arrival to seen ms" not in got["vLLM-local hit"]  # an old trace: no arrivals
