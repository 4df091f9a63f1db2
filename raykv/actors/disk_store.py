"""The disk tier's actor shell: a thin threaded Ray actor around one `tiers.disk.DiskStore`."""

from __future__ import annotations

from typing import Any

import ray

from raykv.actors.base import DISK_STORE_NAME
from raykv.actors.common import get_or_create_node_actor, resolve_batch
from raykv.actors.memory import IdleTrim, reuse_freed_buffers
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.disk import DiskStore
from raykv.wire import PutAck

# Threads of the disk actor's concurrency groups: puts (may wait on the write queue) and reads.
DISK_WRITE_CALLS = 8
DISK_READ_CALLS = 8


@ray.remote(
    num_cpus=0,
    max_concurrency=4,
    concurrency_groups={"write": DISK_WRITE_CALLS, "read": DISK_READ_CALLS},
)
class DiskStoreActor:
    """Thin threaded Ray actor around one `DiskStore` (implements `LowerTier`).

    Puts (which may block on a full write queue) run in their own concurrency group, and
    reads in another, so blocked puts never starve `get_batch`/`contains`; control calls
    (`incarnation`, `keys`, `stats`...) use the default group.
    """

    def __init__(self, config: Any, **overrides: Any) -> None:
        reuse_freed_buffers()  # every read fills a fresh chunk-sized buffer
        self._trim = IdleTrim()  # ... given back once the reads stop
        self._store = DiskStore.from_config(config, **overrides)

    @ray.method(concurrency_group="write")
    def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: Any,
        priority: float | None = None,
        prefix: list[CacheKey] | None = None,
    ) -> PutAck:
        # The arrays are zero-copy views of the caller's object; the pending writes
        # hold them until their files are complete. The ack waits for them: the manager
        # indexes what it accepts, so it must name only chunks whose files are complete.
        ack = self._store.put_written(keys, metas, resolve_batch(batch), priority, prefix or ())
        ack.incarnation = self._store.incarnation  # the manager ignores acks of a past life
        return ack

    @ray.method(num_returns=2, concurrency_group="read")
    def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list]:
        self._trim.note()
        return self._store.get_batch(keys)

    @ray.method(concurrency_group="read")
    def contains(self, keys: list[CacheKey]) -> list[bool]:
        return self._store.contains(keys)

    @ray.method(concurrency_group="read")
    def touch(self, keys: list[CacheKey]) -> None:
        self._store.touch(keys)

    def location(self) -> tuple[str, str, str]:
        """(node id, directory, `secret_tag` of its records' secret or "") of this tier's
        files: a client on the same node may read them itself (`raykv.client.direct`)."""
        return ray.get_runtime_context().get_node_id(), *self._store.location()

    def remove(self, keys: list[CacheKey]) -> int:
        return self._store.remove(keys)

    def keys(self) -> list[CacheKey]:
        return self._store.keys()

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict[str, Any]:
        return self._store.stats()

    def incarnation(self) -> str:
        return self._store.incarnation

    def check(self, fix: bool = True, deep: bool = False) -> dict[str, Any]:
        return self._store.check(fix=fix, deep=deep)

    def flush(self, timeout: float | None = None) -> bool:
        return self._store.flush(timeout)


def get_or_create_disk_store(
    config: Any, node_id: str | None = None, *, name: str | None = None, **overrides: Any
) -> Any:
    """The disk tier actor of `node_id` (default: this node), created if missing.

    Named `raykv-disk-store-<node_id[:12]>` in `config.namespace`, pinned to its node
    (its directory is local), restarted forever; a restart rebuilds the index from disk.
    """
    return get_or_create_node_actor(
        DiskStoreActor,
        DISK_STORE_NAME,
        config.namespace,
        config,
        node_id=node_id,
        name=name,
        **overrides,
    )


__all__ = ["DiskStoreActor", "get_or_create_disk_store"]
