"""L3: the remote tier. One async actor interface over the back ends of `raykv.remote_backends`.

An unreachable, slow or broken remote costs misses, never exceptions: every call is
wrapped in a timeout (`lookup_timeout_ms`; puts get extra time per byte), a failure
counts in `raykv_remote_errors` and opens a short back-off window (0.1 s doubling to
2 s) during which calls answer "miss" at once instead of waiting on a dead server. After
the window the back-off is half-open: one trial call goes to the server while every
other call still gets a fast miss; its success closes the breaker (the tier reconnects
by itself), its failure opens a longer window.

`incarnation()` is this actor's id plus the server's identity (a KVServer's incarnation,
a Redis server's run_id), so the manager notices a restarted remote and resyncs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import ray

from raykv import metrics
from raykv.actors.base import REMOTE_STORE_NAME, TIER_REMOTE, PutAck
from raykv.actors.common import get_or_create_node_actor
from raykv.config import mask_url
from raykv.errors import InvalidInputError
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.remote_backends import RemoteBackend, make_backend

logger = logging.getLogger(__name__)

T = TypeVar("T")
_EMPTY = np.empty(0, dtype=np.uint8)
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
# A put may take lookup_timeout plus this much per byte (a slow link still gets to finish).
PUT_BYTES_PER_S = 100e6


class RemoteStore:
    """The remote tier's logic: a back end behind timeouts, error counting and back-off.

    Every public method is a coroutine that never raises for a remote failure; it returns
    what a miss looks like instead (False, None, an empty array, a PutAck that skipped).
    """

    def __init__(
        self,
        config: Any,
        *,
        backend: RemoteBackend | None = None,
        timeout_s: float | None = None,
    ) -> None:
        url = config.remote_url
        if not url:
            raise InvalidInputError("remote_url is not set; the remote tier is disabled")
        self.url = mask_url(url)
        self._secret = urlsplit(url).password if "://" in url else None
        self.timeout_s = timeout_s if timeout_s is not None else config.lookup_timeout_ms / 1000
        self._backend = backend or make_backend(url, config, self.timeout_s)
        self._scheme = self._backend.scheme
        self._retry_at = 0.0
        self._backoff = 0.0
        self._healthy = True
        self._trial = False  # a half-open trial call is in flight
        self._server_id = ""  # last identity the server reported
        self._counts = dict.fromkeys(("hits", "misses", "errors", "skipped_while_down"), 0)
        self.incarnation = uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    # ----- failure handling -----

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    async def _call(
        self, op: str, fn: Callable[[], Awaitable[T]], miss: T, timeout: float | None = None
    ) -> T:
        """Run `fn()` within the timeout; on any failure count it and return `miss`.

        While backing off, and while a half-open trial call is in flight, answers `miss`
        at once without calling the server.
        """
        trial = False
        if self._backoff:
            if self._trial or time.monotonic() < self._retry_at:
                self._counts["skipped_while_down"] += 1
                return miss
            trial = self._trial = True
        try:
            result = await asyncio.wait_for(fn(), timeout or self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(op, exc)
            return miss
        finally:
            if trial:
                self._trial = False
        if not self._healthy:
            logger.info("remote tier %s is reachable again", self.url)
            self._healthy = True
        self._backoff = 0.0
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        self._counts["errors"] += 1
        metrics.inc("raykv_remote_errors", 1, backend=self._scheme)
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        reason = self._scrub(f"{type(exc).__name__}: {exc}")
        if self._healthy:
            logger.warning(
                "remote tier %s failed on %s (%s); serving misses, retrying in %.1f s",
                self.url,
                op,
                reason,
                self._backoff,
            )
            self._healthy = False
        else:
            logger.debug("remote tier %s still failing on %s: %s", self.url, op, reason)

    # ----- LowerTier -----

    async def put(self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any) -> PutAck:
        """Store chunks (the first value of a key wins); a failure skips them all."""
        if not keys:
            return PutAck()
        nbytes = sum(m.nbytes for m in metas)
        timeout = self.timeout_s + nbytes / PUT_BYTES_PER_S
        return await self._call(
            "put",
            lambda: self._backend.put(list(keys), list(metas), batch),
            PutAck(skipped=list(keys)),
            timeout,
        )

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """Metas (None = miss) and arrays (empty = miss)."""
        n = len(keys)
        metas, arrays = await self._call(
            "get", lambda: self._backend.get_batch(list(keys)), ([None] * n, [_EMPTY] * n)
        )
        hits = sum(m is not None for m in metas)
        self._counts["hits"] += hits
        self._counts["misses"] += n - hits
        return metas, arrays

    async def contains(self, keys: list[CacheKey]) -> list[bool]:
        return await self._call(
            "contains", lambda: self._backend.contains(list(keys)), [False] * len(keys)
        )

    async def remove(self, keys: list[CacheKey]) -> int:
        return await self._call("remove", lambda: self._backend.remove(list(keys)), 0)

    async def keys(self) -> list[CacheKey]:
        return await self._call("keys", self._backend.keys, [])

    async def clear(self) -> None:
        await self._call("clear", self._backend.clear, None)

    async def stats(self) -> dict[str, Any]:
        backend = await self._call("stats", self._backend.stats, {})
        return {
            "tier": TIER_REMOTE,
            "url": self.url,
            "backend": self._scheme,
            "healthy": self._healthy,
            "incarnation": self.incarnation,
            **backend,
            **self._counts,
        }

    async def identity(self) -> str:
        """`<this store's id>:<the server's id>`; the server's part changes when it restarts.

        An unreachable server keeps its last known id (an outage is not a restart).
        """
        ask = getattr(self._backend, "server_id", None)
        server_id = await self._call("identity", ask, None) if ask is not None else None
        if server_id:
            self._server_id = str(server_id)
        return f"{self.incarnation}:{self._server_id}"

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._backend.close(), self.timeout_s)
        except Exception as exc:
            logger.debug("remote tier %s: close failed: %s", self.url, self._scrub(str(exc)))


@ray.remote(num_cpus=0)
class RemoteStoreActor:
    """Thin async Ray actor around one `RemoteStore` (implements `LowerTier`)."""

    def __init__(self, config: Any, timeout_s: float | None = None) -> None:
        self._store = RemoteStore(config, timeout_s=timeout_s)

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return f"RemoteStoreActor({self._store.url})"

    async def put(self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any) -> PutAck:
        return await self._store.put(keys, metas, batch)

    @ray.method(num_returns=2)
    async def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list]:
        return await self._store.get_batch(keys)

    async def contains(self, keys: list[CacheKey]) -> list[bool]:
        return await self._store.contains(keys)

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
