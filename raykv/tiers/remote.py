"""The remote tier: `RemoteStore` (timeouts, error counting, back-off) over a back end
chosen by the scheme of `remote_url`. No Ray import, lazy or not: `ray.ObjectRef`s in a
put batch are resolved only when Ray is loaded.

* `ray://NAME` -> `raykv.actors.kv_server.RayServerBackend` (calls a named detached
  `KVServer` actor), handed to `RemoteStore` by the actor shells (`open_remote`).
* `redis://[[user]:password@]host:port/db`, `rediss://...` -> `RedisBackend`: a real
  Redis/Valkey server through `redis.asyncio`; values are `raykv.payload` codec records
  with the key string embedded, checked on read (no pickle anywhere).

Back ends raise on failure; `RemoteStore` wraps every call in a timeout and turns errors
into misses: an unreachable, slow or broken remote costs misses, never exceptions. A
failure counts in `raykv_remote_errors` and opens the remote's circuit breaker
(`raykv.tiers.breaker`, one per remote in a process): calls answer "miss" at once for a
back-off (0.1 s doubling to 2 s); after it one trial call goes to the server
(half-open), and its success closes the breaker.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from raykv import metrics
from raykv.errors import InvalidInputError, PayloadError
from raykv.keys import CacheKey
from raykv.masking import mask_url, url_secrets
from raykv.payload import (
    EMPTY,
    HEADER_PREFIX_BYTES,
    ForeignRecordError,
    PayloadMeta,
    buffer_problem,
    check_head,
    decode,
    encode,
    secret_tag,
)
from raykv.tiers.breaker import Breaker, breaker_for, is_outage
from raykv.tiers.budget import check_put_lengths
from raykv.wire import TIER_REMOTE, PutAck, join_parts, split_batch

logger = logging.getLogger(__name__)

_SCAN_COUNT = 1000
_DELETE_BATCH = 512
T = TypeVar("T")
# A put may take lookup_timeout plus this much per byte (a slow link still gets to finish).
PUT_BYTES_PER_S = 100e6


def _object_ref_type() -> type | None:
    ray = sys.modules.get("ray")  # a batch can hold ObjectRefs only if Ray is loaded
    return getattr(ray, "ObjectRef", None)


async def resolve_batch_async(batch: Any) -> list[np.ndarray]:
    """The arrays of a put's batch (see `raykv.wire.split_batch`), awaited."""
    refs, arrays = split_batch(batch, _object_ref_type())
    return join_parts(await asyncio.gather(*refs)) if refs else arrays


class RemoteBackend(Protocol):
    """What the remote tier needs from a back end; every method may raise."""

    scheme: str

    async def put(
        self, keys: list[CacheKey], metas: list[PayloadMeta], batch: Any, prefix: list[CacheKey]
    ) -> PutAck: ...

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
    key. A value that fails the codec check (garbage, truncated, another key's record) is
    a miss and is deleted. A well-formed record keyed with another `payload_secret` (or
    plain where keyed is needed, or keyed where plain is) is a miss and stays: another
    process of the cache may own it. A chunk whose array does not match its meta is
    skipped and counted. The password appears only in the client's connection settings:
    `repr`, logs and stats show the masked URL; the payload secret appears nowhere.
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
        self._secret = getattr(config, "payload_secret", None)
        # With a secret, its records live under names of their own: a value there that
        # fails its MAC is corrupt or forged (never another secret's) and is deleted, so
        # the next put stores the key again (SET NX kept the bad value for good).
        # (`ns:kv-<tag>:`, outside the no-secret names' `ns:kv:*`: their scans never meet)
        tag = f"-{secret_tag(self._secret)}" if self._secret else ""
        self.prefix = f"{config.namespace}:kv{tag}:"
        self._skipped = 0  # chunks refused by put (array and meta disagree)
        self._max_keys = getattr(config, "remote_index_max_keys", None)
        self._timeout_s = timeout_s
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

    async def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: Any,
        prefix: list[CacheKey] | None = None,
    ) -> PutAck:
        """`prefix`: unused (Redis evicts by its own policy)."""
        arrays = await resolve_batch_async(batch)
        check_put_lengths(keys, metas, arrays)
        ack = PutAck()
        pipe = self._client.pipeline(transaction=False)
        sent: list[CacheKey] = []
        # redis-py bounds the write of a whole pipeline by the socket time-out: send the
        # records in pipelines the time-out covers at the rate the put's own is sized by.
        piece, queued = max(1.0, self._timeout_s * PUT_BYTES_PER_S / 2), 0
        for key, meta, array in zip(keys, metas, arrays, strict=True):
            try:
                problem = buffer_problem(array, meta)
                if problem is not None:
                    raise PayloadError(problem)
                record = encode(array, meta, key.to_string(), secret=self._secret)
            except PayloadError as exc:
                logger.warning("redis tier: skipping %s: %s", key, exc)
                ack.skipped.append(key)
                continue
            if queued and queued + len(record) > piece:
                await pipe.execute()  # the pipeline is empty again after it
                queued = 0
            pipe.set(self._name(key), memoryview(record), nx=True)
            queued += len(record)
            sent.append(key)
        if ack.skipped:
            self._skipped += len(ack.skipped)
            metrics.inc("raykv_skipped_stores", len(ack.skipped), tier=TIER_REMOTE)
        if queued:
            await pipe.execute()
        ack.accepted.extend(sent)  # stored now, or an earlier value kept (NX)
        return ack

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """Each value's header and length first (one pipeline: EXISTS, GETRANGE of the
        first `HEADER_PREFIX_BYTES` and STRLEN), then the bodies of those whose header is this
        key's and whose length is what it declares: junk under a chunk's name (however
        large) costs a header read and is deleted, never read whole on every lookup."""
        if not keys:
            return [], []
        names = [self._name(k) for k in keys]
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
            pipe.getrange(name, 0, HEADER_PREFIX_BYTES - 1)
            pipe.strlen(name)
        # A command's own error (WRONGTYPE: a list or hash planted under a chunk's name)
        # comes back as its reply: that value is junk, the rest of the batch is served.
        replies = await pipe.execute(raise_on_error=False)
        values: list[bytes | None] = [None] * len(keys)
        bad: list[str] = []
        fetch: list[int] = []
        for i, key in enumerate(keys):
            exists, head, length = replies[3 * i : 3 * i + 3]
            if isinstance(exists, Exception) or not exists:
                continue  # no such value (or no answer for it: a miss)
            if isinstance(head, Exception) or isinstance(length, Exception):
                logger.warning("redis tier: deleting a value of %s that is no string", key)
                bad.append(names[i])
                continue
            length = int(length)
            verdict = self._verdict(key, head, length)
            if verdict != "ok":
                if verdict == "bad":
                    bad.append(names[i])
                continue
            if length <= len(head):
                values[i] = head  # a small record: already read whole
            else:
                fetch.append(i)
        if fetch:
            bodies = await self._client.mget([names[i] for i in fetch])
            for i, value in zip(fetch, bodies, strict=True):
                values[i] = value
        metas: list[PayloadMeta | None] = []
        arrays: list[np.ndarray] = []
        for key, value in zip(keys, values, strict=True):
            decoded = None
            if value is not None:
                try:
                    decoded = decode(value, key.to_string(), key.kv_dtype, secret=self._secret)
                except ForeignRecordError as exc:
                    if self._secret:  # under this secret's names: corrupt or forged
                        logger.warning("redis tier: deleting a value of %s: %s", key, exc)
                        bad.append(self._name(key))
                    else:  # a keyed record (an older writer's): theirs to keep
                        logger.debug("redis tier: a miss, not this reader's record %s", key)
                except PayloadError as exc:
                    logger.warning("redis tier: deleting a corrupt value of %s: %s", key, exc)
                    bad.append(self._name(key))
            metas.append(decoded.meta if decoded else None)
            arrays.append(decoded.data if decoded else EMPTY)
        if bad:
            try:  # the batch is read: a failed clean-up (no UNLINK right) must not lose it
                await self._client.unlink(*bad)
            except Exception as exc:
                logger.warning("redis tier: cannot delete %d bad values: %r", len(bad), exc)
        return metas, arrays

    def _verdict(self, key: CacheKey, head: bytes, length: int) -> str:
        """What a value whose first bytes are `head` and whose length is `length` is:
        "ok" (maybe `key`'s record: its body is worth reading), "foreign" (another
        secret's well-formed record: a miss left in place) or "bad" (junk to delete)."""
        try:
            header = check_head(head, length, secret=self._secret)
        except ForeignRecordError:
            return "bad" if self._secret else "foreign"
        except PayloadError as exc:
            logger.warning("redis tier: deleting a value of %s: %s", key, exc)
            return "bad"
        if header.key != key.to_string():
            logger.warning(
                "redis tier: deleting a value of %s: a record of %r", key, header.key[:80]
            )
            return "bad"
        return "ok"

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

    async def _names(self, limit: int | None = None, seconds: float | None = None) -> list[bytes]:
        """This namespace's value names, by SCAN: at most `limit`, and what was found by
        `seconds` from now (checked between SCAN calls, each bounded by the socket
        time-out: a cancellation from outside can get lost inside redis-py)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        names: list[bytes] = []
        cursor = 0
        while True:
            cursor, batch = await self._client.scan(
                cursor, match=self.prefix + "*", count=_SCAN_COUNT
            )
            names.extend(batch)
            if not cursor or (limit is not None and len(names) >= limit):
                return names[:limit]
            if deadline is not None and time.monotonic() >= deadline:
                logger.info("redis tier: listing stopped at %d names (time limit)", len(names))
                return names

    async def keys(self) -> list[CacheKey]:
        """This namespace's keys for an index resync: at most `remote_index_max_keys`,
        listed within about half the time-out (a partial listing costs only index hits:
        lookups still ask the server for keys the index does not know)."""
        out = []
        start = len(self.prefix)
        for name in await self._names(self._max_keys, self._timeout_s / 2):
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
            # DBSIZE, not a SCAN of the namespace: O(1) however many keys the server holds
            # (it counts every namespace's values in this Redis database).
            "entries": int(await self._client.dbsize()),
            "server_used_memory": info.get("used_memory"),
            "server_maxmemory": info.get("maxmemory"),
            "skipped": self._skipped,
        }

    async def server_id(self) -> str:
        info = await self._client.info("server")
        run_id = info.get("run_id")
        return run_id.decode() if isinstance(run_id, bytes) else str(run_id or "")

    async def close(self) -> None:
        await self._client.aclose()


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
        breaker: Breaker | None = None,
    ) -> None:
        """`breaker` defaults to this process's breaker of `remote_url` when the back end
        is made from the URL, and to a breaker of its own for a `backend` passed in."""
        url = config.remote_url
        if not url:
            raise InvalidInputError("remote_url is not set; the remote tier is disabled")
        self.url = mask_url(url)
        self._secrets = url_secrets(url)  # raw and decoded: neither may reach a log
        self.timeout_s = timeout_s if timeout_s is not None else config.lookup_timeout_ms / 1000
        self._backend = backend or make_backend(url, config, self.timeout_s)
        self._scheme = self._backend.scheme
        if breaker is None:
            breaker = breaker_for(self.url) if backend is None else Breaker(self.url)
        self.breaker = breaker
        self._server_id = ""  # last identity the server reported
        self._counts = dict.fromkeys(
            ("hits", "misses", "errors", "refused", "skipped_while_down"), 0
        )
        self.incarnation = uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    @property
    def errors(self) -> int:
        """Calls that failed or timed out so far."""
        return self._counts["errors"]

    # ----- failure handling -----

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    async def _call(
        self, op: str, fn: Callable[[], Awaitable[T]], miss: T, timeout: float | None = None
    ) -> T:
        """Run `fn()` within the timeout; on any failure count it and return `miss`.

        While backing off, and while a half-open trial call is in flight, answers `miss`
        at once without calling the server.
        """
        trial = self.admit()
        if trial is None:
            return miss
        try:
            result = await asyncio.wait_for(fn(), timeout or self.timeout_s)
        except asyncio.CancelledError:
            self.breaker.cancel(trial)
            raise
        except Exception as exc:
            self.settle(op, trial, exc)
            return miss
        self.settle(op, trial)
        return result

    def admit(self) -> bool | None:
        """Before a call: None to skip it (the breaker is open, or its half-open trial is
        in flight), else whether this call is that trial. Pair with `settle`."""
        trial = self.breaker.admit()
        if trial is None:
            self._counts["skipped_while_down"] += 1
        return trial

    def settle(self, op: str, trial: bool, exc: BaseException | None = None) -> None:
        """After an admitted call: record its success, or its failure `exc` (which opens
        the breaker only if it says the server cannot be reached: `is_outage`)."""
        changed = self.breaker.settle(trial, exc if exc is not None and is_outage(exc) else None)
        if exc is None:
            if changed:
                logger.info("remote tier %s is reachable again", self.url)
            return
        self._counts["errors"] += 1
        metrics.inc("raykv_remote_errors", 1, backend=self._scheme)
        reason = self._scrub(f"{type(exc).__name__}: {exc}")
        if not is_outage(exc):
            self._counts["refused"] += 1
            n = self._counts["refused"]
            log = logger.warning if n & (n - 1) == 0 else logger.debug  # 1st, 2nd, 4th, ...
            log(
                "remote tier %s refused a %s (%s): that call missed (%d so far)",
                self.url,
                op,
                reason,
                n,
            )
            return
        log = logger.warning if changed else logger.debug
        log(
            "remote tier %s failed on %s (%s); serving misses, retrying in %.1f s",
            self.url,
            op,
            reason,
            self.breaker.backoff_s,
        )

    @property
    def contains_blocking(self) -> Callable[[list[CacheKey], float], list[bool]] | None:
        """The back end's `contains` for a thread that may block (no event loop), if it
        has one; the caller brackets it with `admit`/`settle` and bounds it by
        `timeout_s`."""
        return getattr(self._backend, "contains_blocking", None)

    # ----- LowerTier -----

    async def put(
        self,
        keys: list[CacheKey],
        metas: list[PayloadMeta],
        batch: Any,
        prefix: list[CacheKey] | None = None,
    ) -> PutAck:
        """Store chunks (the first value of a key wins); a failure skips them all. `prefix`:
        the request's chunks before `keys[0]` (a server that evicts by policy keeps the
        chain prefix-closed with it)."""
        if not keys:
            return PutAck()
        nbytes = sum(m.nbytes for m in metas)
        timeout = self.timeout_s + nbytes / PUT_BYTES_PER_S
        return await self._call(
            "put",
            lambda: self._backend.put(list(keys), list(metas), batch, list(prefix or [])),
            PutAck(skipped=list(keys)),
            timeout,
        )

    async def get_batch(
        self, keys: list[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """Metas (None = miss) and arrays (empty = miss)."""
        n = len(keys)
        metas, arrays = await self._call(
            "get", lambda: self._backend.get_batch(list(keys)), ([None] * n, [EMPTY] * n)
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
            "healthy": self.breaker.closed,
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


# scheme -> back end class (a registry, not if/elif). `ray://` servers are actors: their
# back end (`raykv.actors.kv_server.RayServerBackend`) is handed in by the actor shells.
BACKENDS: dict[str, type] = {
    "redis": RedisBackend,
    "rediss": RedisBackend,
}


def make_backend(url: str, config: Any, timeout_s: float) -> RemoteBackend:
    """The back end for `url`; an unknown scheme lists the known ones."""
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme == "ray":
        raise InvalidInputError(
            "a ray:// remote is a Ray actor: open it with raykv.actors.kv_server.open_remote"
        )
    cls = BACKENDS.get(scheme)
    if cls is None:
        raise InvalidInputError(
            f"unknown remote_url scheme {scheme or '(none)'!r} in {mask_url(url)!r}; "
            f"known: {', '.join(sorted([*BACKENDS, 'ray']))}"
        )
    return cls(url, config, timeout_s)


__all__ = [
    "BACKENDS",
    "RemoteStore",
    "RedisBackend",
    "RemoteBackend",
    "make_backend",
    "resolve_batch_async",
]
