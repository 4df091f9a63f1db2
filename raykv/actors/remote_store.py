"""The remote tier's actor shell: a thin async Ray actor around one `tiers.remote.RemoteStore`.

`incarnation()` is this actor's id plus the server's identity (a KVServer's incarnation,
a Redis server's run_id), so the manager notices a restarted remote and resyncs.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from raykv.actors.base import REMOTE_STORE_NAME
from raykv.actors.common import get_or_create_node_actor
from raykv.actors.kv_server import open_remote
from raykv.actors.memory import IdleTrim, reuse_freed_buffers
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.remote import RemoteStore
from raykv.wire import PackedKeys, PutAck, unpack_keys

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class RemoteStoreActor:
    """Thin async Ray actor around one `RemoteStore` (implements `LowerTier`)."""

    def __init__(self, config: Any, timeout_s: float | None = None) -> None:
        reuse_freed_buffers()  # every read decodes into fresh chunk-sized buffers
        self._trim = IdleTrim()  # ... given back once the reads stop
        self._store = open_remote(config, timeout_s=timeout_s)

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return f"RemoteStoreActor({self._store.url})"

    async def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: Any,
        prefix: list[CacheKey] | None = None,
    ) -> PutAck:
        return await self._store.put(keys, metas, batch, prefix or [])

    @ray.method(num_returns=2)
    async def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list]:
        self._trim.note()
        return await self._store.get_batch(keys)

    async def contains(self, keys: list[CacheKey] | PackedKeys) -> list[bool]:
        return await self._store.contains(unpack_keys(keys))

    async def remove(self, keys: list[CacheKey]) -> int:
        return await self._store.remove(keys)

    async def keys(self) -> list[CacheKey]:
        return await self._store.keys()

    async def clear(self) -> None:
        await self._store.clear()

    async def stats(self) -> dict[str, Any]:
        return await self._store.stats()

    async def incarnation(self) -> str:
        return await self._store.identity()


def get_or_create_remote_store(
    config: Any, node_id: str | None = None, *, name: str | None = None
) -> Any:
    """This node's remote tier actor (a connection to `config.remote_url`), created if missing.

    Named `raykv-remote-store-<node_id[:12]>` in `config.namespace`; it lives beside the
    node's storage manager, while the data lives wherever the remote is.
    """
    return get_or_create_node_actor(
        RemoteStoreActor, REMOTE_STORE_NAME, config.namespace, config, node_id=node_id, name=name
    )


__all__ = ["RemoteStore", "RemoteStoreActor", "get_or_create_remote_store"]
