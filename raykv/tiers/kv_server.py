"""The state of a `ray://NAME` KV server (index, byte budget, policy); values are opaque
handles made and read by functions the actor injects (`ray.put`/`ray.get`), so this is
tested without Ray.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from raykv import metrics
from raykv.keys import CacheKey
from raykv.payload import EMPTY, PayloadMeta, buffer_problem
from raykv.tiers.budget import ByteBudgetIndex, check_put_lengths
from raykv.wire import TIER_REMOTE, PutAck

logger = logging.getLogger(__name__)


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
        # probes: `contains` calls (a manager's or a client's lookup asking), the load that
        # config client_remote_probe adds to.
        self._counts = dict.fromkeys(
            ("hits", "misses", "evictions", "skipped", "errors", "probes"), 0
        )
        self.incarnation = uuid.uuid4().hex

    def put(
        self,
        keys: Sequence[CacheKey],
        metas: Sequence[PayloadMeta],
        arrays: Sequence[np.ndarray],
        prefix: Sequence[CacheKey] = (),
    ) -> PutAck:
        """Store chunks not held yet, evicting by policy to make room.

        The request's chain (`prefix`, its chunks before `keys[0]`, then `keys`) stays
        prefix-closed, as on disk: its held chunks are not evicted for its new ones, and
        it is placed deepest first, so its prefix ends the most recent.
        A chunk whose array is not a byte buffer of its meta's declared size (or whose
        meta is not a valid `PayloadMeta`) is skipped and counted, never stored.
        """
        check_put_lengths(keys, metas, arrays)
        ack = PutAck()
        chain = [*prefix, *keys]
        with self._lock:
            self._index.spare(chain)
        try:
            for key, meta, array in zip(keys, metas, arrays, strict=True):
                problem = buffer_problem(array, meta)
                if problem is not None:
                    logger.warning("kv server: skipping %s: %s", key, problem)
                    ack.skipped.append(key)
                    continue
                size = meta.nbytes
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
        finally:
            with self._lock:  # deepest first: the request's first chunk the most recent
                self._index.place(chain, spared=True)
        with self._lock:
            self._counts["evictions"] += len(ack.evicted)
            self._counts["skipped"] += len(ack.skipped)
        if ack.evicted:
            policy = self._index.policy_name
            metrics.inc("raykv_evictions", len(ack.evicted), tier=TIER_REMOTE, policy=policy)
        metrics.inc("raykv_skipped_stores", len(ack.skipped), tier=TIER_REMOTE)
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
        arrays = [next(loaded) if item is not None else EMPTY for item in found]
        return metas, arrays

    def contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        with self._lock:
            self._counts["probes"] += 1
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


__all__ = ["KVServerState"]
