"""Shared fixtures: one Ray instance per test session, and a real redis-server on loopback.

Unit tests under tests/unit never touch Ray. Integration tests ask for `ray_session`;
a test that must kill or restart a whole cluster starts its own and stops it itself.
"""

from __future__ import annotations

import os
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
