"""`CacheAwareRouter` asking a real KVController (on the session Ray) which node holds a
request's prefix. Serve's replicas and pending requests are stood in for by plain
objects with the attributes the router reads (replica_id, node_id, routing_stats;
args, metadata, routing_context): Serve itself is exercised in test_serve.py and
tests/cluster/test_serve_multinode.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

import ray  # noqa: E402

from raykv.actors.base import CONTROLLER_NAME  # noqa: E402
from raykv.actors.controller import get_or_create_controller  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402
from raykv.serve import STATS_KEY, CacheAwareRouter, chunk_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

KEYS = KeyMaker(chunk_size=4, kv_dtype="float32")
TOKENS = list(range(16))  # 4 chunks


def _router(namespace: str, **kwargs: Any) -> CacheAwareRouter:
    router = object.__new__(CacheAwareRouter)  # Serve's __init__ needs a live deployment
    router._replica_queue_len_cache = {}
    opts = {"chunk_size": 4, "kv_dtype": "float32", "namespace": namespace}
    router.initialize_state(**{**opts, "use_controller": True, **kwargs})
    return router


def _replica(rid: str, node: str, served: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        replica_id=rid,
        node_id=node,
        routing_stats={STATS_KEY: chunk_ids(KEYS, served)} if served else {},
    )


def _pending(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        args=[tokens],
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=uuid.uuid4().hex),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def _choose(router: CacheAwareRouter, replicas: list[SimpleNamespace], tokens: list[int]):
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(tokens)))
    return [[r.replica_id for r in rank] for rank in ranks]


@pytest.fixture
def controller_ns():
    namespace = f"router-ctl-{uuid.uuid4().hex[:8]}"
    controller = get_or_create_controller(namespace)
    keys = [s.key for s in KEYS.keys(TOKENS)]
    ray.get(controller.resync.remote("node-x", 0, {"cpu": keys[:3]}, {}))  # 3 of 4 chunks
    try:
        yield namespace, controller
    finally:
        ray.kill(controller, no_restart=True)


def test_routes_to_a_replica_on_the_node_holding_the_prefix(controller_ns) -> None:
    namespace, _ = controller_ns
    router = _router(namespace, controller_timeout_s=30.0)
    replicas = [_replica("on-y", "node-y"), _replica("on-x", "node-x")]
    assert asyncio.run(router.node_matches([s.key for s in KEYS.keys(TOKENS)])) == {"node-x": 3}
    for _ in range(5):
        assert _choose(router, replicas, TOKENS)[0] == ["on-x"]
    # Too short a match (1 of 4 chunks < half): power-of-two over everyone.
    other = TOKENS[:4] + [99] * 12
    assert sorted(_choose(router, replicas, other)[0]) == ["on-x", "on-y"]


def test_on_one_node_the_replica_that_served_the_prefix_wins(controller_ns) -> None:
    namespace, _ = controller_ns
    router = _router(namespace, controller_timeout_s=30.0)
    replicas = [_replica("cold", "node-x"), _replica("warm", "node-x", served=TOKENS[:8])]
    for _ in range(5):
        assert _choose(router, replicas, TOKENS)[0] == ["warm"]


def test_without_the_controller_only_summaries_route(controller_ns) -> None:
    namespace, _ = controller_ns
    router = _router(namespace, use_controller=False)
    replicas = [_replica("on-y", "node-y", served=TOKENS), _replica("on-x", "node-x")]
    assert asyncio.run(router.node_matches([s.key for s in KEYS.keys(TOKENS)])) == {}
    assert _choose(router, replicas, TOKENS)[0] == ["on-y"]


def _wait_dead(actor: Any, seconds: float = 30.0) -> None:
    """Until a call on `actor` fails because it died."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.instances.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def test_a_missing_or_dead_controller_costs_only_its_signal() -> None:
    namespace = f"router-none-{uuid.uuid4().hex[:8]}"
    router = _router(namespace, controller_timeout_s=30.0)
    replicas = [_replica("a", "node-x"), _replica("b", "node-y")]
    start = time.monotonic()
    assert sorted(_choose(router, replicas, TOKENS)[0]) == ["a", "b"]  # pow-2 fallback
    assert time.monotonic() - start < 10
    assert router._controller is None  # not created by the router, looked up again later

    controller = get_or_create_controller(namespace)
    try:
        keys = [s.key for s in KEYS.keys(TOKENS)]
        ray.get(controller.resync.remote("node-x", 0, {"cpu": keys}, {}))
        router._controller_retry_at = 0.0  # skip the 5 s pause after the failed lookup
        assert _choose(router, replicas, TOKENS)[0] == ["a"]
    finally:
        ray.kill(controller, no_restart=True)
    _wait_dead(controller)  # ray.kill returns before the actor is gone
    assert asyncio.run(router.node_matches(keys)) == {}  # dead: {} and a later retry
    assert router._controller is None


@ray.remote(num_cpus=0)
class _StuckController:
    """Answers `best_instances` after `delay` seconds (an overloaded controller)."""

    def __init__(self, delay: float, warm: list[Any]) -> None:
        # `warm` (CacheKeys) makes this process import raykv now, as the real
        # controller does; else the first call's arguments would import it, slowly.
        self.delay = delay
        self.calls = 0

    async def best_instances(self, keys: list[Any]) -> list[tuple[str, int]]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return [("node-x", len(keys))]

    def count(self) -> int:
        return self.calls


def test_a_slow_controller_times_out_then_is_left_alone_for_a_while() -> None:
    namespace = f"router-slow-{uuid.uuid4().hex[:8]}"
    keys = [s.key for s in KEYS.keys(TOKENS)]
    stuck = _StuckController.options(name=CONTROLLER_NAME, namespace=namespace).remote(5.0, keys)
    try:
        assert ray.get(stuck.count.remote()) == 0
        router = _router(namespace, controller_timeout_s=0.5)
        router._controller = stuck  # as if looked up already: time the reply only
        replicas = [_replica("a", "node-x"), _replica("b", "node-y")]
        start = time.monotonic()
        assert sorted(_choose(router, replicas, TOKENS)[0]) == ["a", "b"]
        assert 0.4 < time.monotonic() - start < 3  # one timeout, not the 5 s reply
        start = time.monotonic()
        for _ in range(5):  # within the pause: the controller is not asked at all
            assert sorted(_choose(router, replicas, TOKENS)[0]) == ["a", "b"]
        assert time.monotonic() - start < 1
        assert ray.get(stuck.count.remote()) == 1
    finally:
        ray.kill(stuck, no_restart=True)


def test_router_options_are_checked_by_name() -> None:
    from raykv.config import RayKVConfig
    from raykv.errors import InvalidInputError
    from raykv.serve import router_config

    cfg = RayKVConfig.load(enable_controller=True)
    conf = router_config("cache_aware", cfg, options={"controller_timeout_s": 0.2})
    assert conf.request_router_kwargs["use_controller"] is True
    assert conf.request_router_kwargs["kv_dtype"] == cfg.kv_dtype
    with pytest.raises(InvalidInputError, match="controller_timeout"):
        router_config("cache_aware", cfg, options={"controller_timeout": 0.2})
