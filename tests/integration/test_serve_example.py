"""examples/serve_app.py is both a YAML Serve config and a Python module, and
`serve run examples/serve_app.py` answers over HTTP on loopback the way its header says.

The end-to-end test runs `serve run` in a child process with a Ray of its own
(`--address local`: never the session Ray of this pytest process) on a copy of the
example whose only change is a free HTTP port. The child is stopped with Ctrl-C
(SIGINT, which shuts Serve and its Ray down); whatever is still alive in its process
session afterwards is killed by PID.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
pytest.importorskip("transformers")

from raykv_testing import free_port  # noqa: E402

from raykv.errors import InvalidInputError  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_app.py"


def test_the_example_is_a_serve_config_for_loopback() -> None:
    from ray._common.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    assert config.http_options.host == "127.0.0.1"
    (app,) = config.applications
    assert app.route_prefix == "/"
    from raykv.demo.serve_app import demo_app

    assert import_attr(app.import_path) is demo_app


def test_the_example_imports_as_a_module_with_an_app() -> None:
    from ray.serve import Application

    spec = importlib.util.spec_from_file_location("serve_app_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert isinstance(module.app, Application)


def test_demo_app_checks_its_args() -> None:
    from ray.serve import Application

    from raykv.demo.serve_app import demo_app

    assert isinstance(demo_app({"replicas": 1, "router": "random", "model": "tiny"}), Application)
    with pytest.raises(InvalidInputError, match="unknown demo_app args"):
        demo_app({"replica": 1})
    with pytest.raises(InvalidInputError, match="model must be"):
        demo_app({"model": "huge"})
    with pytest.raises(InvalidInputError, match="must be ints"):
        demo_app({"replicas": "two"})
    with pytest.raises(InvalidInputError, match="router must be"):
        demo_app({"router": "nearest"})


def _session_pids(sid: int) -> list[int]:
    """PIDs of the processes in session `sid` (the child and everything Ray started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # after pid (comm): state ppid pgrp session
            pids.append(int(entry.name))
    return pids


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 10  # Ray's processes exit after the driver
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _session_pids(proc.pid):  # stragglers, by PID
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def serve_cli() -> str:
    """The `serve` script of this interpreter's environment (an unactivated venv has it
    beside `sys.executable`, not on PATH)."""
    here = Path(sys.executable).with_name("serve")
    return str(here) if here.exists() else shutil.which("serve") or "serve"


def test_serve_cli_is_found_beside_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert Path(serve_cli()).is_file()


@pytest.mark.timeout(600)
def test_serve_run_of_the_example_file_answers_over_http(tmp_path: Path) -> None:
    port = free_port()
    text = EXAMPLE.read_text()
    assert '"port": 8000' in text
    copy = tmp_path / "serve_app.py"
    copy.write_text(text.replace('"port": 8000', f'"port": {port}'))
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "serve_run.log").open("w")
    proc = subprocess.Popen(
        [serve_cli(), "run", "--address", "local", str(copy)],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(tmp_path),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 240
        first = None
        while first is None:
            assert proc.poll() is None, (tmp_path / "serve_run.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "serve run never answered"
            try:
                first = _post(url, {"tokens": [1, 2, 3, 4], "max_new_tokens": 4})
            except urllib.error.HTTPError as exc:
                assert exc.code in (404, 503), f"HTTP {exc.code}: {exc.read()[:2000]!r}"
                time.sleep(1)  # the proxy is up, the app not (fully) deployed yet
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)  # not up yet
        assert len(first["tokens"]) == 4 and first["hit_tokens"] == 0
        client = subprocess.run(
            [sys.executable, str(copy), "--query", "4096", "--url", url],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        lines = [ln for ln in client.stdout.splitlines() if ln.startswith("request ")]
        assert len(lines) == 2, client.stdout
        assert "hit_tokens=0 " in lines[0]
        assert "hit_tokens=4096 " in lines[1]  # the 4096-token prefix came from raykv
        replicas = [ln.split()[2] for ln in lines]
        assert replicas[0] == replicas[1]
    finally:
        _stop(proc)
        log.close()
