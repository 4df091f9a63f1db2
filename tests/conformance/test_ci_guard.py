"""On CI a broken libCacheSim install must fail the conformance suite, not skip it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).with_name("test_libcachesim.py")


def _run_suite(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    broken = tmp_path / "site" / "libcachesim"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("simulated broken install")\n')
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(broken.parent), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", str(SUITE)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_broken_install_fails_on_ci(tmp_path: Path) -> None:
    proc = _run_suite(tmp_path, ci="true")
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 5), out  # 5: nothing collected, i.e. skipped
    assert "simulated broken install" in out and "SKIPPED" not in out, out


@pytest.mark.parametrize("ci", [None, ""])
def test_broken_install_skips_off_ci(tmp_path: Path, ci: str | None) -> None:
    proc = _run_suite(tmp_path, ci=ci)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 5), out  # 5: nothing collected
    assert "SKIPPED" in out and "simulated broken install" in out, out
