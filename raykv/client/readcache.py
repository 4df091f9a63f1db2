"""A client's read cache: the batch objects it read lately, kept mapped (config
`read_cache_size`).

A retrieve asks the manager which batch object holds each chunk (one round trip, as
always) and then reads those objects from the object store. Reading an object this
process read before costs a `ray.get` all the same (a round trip to the object store,
registering a ref an actor just returned, and for an object on another node a
transfer). Objects never change, so a value read once can serve every later read of
the same object: this cache keeps the values (zero-copy views of the object store) of
the last batches read, bounded by their bytes. On one node it saved 0.05-0.08 ms per
8-32 MiB retrieve here (`benchmarks/bench_datapath.py`).

When every chunk of a request was last read from an object still held, the client asks
the manager to name the objects by id instead of returning their refs: a returned ref
costs the caller another ~0.1-0.3 ms to register with its owner. If the manager names an
object the cache no longer holds, the client asks again for refs.

What a chunk's bytes become (its zero-copy torch tensor, ~0.1 ms to build on cold
caches) is kept with the object too (`memo`), and goes when it goes.

What it costs: an object the cache holds stays in the object store after the CPU tier
evicted it, until the cache drops it, so up to `read_cache_size` per client counts
outside `max_local_cpu_size`. It never serves a chunk the manager did not just name:
the manager is asked on every retrieve, so pins, recency and `clear()` work as without
it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


def value_nbytes(value: Any) -> int:
    """Bytes of a batch value: an array, or a list/tuple of arrays."""
    if isinstance(value, (list, tuple)):
        return sum(int(getattr(v, "nbytes", 0)) for v in value)
    return int(getattr(value, "nbytes", 0))


def object_id(ref: Any) -> Any:
    """The id a read cache files `ref` under: its object id (bytes) for a Ray ref."""
    binary = getattr(ref, "binary", None)
    return binary() if binary is not None else ref


_MEMOS = 1024  # `memo` results kept per object at most (one per chunk of its batch, in use)


class ReadCache:
    """Values of objects read lately, by object id, least recently used first out, at
    most `capacity_bytes` in all (an object larger than that is not kept), and which
    object each chunk key was last read from (`covers`). Thread-safe; a fetch runs
    without the lock."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        # object id -> (value, bytes, keys read from it, what `memo` made of it)
        self._values: OrderedDict[Any, tuple[Any, int, list[Any], dict[Any, Any]]] = OrderedDict()
        self._where: dict[Any, Any] = {}  # chunk key -> object id it was last read from
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def covers(self, keys: Sequence[Any]) -> bool:
        """Whether every key was last read from an object still held: the reader may ask
        for object ids instead of refs (`RetrieveResult.wire(ids=True)`)."""
        with self._lock:
            where, values = self._where, self._values
            return bool(keys) and all(where.get(k) in values for k in keys)

    def held(self, ids: Sequence[Any]) -> list[Any] | None:
        """The values of objects `ids`, or None unless every one is held."""
        with self._lock:
            got = [self._values.get(i) for i in ids]
            if any(v is None for v in got):
                return None
            for i in ids:
                self._values.move_to_end(i)
            self.hits += len(ids)
            return [v[0] for v in got]  # type: ignore[index]

    def read(self, refs: Sequence[Any], fetch: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """The values of `refs`: held ones from here, the others from one `fetch(missing)`
        call (which may raise: nothing is kept then), then kept."""
        ids = [object_id(r) for r in refs]
        values: list[Any] = [None] * len(refs)
        missing: list[int] = []
        with self._lock:
            for i, oid in enumerate(ids):
                held = self._values.get(oid)
                if held is None:
                    missing.append(i)
                else:
                    self._values.move_to_end(oid)
                    values[i] = held[0]
            self.hits += len(refs) - len(missing)
            self.misses += len(missing)
        if missing:
            got = fetch([refs[i] for i in missing])
            with self._lock:
                for i, value in zip(missing, got, strict=True):
                    values[i] = value
                    self._keep(ids[i], value)
        return values

    def note(self, keys: Sequence[Any], refs: Sequence[Any]) -> None:
        """Chunk `keys[i]` was read from object `refs[i]` (a ref or an id). A key now
        in an object not held here is forgotten: its old object no longer serves it
        (else `covers` would keep sending reads by id that this cache then misses)."""
        with self._lock:
            for key, ref in zip(keys, refs, strict=True):
                oid = object_id(ref)
                held = self._values.get(oid)
                if held is None:
                    self._where.pop(key, None)
                elif self._where.get(key) != oid:
                    self._where[key] = oid
                    held[2].append(key)

    def memo(self, oid: Any, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, kept with object `oid` while the cache holds it and returned again
        for the same `key` (a view of its value that costs to build: built once). Not
        kept for an object the cache does not hold."""
        with self._lock:
            held = self._values.get(oid)
            made = None if held is None else held[3].get(key)
        if made is None:
            made = make()
            if held is not None:
                with self._lock:
                    memos = held[3]
                    if len(memos) >= _MEMOS:
                        memos.clear()
                    memos[key] = made
        return made

    def _keep(self, oid: Any, value: Any) -> None:
        size = value_nbytes(value)
        if size > self.capacity_bytes or oid in self._values:
            return
        self._values[oid] = (value, size, [], {})
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:
            dropped, (_, nbytes, keys, _) = self._values.popitem(last=False)
            self.used_bytes -= nbytes
            for key in keys:
                if self._where.get(key) == dropped:
                    del self._where[key]

    def clear(self) -> None:
        """Drop every value (the object store may free them)."""
        with self._lock:
            self._values.clear()
            self._where.clear()
            self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def stats(self) -> dict[str, int]:
        return {
            "read_cache_hits": self.hits,
            "read_cache_misses": self.misses,
            "read_cache_bytes": self.used_bytes,
            "read_cache_objects": len(self._values),
        }


__all__ = ["ReadCache", "object_id", "value_nbytes"]
