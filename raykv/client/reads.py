"""Pieces of the client's read path with no state of their own: the attempts of a
get (`get_call`), how many spans a hit covers, and the check of spans a caller built
(`KVCache.hashed_spans` or its own)."""

from __future__ import annotations

import bisect
from typing import Any

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, ChunkSpan

# The attempts of a get, in order. BY_ID: the read cache holds every chunk's batch, so
# the manager names them by id (no refs to register). BY_REF: refs, read with ray.get
# (after BY_ID found a batch gone from the read cache). CHECKED: refs again after a read
# failed, the manager first asking the CPU store which chunks it still holds.
BY_ID, BY_REF, CHECKED = "by-id", "by-ref", "checked"


def get_call(attempt: str, packed: Any, lookup_id: str | None) -> tuple[str, tuple]:
    """The manager method and arguments of one attempt (arguments left at their defaults
    are not sent)."""
    if attempt == BY_ID and lookup_id is None:
        return "get_held", (packed,)  # one argument: Ray sends each apart
    if attempt == BY_ID:
        return "get", (packed, lookup_id, False, True)
    if attempt == BY_REF and lookup_id is None:
        return "get", (packed,)
    return "get", (packed, lookup_id, attempt == CHECKED)


def is_true(found: object) -> bool:
    return found is True  # a probe's answer: True, False or None (unknown)


def chunks_within(spans: list[ChunkSpan], hit: int, chunk_size: int) -> int:
    """How many leading `spans` end within `hit` tokens (spans of whole chunks from token
    0 need no search)."""
    k = hit // chunk_size
    if k <= len(spans) and (spans[k - 1].end if k else 0) == hit:
        return k
    return bisect.bisect_right([s.end for s in spans], hit)


def check_spans(spans: Any, what: str = "spans") -> None:
    """Raise `InvalidInputError` unless `spans` is a list of `ChunkSpan`s keyed by
    `CacheKey`s (what `KVCache.spans` / `hashed_spans` build): a malformed one would
    fail deep in the manager, or on a worker thread after the call returned."""
    if not isinstance(spans, list):
        raise InvalidInputError(f"{what} must be a list of ChunkSpan, got {type(spans).__name__}")
    for i, span in enumerate(spans):
        if not isinstance(span, ChunkSpan) or not isinstance(span.key, CacheKey):
            raise InvalidInputError(
                f"{what}[{i}] must be a ChunkSpan with a CacheKey key, got {span!r:.100}"
            )


__all__ = ["BY_ID", "BY_REF", "CHECKED", "check_spans", "chunks_within", "get_call", "is_true"]
