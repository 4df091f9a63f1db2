"""Shared fixtures: one Ray instance per test session, and a real redis-server on loopback.

Unit tests under tests/unit never touch Ray. Integration tests ask for `ray_session`;
a test that must kill or restart a whole cluster starts its own and stops it itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from raykv_testing import TEST_NAMESPACE, RedisServer

# Keep every Ray this suite starts on 127.0.0.1 and quiet; set before ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray instance for the whole session, shut down at the end even on failure."""
    import ray

    ray.init(
        address="local",  # always a fresh instance, never a cluster someone else started
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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server per test (cheap: ~20 ms), stopped at the end even on failure."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# ----- stress tests: a marker and a duration knob (additive) -----

SOAK_SECONDS_DEFAULT = 30.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=None,
        help="steady-state duration of the soak test in seconds "
        f"(default: $RAYKV_SOAK_SECONDS or {SOAK_SECONDS_DEFAULT:.0f})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stress: soak and fault-injection tests (bounded; run by default)"
    )


def _soak_seconds(config: pytest.Config) -> float:
    value = config.getoption("--soak-seconds")
    if value is None:
        value = float(os.environ.get("RAYKV_SOAK_SECONDS", SOAK_SECONDS_DEFAULT))
    return value


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    """How long the soak runs: --soak-seconds, else $RAYKV_SOAK_SECONDS, else the default."""
    return _soak_seconds(request.config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A longer soak gets a longer pytest-timeout: the soak itself + 5 minutes of set-up."""
    limit = _soak_seconds(config) + 300
    for item in items:
        if item.get_closest_marker("stress") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(max(limit, 300)))


_exit_status: dict[str, int] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's teardown, keeping pytest's exit status.

    After a full run with every test passed, CPython's finalisation of Ray's and
    torch's native threads has crashed (exit 139). Every process the tests started is
    already stopped by the fixtures at this point, so skipping finalisation loses
    nothing. Set RAYKV_TEST_SOFT_EXIT=1 to see the normal exit path.
    """
    if "code" in _exit_status and os.environ.get("RAYKV_TEST_SOFT_EXIT") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status["code"])
