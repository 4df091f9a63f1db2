"""Back ends of the remote tier, chosen by the scheme of `remote_url`.

* `ray://NAME` -> `RayServerBackend`: calls a named detached `KVServer` actor.
* `redis://[[user]:password@]host:port/db`, `rediss://...` -> `RedisBackend`: a real
  Redis/Valkey server through `redis.asyncio`; values are `raykv.payload` codec records
  with the key string embedded, checked on read (no pickle anywhere).

Back ends raise on failure; `raykv.actors.remote_store.RemoteStore` wraps every call in
a timeout and turns errors into misses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import numpy as np
import ray

from raykv.actors.base import PutAck
from raykv.actors.common import check_put_lengths
from raykv.config import mask_url
from raykv.errors import InvalidInputError, PayloadError
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta, decode, encode

logger = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.uint8)
_SCAN_COUNT = 1000
_DELETE_BATCH = 512


async def resolve_batch_async(batch: Any) -> list[np.ndarray]:
    """The arrays of a put: `[ObjectRef]` holding `list[np.ndarray]`, or arrays by value."""
    if isinstance(batch, ray.ObjectRef):
        batch = [batch]
    batch = list(batch)
    if batch and all(isinstance(b, ray.ObjectRef) for b in batch):
        parts = await asyncio.gather(*batch)
        return [array for part in parts for array in part]
    return batch


class RemoteBackend(Protocol):
    """What the remote tier needs from a back end; every method may raise."""

    scheme: str

    async def put(self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any) -> PutAck: ...

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]: ...

    async def contains(self, keys: list[CacheKey]) -> list[bool]: ...

    async def remove(self, keys: list[CacheKey]) -> int: ...

    async def keys(self) -> list[CacheKey]: ...

    async def clear(self) -> None: ...

    async def stats(self) -> dict[str, Any]: ...

    async def server_id(self) -> str:
        """An id of the server process that changes when it restarts (its data is gone)."""
        ...

    async def close(self) -> None: ...


class RedisBackend:
    """Chunks as binary codec records under `<namespace>:kv:<key string>` in Redis.

    One pipeline (or one MGET / UNLINK) per request. `SET NX` keeps the first value of a
    key. A value that fails the codec check (garbage, truncated, another key's record)
    is a miss and is deleted. The password appears only in the client's connection
    settings: `repr`, logs and stats show the masked URL.
    """

    scheme = "redis"

    def __init__(self, url: str, config: Any, timeout_s: float) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise InvalidInputError(
                'the redis:// remote tier needs redis-py: pip install "raykv[redis]"'
            ) from exc
        self.masked_url = mask_url(url)
        self.prefix = f"{config.namespace}:kv:"
        # One immediate retry re-dials a connection that broke while the server restarted;
        # the caller's timeout bounds everything else.
        self._client = aioredis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
            decode_responses=False,
        )

    def __repr__(self) -> str:
        return f"RedisBackend({self.masked_url!r})"

    def _name(self, key: CacheKey) -> str:
        return self.prefix + key.to_string()

    async def put(self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any) -> PutAck:
        arrays = await resolve_batch_async(batch)
        check_put_lengths(keys, metas, arrays)
        ack = PutAck()
        pipe = self._client.pipeline(transaction=False)
        sent: list[CacheKey] = []
        for key, meta, array in zip(keys, metas, arrays, strict=True):
            try:
                record = encode(array, meta, key.to_string())
            except PayloadError as exc:
                logger.warning("redis tier: skipping %s: %s", key, exc)
                ack.skipped.append(key)
                continue
            pipe.set(self._name(key), memoryview(record), nx=True)
            sent.append(key)
        if sent:
            await pipe.execute()
        ack.accepted.extend(sent)  # stored now, or an earlier value kept (NX)
        return ack

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        if not keys:
            return [], []
        values = await self._client.mget([self._name(k) for k in keys])
        metas: list[PayloadMeta | None] = []
        arrays: list[np.ndarray] = []
        bad: list[str] = []
        for key, value in zip(keys, values, strict=True):
            decoded = None
            if value is not None:
                try:
                    decoded = decode(value, key.to_string(), key.kv_dtype)
                except PayloadError as exc:
                    logger.warning("redis tier: deleting a corrupt value of %s: %s", key, exc)
                    bad.append(self._name(key))
            metas.append(decoded.meta if decoded else None)
            arrays.append(decoded.data if decoded else _EMPTY)
        if bad:
            await self._client.unlink(*bad)
        return metas, arrays

    async def contains(self, keys: list[CacheKey]) -> list[bool]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        return [bool(n) for n in await pipe.execute()]

    async def remove(self, keys: list[CacheKey]) -> int:
        if not keys:
            return 0
        return int(await self._client.unlink(*[self._name(k) for k in keys]))

    async def _names(self) -> list[bytes]:
        return [
            name
            async for name in self._client.scan_iter(match=self.prefix + "*", count=_SCAN_COUNT)
        ]

    async def keys(self) -> list[CacheKey]:
        out = []
        start = len(self.prefix)
        for name in await self._names():
            try:
                out.append(CacheKey.from_string(name[start:].decode("utf-8")))
            except (InvalidInputError, UnicodeDecodeError):
                continue  # not one of ours
        return out

    async def clear(self) -> None:
        names = await self._names()
        for i in range(0, len(names), _DELETE_BATCH):
            await self._client.unlink(*names[i : i + _DELETE_BATCH])

    async def stats(self) -> dict[str, Any]:
        info = await self._client.info("memory")
        return {
            "backend": "redis",
            "url": self.masked_url,
            "entries": len(await self._names()),
            "server_used_memory": info.get("used_memory"),
            "server_maxmemory": info.get("maxmemory"),
        }

    async def server_id(self) -> str:
        info = await self._client.info("server")
        run_id = info.get("run_id")
        return run_id.decode() if isinstance(run_id, bytes) else str(run_id or "")

    async def close(self) -> None:
        await self._client.aclose()


class RayServerBackend:
    """Calls the `KVServer` actor named by `ray://NAME` (created detached if missing).

    `extra_config` may place it: `kv_server_node_id` (a node id) or `kv_server_resources`
    (a custom resource name or `{name: amount}`).
    """

    scheme = "ray"

    def __init__(self, url: str, config: Any, timeout_s: float) -> None:
        from raykv.actors.kv_server import get_or_create_kv_server

        self.masked_url = url
        self.name = url[len("ray://") :]
        extra = config.extra_config
        self._server = get_or_create_kv_server(
            self.name,
            config,
            node_id=extra.get("kv_server_node_id"),
            resources=extra.get("kv_server_resources"),
        )

    def __repr__(self) -> str:
        return f"RayServerBackend({self.masked_url!r})"

    async def put(self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any) -> PutAck:
        # A list of refs travels as is: the server pulls the batch from its owner itself.
        return await self._server.put.remote(keys, metas, batch)

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        metas_ref, arrays_ref = self._server.get_batch.options(num_returns=2).remote(keys)
        metas, arrays = await asyncio.gather(metas_ref, arrays_ref)
        return metas, arrays

    async def contains(self, keys: list[CacheKey]) -> list[bool]:
        return await self._server.contains.remote(keys)

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
        return await self._server.incarnation.remote()

    async def close(self) -> None:
        return None


# scheme -> back end class (a registry, not if/elif).
BACKENDS: dict[str, type] = {
    "ray": RayServerBackend,
    "redis": RedisBackend,
    "rediss": RedisBackend,
}


def make_backend(url: str, config: Any, timeout_s: float) -> RemoteBackend:
    """The back end for `url`; an unknown scheme lists the known ones."""
    scheme = url.partition("://")[0] if "://" in url else ""
    cls = BACKENDS.get(scheme)
    if cls is None:
        raise InvalidInputError(
            f"unknown remote_url scheme {scheme or '(none)'!r} in {mask_url(url)!r}; "
            f"known: {', '.join(sorted(BACKENDS))}"
        )
    return cls(url, config, timeout_s)


__all__ = [
    "BACKENDS",
    "RayServerBackend",
    "RedisBackend",
    "RemoteBackend",
    "make_backend",
    "resolve_batch_async",
]
