"""Shared fixtures: one Ray instance per test session, and a real redis-server on loopback.

Unit tests under tests/unit never touch Ray. Integration tests ask for `ray_session`;
a test that must kill or restart a whole cluster starts its own and stops it itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Keep every Ray this suite starts on 127.0.0.1 and quiet; set before ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

TEST_NAMESPACE = "raykv-test"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray instance for the whole session, shut down at the end even on failure."""
    import ray

    ray.init(
        num_cpus=8,  # logical CPUs, so a handful of actors can be scheduled on a 2-core box
        object_store_memory=1 << 30,
        include_dashboard=False,
        namespace=TEST_NAMESPACE,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        ray.shutdown()


class RedisServer:
    """A real redis-server on a free loopback port, stoppable and restartable by PID."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found: apt-get install -y redis-server")
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server per test (cheap: ~20 ms), stopped at the end even on failure."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
