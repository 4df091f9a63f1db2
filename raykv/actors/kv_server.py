"""KVServer: the `ray://NAME` remote tier, a named detached actor holding chunks in its own
object store memory, on any node of the cluster.

It *owns* what it stores: a put pulls the caller's batch (`ray.get`, zero-copy on the same
node, a transfer from another node) and re-puts each chunk with `ray.put`, so the data
outlives the writer. One object per chunk (not per batch) keeps the byte budget exact:
evicting a chunk drops its only ref and Ray frees that memory at once. Readers pull with
`get_batch.options(num_returns=2)` and own the returned arrays object.

`KVServerState` is the plain, thread-safe logic (index, budget, policy); the functions
that store and load a value are injected (`ray.put`/`ray.get` in the actor), so it can be
tested without Ray.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError

from raykv.actors.common import actor_options, named_actor, resolve_batch
from raykv.keys import CacheKey
from raykv.masking import mask_url
from raykv.payload import PayloadMeta
from raykv.tiers.breaker import breaker_for
from raykv.tiers.kv_server import KVServerState
from raykv.tiers.remote import RemoteStore
from raykv.wire import TIER_REMOTE, PackedKeys, PutAck, unpack_keys

logger = logging.getLogger(__name__)

# Smallest share of a custom resource that places the actor without using up the resource.
_RESOURCE_SHARE = 0.001


# Threads of the server's concurrency groups. A put blocks on a `ray.get` of the writer's
# batch (hundreds of MB, perhaps from another node); every lookup probes `contains`. Apart,
# slow puts never make probes time out (and their clients back off).
KV_SERVER_WRITE_CALLS = 8
KV_SERVER_READ_CALLS = 8


@ray.remote(
    num_cpus=0,
    max_concurrency=4,
    concurrency_groups={"write": KV_SERVER_WRITE_CALLS, "read": KV_SERVER_READ_CALLS},
)
class KVServer:
    """Named detached actor serving `ray://NAME`; implements `LowerTier`. Puts run in
    the "write" group, reads and probes in "read", control calls in the default one."""

    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        self._state = KVServerState(
            capacity_bytes, policy, store=ray.put, load=lambda refs: ray.get(refs)
        )

    @ray.method(concurrency_group="write")
    def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: Any,
        prefix: list[CacheKey] | None = None,
    ) -> PutAck:
        """Pull the caller's batch (or take arrays by value) and keep an own copy per chunk."""
        return self._state.put(keys, metas, resolve_batch(batch), prefix or ())

    @ray.method(num_returns=2, concurrency_group="read")
    def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list]:
        return self._state.get_batch(keys)

    @ray.method(concurrency_group="read")
    def contains(self, keys: list[CacheKey] | PackedKeys | bytes) -> list[bool]:
        return self._state.contains(unpack_keys(keys))

    def remove(self, keys: list[CacheKey]) -> int:
        return self._state.remove(keys)

    def keys(self) -> list[CacheKey]:
        return self._state.keys()

    def clear(self) -> None:
        self._state.clear()

    def stats(self) -> dict[str, Any]:
        return self._state.stats()

    def incarnation(self) -> str:
        return self._state.incarnation


def get_or_create_kv_server(
    name: str,
    config: Any,
    node_id: str | None = None,
    resources: dict[str, float] | str | None = None,
) -> Any:
    """The `ray://NAME` server (created detached if missing) in `config.namespace`.

    Placement: `node_id` pins it to that node (NodeAffinitySchedulingStrategy, hard);
    `resources` is a custom resource name (or `{name: amount}`) that only the wanted
    node(s) offer. An existing server is returned as is, with its own capacity.
    """
    if isinstance(resources, str):
        resources = {resources: _RESOURCE_SHARE}
    options = actor_options(
        name, config.namespace, node_id or None, near_caller=False, resources=resources
    )
    return named_actor(KVServer, options, config.max_remote_bytes, config.policy_for(TIER_REMOTE))


# ----- the remote tier's back end for ray:// servers -----


def _packed(keys: list[CacheKey]) -> bytes | list[CacheKey]:
    """`keys` as a `contains` call sends them: `PackedKeys` bytes when they share one
    identity (one bytes argument is the cheapest for Ray)."""
    packed = PackedKeys.of(keys)
    return packed.wire() if isinstance(packed, PackedKeys) else packed


class RayServerBackend:
    """Calls the `KVServer` actor named by `ray://NAME` (created detached if missing).

    The config fields `kv_server_node_id` (a node id) or `kv_server_resources` (a custom
    resource name or `{name: amount}`) place a server this creates.
    """

    scheme = "ray"

    def __init__(self, url: str, config: Any, timeout_s: float) -> None:
        self.masked_url = url
        self.name = url[len("ray://") :]
        self._config = config
        self._server = self._find()

    def _find(self) -> Any:
        config = self._config
        return get_or_create_kv_server(
            self.name,
            config,
            node_id=config.kv_server_node_id,
            resources=config.kv_server_resources,
        )

    def __repr__(self) -> str:
        return f"RayServerBackend({self.masked_url!r})"

    async def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: Any,
        prefix: list[CacheKey] | None = None,
    ) -> PutAck:
        # A list of refs travels as is: the server pulls the batch from its owner itself.
        return await self._server.put.remote(keys, metas, batch, prefix or [])

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        metas_ref, arrays_ref = self._server.get_batch.options(num_returns=2).remote(keys)
        metas, arrays = await asyncio.gather(metas_ref, arrays_ref)
        return metas, arrays

    async def contains(self, keys: list[CacheKey]) -> list[bool]:
        return await self._server.contains.remote(_packed(keys))

    def contains_blocking(self, keys: list[CacheKey], timeout: float) -> list[bool]:
        """`contains` waited for on the calling thread: a lookup on one of the manager's
        Ray threads asks the server without two hops through its event loop."""
        return ray.get(self._server.contains.remote(_packed(keys)), timeout=timeout)

    async def remove(self, keys: list[CacheKey]) -> int:
        return await self._server.remove.remote(keys)

    async def keys(self) -> list[CacheKey]:
        return await self._server.keys.remote()

    async def clear(self) -> None:
        await self._server.clear.remote()

    async def stats(self) -> dict[str, Any]:
        out = await self._server.stats.remote()
        out["url"] = self.masked_url
        out["server_incarnation"] = out.pop("incarnation", None)
        return out

    async def server_id(self) -> str:
        """The server's incarnation. A server that died for good (killed, or its node
        lost under a hard placement) is found or created again here, off the loop: its
        new incarnation tells every manager to resync (the periodic health check asks
        this), and the calls that follow reach the new server."""
        try:
            return await self._server.incarnation.remote()
        except ActorDiedError:
            self._server = await asyncio.to_thread(self._find)
            return await self._server.incarnation.remote()

    async def close(self) -> None:
        return None


def open_remote(config: Any, timeout_s: float | None = None) -> RemoteStore:
    """The remote tier of `config.remote_url`: a `ray://` server through its actor, any
    other scheme through the tier core's own back ends; either way behind this process's
    circuit breaker of that remote."""
    url = config.remote_url or ""
    if url.startswith("ray://"):  # a server of this name in this namespace
        backend = RayServerBackend(url, config, timeout_s or 0.0)
        breaker = breaker_for(url, config.namespace)
    else:
        backend, breaker = None, breaker_for(mask_url(url))
    return RemoteStore(config, backend=backend, timeout_s=timeout_s, breaker=breaker)


__all__ = [
    "KVServer",
    "KVServerState",
    "RayServerBackend",
    "get_or_create_kv_server",
    "open_remote",
]
