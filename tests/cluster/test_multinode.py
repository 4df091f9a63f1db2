"""Per-node managers on a 3-node cluster: a prefix stored through node A is a hit on
node B through the shared `ray://` remote tier and through the peer tier (A's CPU
tier, found by the KVController); losing A's stores leaves B correct."""

from __future__ import annotations

import uuid
from typing import Any

import ray
import torch
from ray.experimental import get_object_locations
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.actors.base import STORAGE_MANAGER_NAME, actor_name
from raykv.actors.controller import wait_listed
from raykv.actors.factory import shutdown_namespace
from raykv.actors.kv_server import get_or_create_kv_server
from raykv.actors.storage_manager import get_or_create_manager
from raykv.client.kvcache import KVCache
from raykv.config import RayKVConfig
from raykv.wire import RetrieveResult

CHUNK, LAYERS, HIDDEN, TOKENS = 16, 2, 8, 64


def _config(**fields: Any) -> RayKVConfig:
    return RayKVConfig.load(
        namespace=f"cluster-{uuid.uuid4().hex[:8]}",
        chunk_size=CHUNK,
        kv_dtype="float32",
        max_local_cpu_size=0.02,
        max_remote_size=0.02,
        lookup_timeout_ms=5000,
        **fields,
    )


def _caches(cfg: RayKVConfig, cluster) -> tuple[KVCache, KVCache]:
    a = KVCache(cfg, get_or_create_manager(cfg, cluster.a))
    b = KVCache(cfg, get_or_create_manager(cfg, cluster.b))
    for kv in (a, b):
        assert kv._call("incarnations", timeout=60, default=None) is not None
    return a, b


def _prompt(seed: int, hidden: int = HIDDEN) -> tuple[list[int], torch.Tensor]:
    tokens = [seed * 1000 + i for i in range(TOKENS)]
    kv = torch.randn(2, LAYERS, TOKENS, hidden, generator=torch.Generator().manual_seed(seed))
    return tokens, kv


def _wait_known(cfg: RayKVConfig, kv: KVCache, tokens: list[int], instance: str) -> None:
    """Until the controller lists `instance` for the whole prefix (reports are batched)."""
    keys = [s.key for s in kv.spans(tokens)]
    assert wait_listed(cfg.namespace, keys, instance, 20), "the controller never learnt of A"


def test_prefix_stored_on_node_a_is_a_hit_on_node_b_via_the_remote_tier(cluster):
    cfg = _config(remote_url="ray://raykv-cluster-remote")
    get_or_create_kv_server("raykv-cluster-remote", cfg, node_id=cluster.head)
    try:
        a, b = _caches(cfg, cluster)
        tokens, kv = _prompt(1)
        assert a.store(tokens, kv) == TOKENS
        assert a.flush(30)
        assert b.lookup(tokens) == TOKENS
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens, out, return_tiers=True)
        assert hit.all() and tiers == {"remote": TOKENS}
        torch.testing.assert_close(out, kv)
    finally:
        shutdown_namespace(cfg.namespace)
        ray.kill(ray.get_actor("raykv-cluster-remote", namespace=cfg.namespace), no_restart=True)


def test_prefix_stored_on_node_a_is_a_hit_on_node_b_via_the_peer_tier(cluster):
    cfg = _config(enable_controller=True)  # no remote tier: only A's CPU tier has it
    try:
        a, b = _caches(cfg, cluster)
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        for node in (cluster.a, cluster.b):  # one manager and CPU store per node
            assert actor_name(STORAGE_MANAGER_NAME, node) in names
            assert f"raykv-cpu-store-{node[:12]}" in names
        # 512 KiB: over Ray's 100 KiB inline limit, so the batch is a plasma object.
        tokens, kv = _prompt(2, hidden=512)
        assert a.store(tokens, kv) == TOKENS
        _wait_known(cfg, a, tokens, cluster.a)
        assert b.lookup(tokens) == TOKENS
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens, out, return_tiers=True)
        assert hit.all() and tiers == {"peer": TOKENS}
        torch.testing.assert_close(out, kv)
        # Promoted into B's CPU tier (copied after the reply: a flush waits for it): the
        # next read is local.
        assert b.flush(30)
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens, out, return_tiers=True)
        assert tiers == {"cpu": TOKENS}
        torch.testing.assert_close(out, kv)
        # B's copy lives in B's object store (which B's budget counts), not A's.
        got = RetrieveResult.of(ray.get(b._manager.get.remote(b.spans(tokens)), timeout=30))
        refs = list({c.ref: None for c in got.chunks})
        nodes = [loc["node_ids"] for loc in get_object_locations(refs, 10_000).values()]
        assert len(nodes) == len(refs) and all(cluster.b in n and cluster.a not in n for n in nodes)
        stats = b.stats()["tiers"]["peer"]
        assert stats["lookup_hit_chunks"] >= TOKENS // CHUNK
        # The next prefix A stores: B asks A (the peer the last locate named) while it
        # asks the controller, and serves that answer; whether the controller has A's
        # report yet or not (not waited for here), B hits it.
        asked = b.stats()["peer_asks_used"]  # the retrieve above, after the lookup's locate
        tokens, kv = _prompt(3, hidden=512)
        assert a.store(tokens, kv) == TOKENS
        assert a.flush(30)
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens, out, return_tiers=True)
        assert hit.all() and tiers == {"peer": TOKENS}
        torch.testing.assert_close(out, kv)
        assert b.stats()["peer_asks_used"] == asked + 1
    finally:
        shutdown_namespace(cfg.namespace)


def test_a_peer_read_of_part_of_a_batch_moves_that_part(cluster):
    """B wants one chunk of A's four-chunk batch: A gathers it into a new object (B does
    not fetch the whole batch), and B gets the right bytes; then all four come as A's
    batch itself, and B's copy is B's own."""
    cfg = _config(enable_controller=True)
    try:
        a, b = _caches(cfg, cluster)
        tokens, kv = _prompt(3, hidden=512)
        assert a.store(tokens, kv) == TOKENS
        _wait_known(cfg, a, tokens, cluster.a)
        peer = ray.get_actor(actor_name(STORAGE_MANAGER_NAME, cluster.a), namespace=cfg.namespace)
        keys = [s.key for s in a.spans(tokens)]
        batch = RetrieveResult.of(ray.get(a._manager.get.remote(a.spans(tokens)), timeout=30))
        metas, objects, places = ray.get(peer.peer_read.remote(keys[:1]), timeout=30)
        assert places == [(0, 0)] and objects[0] != batch.chunks[0].ref  # gathered
        metas, objects, places = ray.get(peer.peer_read.remote(keys), timeout=30)
        assert objects == [batch.chunks[0].ref] and places == [(0, i) for i in range(4)]
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens[:CHUNK], out, return_tiers=True)
        assert tiers == {"peer": CHUNK}
        torch.testing.assert_close(out[:, :, :CHUNK], kv[:, :, :CHUNK])
        assert b.flush(30)
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens, out, return_tiers=True)
        assert hit.all() and tiers == {"cpu": CHUNK, "peer": TOKENS - CHUNK}
        torch.testing.assert_close(out, kv)
    finally:
        shutdown_namespace(cfg.namespace)


def test_killing_node_a_stores_leaves_node_b_correct(cluster):
    cfg = _config(enable_controller=True, remote_url="ray://raykv-cluster-remote2")
    get_or_create_kv_server("raykv-cluster-remote2", cfg, node_id=cluster.head)
    try:
        a, b = _caches(cfg, cluster)
        tokens, kv = _prompt(3)
        other, other_kv = _prompt(4)
        a.store(tokens, kv)
        a.store(other, other_kv)
        assert a.flush(30)
        _wait_known(cfg, a, tokens, cluster.a)
        for name in (
            actor_name(STORAGE_MANAGER_NAME, cluster.a),
            f"raykv-cpu-store-{cluster.a[:12]}",
        ):
            ray.kill(ray.get_actor(name, namespace=cfg.namespace), no_restart=True)
        # The controller still lists A: B's peer fetch fails, the remote serves the rest.
        out = torch.zeros_like(kv)
        hit, tiers = b.retrieve(tokens, out, return_tiers=True)
        assert hit.all() and tiers == {"remote": TOKENS}
        torch.testing.assert_close(out, kv)
        out = torch.zeros_like(other_kv)
        assert b.retrieve(other, out).all()
        torch.testing.assert_close(out, other_kv)
        # B keeps working for new prompts.
        fresh, fresh_kv = _prompt(5)
        assert b.store(fresh, fresh_kv) == TOKENS
        out = torch.zeros_like(fresh_kv)
        assert b.retrieve(fresh, out).all()
        torch.testing.assert_close(out, fresh_kv)
    finally:
        shutdown_namespace(cfg.namespace)
        ray.kill(ray.get_actor("raykv-cluster-remote2", namespace=cfg.namespace), no_restart=True)


@ray.remote(num_cpus=0)
class _NodeClient:
    """A client process on one node, connecting the way a serving app would."""

    def __init__(self, cfg: RayKVConfig) -> None:
        import raykv

        self.kv = raykv.connect(cfg)

    def store(self, tokens: list[int], kv: torch.Tensor) -> int:
        return self.kv.store(tokens, kv)

    def retrieve(self, tokens: list[int], shape: tuple[int, ...]) -> tuple[dict, torch.Tensor]:
        dest = torch.zeros(shape)
        _, tiers = self.kv.retrieve(tokens, dest, return_tiers=True)
        return tiers, dest


def test_connect_with_the_controller_attaches_to_the_callers_node_manager(cluster) -> None:
    cfg = _config(enable_controller=True)
    try:
        on = lambda node: NodeAffinitySchedulingStrategy(node, soft=False)  # noqa: E731
        client_a = _NodeClient.options(scheduling_strategy=on(cluster.a)).remote(cfg)
        client_b = _NodeClient.options(scheduling_strategy=on(cluster.b)).remote(cfg)
        tokens, kv = _prompt(41)
        assert ray.get(client_a.store.remote(tokens, kv)) == TOKENS
        names = {
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == cfg.namespace
        }
        assert actor_name(STORAGE_MANAGER_NAME, cluster.a) in names
        helper = KVCache(cfg, get_or_create_manager(cfg, cluster.a))
        _wait_known(cfg, helper, tokens, cluster.a)
        tiers, got = ray.get(client_b.retrieve.remote(tokens, tuple(kv.shape)))
        assert tiers == {"peer": TOKENS}  # node B's own manager pulled it from node A
        assert torch.equal(got, kv)
    finally:
        shutdown_namespace(cfg.namespace)
