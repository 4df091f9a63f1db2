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

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv import metrics
from raykv.actors.base import ACTOR_OPTIONS, TIER_REMOTE, PutAck
from raykv.actors.common import ByteBudgetIndex, check_put_lengths, resolve_batch
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta

logger = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.uint8)
# Smallest share of a custom resource that places the actor without using up the resource.
_RESOURCE_SHARE = 0.001


class KVServerState:
    """Index, byte budget and policy of a KVServer; values are opaque handles.

    `store(array) -> handle` and `load(handles) -> arrays` are called without the lock
    held. A key being stored is reserved first, so a concurrent put of the same key is
    accepted without a second copy and the budget never overshoots.
    """

    def __init__(
        self,
        capacity_bytes: int,
        policy: str = "lru",
        *,
        store: Callable[[np.ndarray], Any],
        load: Callable[[list[Any]], list[np.ndarray]],
    ) -> None:
        self._index = ByteBudgetIndex(capacity_bytes, policy)
        self._values: dict[CacheKey, tuple[Any, PayloadMeta]] = {}
        self._pending: set[CacheKey] = set()
        self._store, self._load = store, load
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("hits", "misses", "evictions", "skipped", "errors"), 0)
        self.incarnation = uuid.uuid4().hex

    def put(
        self, keys: Sequence[CacheKey], metas: Sequence[PayloadMeta], arrays: Sequence[np.ndarray]
    ) -> PutAck:
        """Store chunks not held yet, evicting by policy to make room."""
        check_put_lengths(keys, metas, arrays)
        ack = PutAck()
        for key, meta, array in zip(keys, metas, arrays, strict=True):
            size = meta.nbytes
            if getattr(array, "nbytes", -1) != size:
                logger.warning("kv server: skipping %s: array size does not match its meta", key)
                ack.skipped.append(key)
                continue
            with self._lock:
                if key in self._index or key in self._pending:
                    ack.accepted.append(key)
                    continue
                fits, victims = self._index.reserve(key, size)
                for victim, _ in victims:
                    self._values.pop(victim, None)  # dropping the ref frees the object
                    ack.evicted.append(victim)
                if not fits:
                    ack.skipped.append(key)
                    continue
                self._pending.add(key)
            handle = None
            try:
                handle = self._store(array)
            except Exception as exc:
                logger.warning("kv server: cannot store %s: %s", key, exc)
            with self._lock:
                self._pending.discard(key)
                if handle is None:
                    self._index.unreserve(key)
                    self._counts["errors"] += 1
                    ack.skipped.append(key)
                else:
                    self._index.commit(key, size)
                    self._values[key] = (handle, meta)
                    ack.accepted.append(key)
        with self._lock:
            # Deepest chunk first: a request's first chunk ends up the most recent.
            self._index.order(reversed(ack.accepted))
            self._counts["evictions"] += len(ack.evicted)
            self._counts["skipped"] += len(ack.skipped)
        if ack.evicted:
            policy = self._index.policy_name
            metrics.inc("raykv_evictions", len(ack.evicted), tier=TIER_REMOTE, policy=policy)
        self._publish()
        return ack

    def _publish(self) -> None:
        policy = self._index.policy_name
        metrics.set_gauge("raykv_used_bytes", self._index.used, tier=TIER_REMOTE, policy=policy)
        metrics.set_gauge("raykv_entries", len(self._index), tier=TIER_REMOTE, policy=policy)

    def get_batch(
        self, keys: Sequence[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """Metas (None = miss) and arrays (empty = miss); hits are touched deepest first."""
        with self._lock:
            found = [self._values.get(key) for key in keys]
            # deepest first, as in put
            self._index.touch_prefix([k for k, v in zip(keys, found, strict=True) if v is not None])
            hits = sum(item is not None for item in found)
            self._counts["hits"] += hits
            self._counts["misses"] += len(keys) - hits
        loaded = iter(self._load([item[0] for item in found if item is not None]) if hits else [])
        metas = [item[1] if item is not None else None for item in found]
        arrays = [next(loaded) if item is not None else _EMPTY for item in found]
        return metas, arrays

    def contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def remove(self, keys: Sequence[CacheKey]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if self._values.pop(key, None) is not None:
                    self._index.discard(key)
                    n += 1
        self._publish()
        return n

    def keys(self) -> list[CacheKey]:
        with self._lock:
            return list(self._values)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._values.clear()
        self._publish()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tier": TIER_REMOTE,
                "backend": "ray",
                "entries": len(self._values),
                "used_bytes": self._index.used,
                "capacity_bytes": self._index.capacity,
                "policy": self._index.policy_name,
                "incarnation": self.incarnation,
                **self._counts,
            }


@ray.remote(num_cpus=0, max_concurrency=8)
class KVServer:
    """Named detached actor serving `ray://NAME`; implements `LowerTier`."""

    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        self._state = KVServerState(
            capacity_bytes, policy, store=ray.put, load=lambda refs: ray.get(refs)
        )

    def put(self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any) -> PutAck:
        """Pull the caller's batch (or take arrays by value) and keep an own copy per chunk."""
        return self._state.put(keys, metas, resolve_batch(batch))

    @ray.method(num_returns=2)
    def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list]:
        return self._state.get_batch(keys)

    def contains(self, keys: list[CacheKey]) -> list[bool]:
        return self._state.contains(keys)

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
    options: dict[str, Any] = {
        "name": name,
        "namespace": config.namespace,
        "get_if_exists": True,
        "lifetime": "detached",
        **ACTOR_OPTIONS,
    }
    if node_id:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if isinstance(resources, str):
        resources = {resources: _RESOURCE_SHARE}
    if resources:
        options["resources"] = dict(resources)
    return KVServer.options(**options).remote(
        config.max_remote_bytes, config.policy_for(TIER_REMOTE)
    )


__all__ = ["KVServer", "KVServerState", "get_or_create_kv_server"]
