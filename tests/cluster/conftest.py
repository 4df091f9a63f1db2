"""A small multi-node Ray cluster (`ray.cluster_utils.Cluster`) per test module.

Such a cluster cannot share a process with the session Ray (`ray_session`): one
process holds one Ray connection. The `cluster` fixture therefore checks first:

* Ray not initialised in this process (e.g. `pytest tests/cluster`, or a full run,
  where `tests/cluster` sorts before `tests/integration`): it starts a head and two
  worker nodes, yields, and shuts them down at the end of the module;
* Ray already initialised by someone else: it runs the whole module in a child
  `pytest` process instead (once per module) and reports its result here: the
  tests skip with "passed in a child pytest", or fail with the child's output.

Either way the cluster tests run, never against the wrong Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

_CHILD_ENV = "RAYKV_CLUSTER_CHILD"
_child_results: dict[str, subprocess.CompletedProcess[str]] = {}
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 96 * 1024 * 1024}


@dataclass
class ClusterInfo:
    """The running cluster: the Cluster object and the node ids by role."""

    cluster: Any
    head: str
    a: str
    b: str
    nodes: dict[str, Any]


def _run_module_in_child(path: str) -> subprocess.CompletedProcess[str]:
    if path not in _child_results:
        env = dict(os.environ, **{_CHILD_ENV: "1"})
        env.pop("RAY_ADDRESS", None)
        _child_results[path] = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
    return _child_results[path]


def _node_id_with(resource: str) -> str:
    import ray

    for node in ray.nodes():
        if node["Alive"] and resource in node["Resources"]:
            return node["NodeID"]
    raise RuntimeError(f"no live node offers {resource!r}")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterInfo]:
    """Head + nodes "node_a" and "node_b" (1 CPU, 96 MiB object store each)."""
    import ray

    if ray.is_initialized():
        res = _run_module_in_child(str(request.path))
        if res.returncode != 0:
            pytest.fail(f"cluster tests failed in a child pytest:\n{res.stdout[-6000:]}")
        pytest.skip("passed in a child pytest (this process holds the session Ray)")
    from ray.cluster_utils import Cluster

    cl = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "resources": {"head": 1}, "include_dashboard": False},
    )
    try:
        nodes = {
            "a": cl.add_node(**NODE_ARGS, resources={"node_a": 1}),
            "b": cl.add_node(**NODE_ARGS, resources={"node_b": 1}),
        }
        cl.wait_for_nodes()
        ray.init(address=cl.address, log_to_driver=False)
        yield ClusterInfo(
            cl, _node_id_with("head"), _node_id_with("node_a"), _node_id_with("node_b"), nodes
        )
    finally:
        ray.shutdown()
        cl.shutdown()
