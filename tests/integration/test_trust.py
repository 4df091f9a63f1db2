"""Where trust ends: a Ray namespace is not a boundary, but raykv never uses an actor of
another class that holds one of its names (a squatter would see every lookup's keys and
could serve any bytes)."""

from __future__ import annotations

import uuid

import pytest
import ray

import raykv
from raykv.actors.base import STORAGE_MANAGER_NAME
from raykv.actors.kv_server import get_or_create_kv_server
from raykv.config import RayKVConfig
from raykv.errors import ConfigError

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class Squatter:
    """Answers anything: what a hostile job would park under a raykv name."""

    def contains(self, keys):
        return [True] * 512

    def incarnation(self):
        return "squatter"


def squat(name: str, namespace: str):
    return Squatter.options(name=name, namespace=namespace, lifetime="detached").remote()


def test_a_squatter_under_the_kv_server_name_is_refused():
    ns, name = f"t-squat-{uuid.uuid4().hex[:8]}", "shared-kv"
    squatter = squat(name, ns)
    try:
        ray.get(squatter.incarnation.remote())
        cfg = RayKVConfig(namespace=ns, remote_url=f"ray://{name}")
        with pytest.raises(ConfigError, match="another job holds the name"):
            get_or_create_kv_server(name, cfg)
    finally:
        ray.kill(squatter)


def test_a_squatter_under_the_manager_name_makes_connect_refuse():
    ns = f"t-squat-{uuid.uuid4().hex[:8]}"
    squatter = squat(STORAGE_MANAGER_NAME, ns)
    try:
        ray.get(squatter.incarnation.remote())
        with pytest.raises(ConfigError, match="Squatter"):
            raykv.connect(namespace=ns, max_local_cpu_size=0.05)
    finally:
        ray.kill(squatter)


def test_the_real_kv_server_passes_the_check():
    ns, name = f"t-squat-{uuid.uuid4().hex[:8]}", "real-kv"
    cfg = RayKVConfig(namespace=ns, remote_url=f"ray://{name}", max_remote_size=0.01)
    server = get_or_create_kv_server(name, cfg)
    try:
        again = get_or_create_kv_server(name, cfg)  # get_if_exists: the same actor, checked
        assert ray.get(again.incarnation.remote()) == ray.get(server.incarnation.remote())
    finally:
        ray.kill(server)
