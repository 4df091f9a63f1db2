"""The benchmark runner (`python -m benchmarks`) without running any benchmark.

The report writer is fed canned outcomes (one ok, one failed, one timed out); the
process handling is checked with a throw-away module that sleeps past its limit.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import runner
from raykv import cli

ROOT = Path(__file__).resolve().parents[2]

CANNED_SUMMARY = {
    "rows": [
        {
            "name": "encode 2 MiB",
            "value": 8.5,
            "unit": "GB/s",
            "baseline": "numpy memcpy",
            "baseline_value": 14.0,
            "ratio": 8.5 / 14.0,
        },
        {"name": "reopen 10000 files", "value": 0.1, "unit": "s", "baseline": ""},
    ],
    "goals": [
        {"goal": "encode 2 MiB >= 0.5x memcpy", "value": 0.61, "met": True},
        {"goal": "lookup 512 chunks <= 2.0x RTT", "value": 2.4, "met": False},
    ],
    "plots": [
        {
            "name": "canned_curve",
            "title": "Canned curve",
            "xlabel": "x",
            "ylabel": "y",
            "kind": "line",
            "series": {"a": [[1, 0.9], [10, 0.5]], "b": [[1, 0.8], [10, 0.4]]},
            "xscale": "log",
        },
        {
            "name": "canned_bars",
            "title": "Canned bars",
            "xlabel": "",
            "ylabel": "GB/s",
            "kind": "bar",
            "categories": ["put", "get"],
            "series": {"raykv": [1.0, 2.0], "baseline": [1.5, 2.5]},
        },
    ],
}


def canned_outcomes() -> list[runner.Outcome]:
    return [
        runner.Outcome(
            "keys",
            "benchmarks.bench_keys",
            "python -m benchmarks.bench_keys --quick",
            "ok",
            3.2,
            0,
            stdout="| chunk | encode GB/s |\n|---|---|\n| 2 MiB | 8.5 |\n",
            summary=CANNED_SUMMARY,
        ),
        runner.Outcome(
            "tiers",
            "benchmarks.bench_tiers",
            "python -m benchmarks.bench_tiers --quick",
            "failed",
            12.0,
            1,
            stdout="ray 2.60.0, 2 cores\n",
            stderr="Traceback (most recent call last):\nRuntimeError: canned failure\n",
        ),
        runner.Outcome(
            "ttft",
            "benchmarks.bench_ttft",
            "python -m benchmarks.bench_ttft --quick",
            "timed out",
            480.4,
            -15,
            stdout="  4096 tokens, repeat 1/2: 40.0 s\n",
        ),
    ]


def squash(text: str) -> str:
    """Collapse runs of spaces, so that table checks do not depend on column widths."""
    return re.sub(r" +", " ", text)


def render(outcomes: list[runner.Outcome]) -> str:
    return runner.render_report(
        outcomes,
        command="python -m benchmarks --quick --only keys,tiers,ttft",
        quick=True,
        started=datetime.datetime(2026, 11, 22, 6, 0, tzinfo=datetime.timezone.utc),
        total_seconds=495.6,
        machine={"CPU": "Canned CPU, 2 cores", "memory": "24.0 GiB", "GPU": "none"},
        load_start="1.00, 2.00, 3.00",
        load_end="4.00, 5.00, 6.00",
    )


def test_report_has_every_section() -> None:
    doc = squash(render(canned_outcomes()))
    assert doc.startswith("# raykv benchmarks\n")
    for needle in (
        "- date: 2026-11-22 06:00 UTC",
        "- command: `python -m benchmarks --quick --only keys,tiers,ttft`",
        "- total wall time: 8.3 min",
        "## Machine",
        "Canned CPU, 2 cores",
        "| load average at start (1/5/15 min) | 1.00, 2.00, 3.00 |",
        "| load average at end (1/5/15 min) | 4.00, 5.00, 6.00 |",
        "## Summary",
        "### Runs",
        "### Goals",
        "### Figures beside their baselines",
        "## Keys and codec (`python -m benchmarks.bench_keys --quick`)",
        "## Storage tiers: CPU tier and StorageManager (`python -m benchmarks.bench_tiers",
        "## TTFT with the demo model (`python -m benchmarks.bench_ttft --quick`)",
        "## Soak with faults",
    ):
        assert needle in doc, needle
    # Sections come in run order, each after the summary.
    order = [doc.index(f"## {t}") for t in ("Summary", "Keys and codec", "Storage tiers", "TTFT")]
    assert order == sorted(order)


def test_report_states_failures_and_goals_honestly() -> None:
    doc = squash(render(canned_outcomes()))
    assert "FAILED (exit 1)" in doc
    assert "RuntimeError: canned failure" in doc  # the failure's stderr tail is shown
    assert "TIMED OUT after 480 s" in doc
    assert "4096 tokens, repeat 1/2" in doc  # what it printed before the limit
    assert "- tiers: FAILED (exit 1), its goals are not evaluated." in doc
    assert "| keys | encode 2 MiB >= 0.5x memcpy | 0.61 | met |" in doc
    assert "| keys | lookup 512 chunks <= 2.0x RTT | 2.4 | **missed** |" in doc
    # A figure beside its baseline, with the ratio.
    line = next(x for x in doc.splitlines() if "| encode 2 MiB" in x and "numpy memcpy" in x)
    assert "8.5" in line and "14" in line and "0.61" in line
    # Figures exist only for the benchmark that ran: nothing is carried over.
    summary_part = doc[doc.index("### Figures") : doc.index("## Keys and codec")]
    assert "tiers" not in summary_part and "ttft" not in summary_part


def test_report_includes_output_notes_and_plots(tmp_path: Path) -> None:
    outcomes = canned_outcomes()
    runner.draw_plots(outcomes, tmp_path)
    doc = render(outcomes)
    keys = doc[doc.index("## Keys and codec") : doc.index("## Storage tiers")]
    assert "```text\n| chunk | encode GB/s |" in keys
    assert "What it measures:" in keys and "Key hashing and payload codec speed" in keys
    assert (
        "### Notes" in keys and runner.module_text(ROOT / "benchmarks/bench_keys.py").notes in keys
    )
    assert "![Canned curve](bench_canned_curve.png)" in keys
    assert "![Canned bars](bench_canned_bars.png)" in keys
    for name in ("bench_canned_curve.png", "bench_canned_bars.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 200_000


@pytest.mark.parametrize("spec", runner.BENCHMARKS, ids=lambda s: s.name)
def test_every_benchmark_has_title_notes_and_json(spec: runner.Spec) -> None:
    text = runner.module_text(spec.path)
    assert text.title != spec.path.stem and text.doc and text.notes
    assert '"--json"' in spec.path.read_text()


def test_select() -> None:
    assert [s.name for s in runner.select(None)] == [s.name for s in runner.BENCHMARKS]
    assert [s.name for s in runner.select("ttft, keys")] == ["keys", "ttft"]
    with pytest.raises(ValueError, match="unknown benchmark nope"):
        runner.select("keys,nope")


def test_run_one_times_out_and_keeps_output(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "sleepy_bench.py").write_text(
        "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ticks: list[float] = []
    out = runner.run_one(
        runner.Spec("sleepy", "sleepy_bench", 1, 1), True, 1.0, tmp_path, ticks.append
    )
    assert out.status == "timed out" and out.summary is None
    assert out.stdout.strip() == "started" and ticks
    assert out.seconds < 30


def test_run_one_reports_a_failure(tmp_path: Path) -> None:
    out = runner.run_one(runner.Spec("nope", "benchmarks.no_such_bench", 1, 1), False, 60, tmp_path)
    assert out.status == "failed" and out.returncode != 0
    assert "No module named benchmarks.no_such_bench" in out.stderr


def test_module_help_works() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "--quick" in res.stdout and "--only" in res.stdout and "--no-write" in res.stdout
    assert "keys, policies, tiers, disk, connector, ttft, cluster" in res.stdout


def test_other_subcommands_still_reject_unknown_options() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "show", "--no-such-option"])
    assert exc.value.code == 2


def test_a_goal_the_benchmark_marked_noisy_reads_noisy_not_met_or_missed() -> None:
    assert runner.met_text(True) == "met" and runner.met_text(False) == "**missed**"
    assert runner.met_text(None) == "n/a"
    assert runner.met_text(None, noisy=True) == "noisy"
    outcome = runner.Outcome.__new__(runner.Outcome)
    outcome.name, outcome.summary = (
        "datapath",
        {"goals": [{"goal": "g", "value": 1.4, "met": None, "noisy": True}]},
    )
    assert runner.goal_rows([outcome]) == [["datapath", "g", 1.4, "noisy"]]


def test_a_recorded_run_renders_the_same_report_without_running_anything(tmp_path: Path) -> None:
    outcomes = canned_outcomes()
    meta = {
        "command": "python -m benchmarks --quick --only keys,tiers,ttft",
        "quick": True,
        "started": "2026-11-22T06:00:00+00:00",
        "total_seconds": 495.6,
        "machine": {"CPU": "Canned CPU, 2 cores", "memory": "24.0 GiB", "GPU": "none"},
        "load_start": "1.00, 2.00, 3.00",
        "load_end": "4.00, 5.00, 6.00",
    }
    saved = tmp_path / "run.json"
    runner.save_run(saved, outcomes, meta)
    out = tmp_path / "report" / "BENCHMARKS.md"
    code = runner.main(["--render", str(saved), "--out", str(out)])
    assert code == 1  # a canned benchmark failed and one timed out: still said so
    expected = canned_outcomes()
    runner.draw_plots(expected, tmp_path)
    doc = out.read_text(encoding="utf-8")
    note = "- rewritten from that run's record by `python -m benchmarks --render run.json`"
    assert note in doc
    assert "\n".join(x for x in doc.splitlines() if not x.startswith(note)) + "\n" == render(
        expected
    )
    assert (tmp_path / "report" / "bench_canned_curve.png").exists()
