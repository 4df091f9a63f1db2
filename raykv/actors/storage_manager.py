"""StorageManager: the one entry point of the cache, a threaded Ray actor around a
`ManagerCore` (`raykv.actors.manager_core`), which holds the state and logic.

The actor runs the core's coroutines on its own event loop, in a thread, and the calls
the index alone answers on the Ray thread that received them (see "The manager's
threads" in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import functools
import selectors
import threading
from collections.abc import Sequence
from typing import Any

import ray

from raykv.actors.base import STORAGE_MANAGER_NAME, actor_name
from raykv.actors.common import named_actor
from raykv.actors.factory import actor_options
from raykv.actors.manager_core import ManagerCore, RemoteProbe
from raykv.config import RayKVConfig
from raykv.keys import CacheKey, ChunkSpan, KeyIdentity
from raykv.tiers.cpulog import Cursor
from raykv.wire import PackedSpans


def get_or_create_manager(config: RayKVConfig, node_id: str | None = None) -> Any:
    """The `StorageManager` of `config.namespace` (detached); it creates or attaches its
    tiers. With `node_id` it is that node's manager (`raykv-storage-manager-<node>`, with
    its own CPU store, both pinned to the node): one cache instance per node."""
    name = actor_name(STORAGE_MANAGER_NAME, node_id)
    options = actor_options(name, config.namespace, node_id)
    return named_actor(StorageManager, options, config, node_id)


class _LoopLock(selectors.DefaultSelector):
    """The loop's selector, holding `lock` except while the loop waits for I/O.

    The loop thread takes `lock` before it runs, so every callback and coroutine step
    runs holding it; a Ray thread that takes it runs between two steps, as if it were
    one more callback. The lock is never held across the wait.
    """

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self._lock = lock

    def select(self, timeout: float | None = None) -> list:
        self._lock.release()
        try:
            return super().select(timeout)
        finally:
            self._lock.acquire()


async def _make_core(config: RayKVConfig, node_id: str | None) -> ManagerCore:
    return ManagerCore(config, node_id)  # built on the loop: its parts take its loop


def _on_loop(name: str) -> Any:
    """A `StorageManager` method that runs `ManagerCore.<name>` on the loop and waits.

    A plain function (not a coroutine function: Ray would make the actor async), with
    the core method's name, signature and docstring."""
    core_method = getattr(ManagerCore, name)

    @functools.wraps(core_method)
    def method(self: StorageManager, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._core, name)(*args, **kwargs))

    return method


# Ray threads that may wait on the loop at once (`wait`, `get` of a prefetch, `put`).
MANAGER_THREADS = 128


@ray.remote(max_concurrency=MANAGER_THREADS)
class StorageManager:
    """The cache's single entry point (the actor): a `ManagerCore` on its own event loop.

    A threaded actor, not an async one (so no method may be a coroutine): Ray hands an
    async actor's arguments to its loop on an extra thread hop (~0.15-0.2 ms a call
    here), which a threaded actor skips. A `lookup` the index answers and a `get` served
    from CPU run on the calling Ray thread (`ManagerCore.try_*`) under the loop's lock,
    between two loop steps; everything else runs on the loop, as before.
    """

    def __init__(self, config: RayKVConfig, node_id: str | None = None) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.SelectorEventLoop(_LoopLock(self._lock))
        self._thread = threading.Thread(target=self._serve, name="raykv-manager-loop", daemon=True)
        self._thread.start()
        self._core: ManagerCore = self._run(_make_core(config, node_id))

    def _serve(self) -> None:
        self._lock.acquire()
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _run(self, coro: Any) -> Any:
        """Run `coro` on the loop and wait for it (on this Ray thread, lock not held)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        pin: bool = False,
        search_range: Sequence[str] | None = None,
        lookup_id: str | None = None,
    ) -> int:
        """See `ManagerCore.lookup`."""
        with self._lock:
            step = self._core.try_lookup(spans, pin, search_range, lookup_id)
        if isinstance(step, RemoteProbe):
            step.ask()  # the remote server, from this thread, lock not held
            with self._lock:
                return self._core.finish_probe(step)
        if step is not None:
            return step
        return self._run(self._core.lookup(spans, pin, search_range, lookup_id))

    def lookup_local(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        pin: bool = False,
        lookup_id: str | None = None,
    ) -> int:
        """See `ManagerCore.lookup_local`."""
        with self._lock:
            step = self._core.try_lookup(spans, pin, None, lookup_id, probe=False)
        if step is not None:
            return step  # type: ignore[return-value]  # never a RemoteProbe without probe
        return self._run(self._core.lookup_local(spans, pin, lookup_id))

    def note_remote(
        self, spans: Sequence[ChunkSpan] | PackedSpans, start: int, found: int, failed: bool
    ) -> None:
        """See `ManagerCore.note_remote` (on this Ray thread: it only updates the index)."""
        with self._lock:
            self._core.note_remote(spans, start, found, failed)

    def cpu_events(
        self, cursor: Cursor | None, identity: KeyIdentity, tiers: Sequence[str] | None = None
    ) -> tuple[Cursor, list | None]:
        """See `ManagerCore.cpu_events` (on this Ray thread: it only reads the log)."""
        with self._lock:
            return self._core.cpu_events(cursor, identity, tiers)

    def cpu_keys(self, identity: KeyIdentity, tier: str = "cpu") -> list[str]:
        """See `ManagerCore.cpu_keys` (on this Ray thread: it only reads the index)."""
        with self._lock:
            return self._core.cpu_keys(identity, tier)

    def get(
        self,
        spans: Sequence[ChunkSpan] | PackedSpans,
        lookup_id: str | None = None,
        check_cpu: bool = False,
        ids: bool = False,
    ) -> tuple:
        """See `ManagerCore.get`."""
        if not check_cpu:
            with self._lock:
                reply = self._core.try_get(spans, lookup_id, ids)
            if reply is not None:
                return reply
        return self._run(self._core.get(spans, lookup_id, check_cpu, ids))

    def peer_read(self, keys: list[CacheKey]) -> tuple:
        """See `ManagerCore.peer_read` (on this Ray thread unless chunks need gathering:
        a peer's read then costs one loop hop less)."""
        with self._lock:
            reply = self._core.try_peer_read(keys)
        return reply if reply is not None else self._run(self._core.peer_read(keys))

    def get_held(self, spans: Sequence[ChunkSpan] | PackedSpans) -> tuple:
        """`get(spans, ids=True)` in one argument (Ray serializes each argument on its
        own): what a client with a read cache sends when it holds the batches."""
        return self.get(spans, None, False, True)

    # Everything else runs on the loop as it is (the core's signature and docstring).
    put = _on_loop("put")
    prefetch = _on_loop("prefetch")
    wait = _on_loop("wait")
    fetch = _on_loop("fetch")
    note_engine = _on_loop("note_engine")
    unpin = _on_loop("unpin")
    remove = _on_loop("remove")
    flush = _on_loop("flush")
    stats = _on_loop("stats")
    clear = _on_loop("clear")
    incarnations = _on_loop("incarnations")
    indexed_keys = _on_loop("indexed_keys")
    tier_handles = _on_loop("tier_handles")
    read_directly = _on_loop("read_directly")


__all__ = [
    "ManagerCore",
    "StorageManager",
    "get_or_create_manager",
]
