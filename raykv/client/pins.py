"""The pin book of a client: the pinned lookups it opened itself, until their retrieve,
`unpin` or `close`. Plain Python (no Ray); `KVCache` sends the unpins."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

from raykv.keys import CacheKey, ChunkSpan

# Pinned lookups a client may leave open before the oldest is unpinned (leases end them too).
MAX_OPEN_PINS = 4096


class PinBook:
    """Open lookups by id (oldest first) and by the key of their last pinned chunk.

    A retrieve without an id releases the oldest lookup whose last chunk is in its spans
    (two requests sharing a prefix each hold their own pin; each retrieve releases
    exactly one). A caller-named lookup is the caller's to retrieve or unpin: it is never
    in the book. Thread-safe: one client serves many threads.
    """

    def __init__(self, limit: int = MAX_OPEN_PINS) -> None:
        self._limit = limit
        self._pins: OrderedDict[str, CacheKey] = OrderedDict()
        self._by_key: dict[CacheKey, deque[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._pins))

    def open(self, lookup_id: str, key: CacheKey) -> list[str]:
        """Remember `lookup_id`, found later by its last hit chunk `key`; returns the
        oldest lookups past the limit, forgotten here, for the caller to unpin."""
        with self._lock:
            self._pins[lookup_id] = key
            self._by_key.setdefault(key, deque()).append(lookup_id)
            over = []
            while len(self._pins) > self._limit:
                oldest = next(iter(self._pins))
                self._forget(oldest)
                over.append(oldest)
            return over

    def forget(self, lookup_id: str) -> None:
        with self._lock:
            self._forget(lookup_id)

    def _forget(self, lookup_id: str) -> None:
        key = self._pins.pop(lookup_id, None)
        ids = self._by_key.get(key) if key is not None else None
        if ids:
            ids.remove(lookup_id)
            if not ids:
                del self._by_key[key]

    def take(self, spans: Sequence[ChunkSpan]) -> str | None:
        """The oldest open lookup whose last chunk is in `spans`, forgotten here."""
        with self._lock:
            for span in reversed(spans):
                ids = self._by_key.get(span.key)
                if ids:
                    lookup_id = ids[0]
                    self._forget(lookup_id)
                    return lookup_id
            return None

    def clear(self) -> None:
        with self._lock:
            self._pins.clear()
            self._by_key.clear()


__all__ = ["MAX_OPEN_PINS", "PinBook"]
