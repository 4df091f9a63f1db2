"""Creating, finding and stopping raykv's named actors: one place for their options.

Every actor is detached (it outlives the driver that created it), named in the
configured namespace and restarted forever (`ACTOR_OPTIONS`); node-scoped ones carry
`-<node_id[:12]>` in their name and a hard affinity to their node.
"""

from __future__ import annotations

from typing import Any

import ray

from raykv.actors.base import (
    CONTROLLER_NAME,
    CPU_STORE_NAME,
    DISK_STORE_NAME,
    REMOTE_STORE_NAME,
    STORAGE_MANAGER_NAME,
    actor_name,
)
from raykv.actors.common import actor_options, named_actor
from raykv.config import RayKVConfig
from raykv.wire import TIER_CPU, TIER_DISK, TIER_ORDER, TIER_REMOTE


def create_tier(config: RayKVConfig, tier: str, node_id: str | None = None) -> Any:
    """The actor of `tier` (created if missing, e.g. after it was killed for good).

    With `node_id`, the CPU store is node-scoped too (`raykv-cpu-store-<node>`); the disk
    tier is always node-scoped (its directory is local), and so is this node's connection
    to the shared remote.
    """
    if tier == TIER_CPU:
        from raykv.actors.cpu_store import CPUStoreActor

        return named_actor(
            CPUStoreActor,
            actor_options(actor_name(CPU_STORE_NAME, node_id), config.namespace, node_id),
            config.max_local_cpu_bytes,
            config.policy_for(TIER_CPU),
            blocking_timeout_secs=config.blocking_timeout_secs,
            pin_lease_secs=config.pin_lease_secs,
        )
    if tier == TIER_DISK:
        from raykv.actors.disk_store import get_or_create_disk_store

        return get_or_create_disk_store(config, node_id)
    if tier == TIER_REMOTE:
        from raykv.actors.remote_store import get_or_create_remote_store

        return get_or_create_remote_store(config, node_id)
    raise ValueError(f"unknown tier {tier!r}")


def enabled_tiers(config: RayKVConfig) -> list[str]:
    """The tiers `config` enables, in lookup order."""
    on = {TIER_CPU: config.local_cpu, TIER_DISK: config.local_disk, TIER_REMOTE: config.remote_url}
    return [t for t in TIER_ORDER if on[t]]


def get_or_create_tiers(config: RayKVConfig, node_id: str | None = None) -> dict[str, Any]:
    """Create or attach the enabled tier actors of `config`, by name; tier -> handle."""
    return {t: create_tier(config, t, node_id) for t in enabled_tiers(config)}


def shutdown_namespace(namespace: str) -> None:
    """Kill raykv's actors of `namespace`: its managers, CPU, disk and remote-store tiers
    and its controller (their cached data goes with them; a new `connect` starts afresh).

    The remote's data (a `ray://` KVServer, a Redis server) is shared and left alone.
    Needs a connected Ray (`ray.init`).
    """
    names = [STORAGE_MANAGER_NAME, CPU_STORE_NAME, CONTROLLER_NAME]
    prefixes = (STORAGE_MANAGER_NAME, CPU_STORE_NAME, DISK_STORE_NAME, REMOTE_STORE_NAME)
    names += [
        a["name"]
        for a in _named_actors(namespace)
        if a["name"].startswith(prefixes) and a["name"] not in names
    ]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass


def _named_actors(namespace: str) -> list[dict[str, Any]]:
    try:
        return [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == namespace
        ]
    except Exception:
        return []


__all__ = [
    "actor_options",
    "create_tier",
    "enabled_tiers",
    "get_or_create_tiers",
    "shutdown_namespace",
]
