"""Names, records and the tier protocol shared by raykv's actors.

Data flow (one actor round trip per request from the client, batched calls to tiers):

* A *batch object* is one Ray object holding `list[np.ndarray]` (flat uint8 chunk
  payloads, see `raykv.payload`). One batch per request, not one object per chunk:
  `ray.put` has a ~0.5 ms fixed cost.
* A chunk in the CPU tier is addressed by a `ChunkRef`: the batch's ObjectRef, the
  chunk's index in it, and its `PayloadMeta`. A client reads a request's chunks with
  one `ray.get` of the distinct batch refs (zero-copy on the same node).
* Lower tiers (disk, remote) implement `LowerTier`. `get_batch` is called with
  `num_returns=2` so that the *caller* (the CPUStore, when it promotes) owns the
  returned arrays object: ownership moves by pulling, since `ray.put(_owner=)` is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import ray

    from raykv.keys import CacheKey
    from raykv.payload import PayloadMeta

# Every actor lives in the configured namespace (default "raykv") under these names.
# Node-scoped actors (one per node) append "-<node_id[:12]>" to the name.
DEFAULT_NAMESPACE = "raykv"
STORAGE_MANAGER_NAME = "raykv-storage-manager"
CPU_STORE_NAME = "raykv-cpu-store"
DISK_STORE_NAME = "raykv-disk-store"
REMOTE_STORE_NAME = "raykv-remote-store"
CONTROLLER_NAME = "raykv-controller"

TIER_CPU = "cpu"
TIER_DISK = "disk"
TIER_REMOTE = "remote"
TIER_ORDER = (TIER_CPU, TIER_DISK, TIER_REMOTE)

# Restart policy of every raykv actor: restart forever, retry calls in flight.
ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": -1, "max_task_retries": -1}


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where one cached chunk lives in the CPU tier: `ray.get(ref)[index]` is its flat bytes."""

    ref: ray.ObjectRef
    index: int
    meta: PayloadMeta


@dataclass(slots=True)
class PutAck:
    """What a tier did with a put: which keys it accepted, which it evicted to make room,
    and which it skipped (no room, everything pinned, or a write it refused)."""

    accepted: list[CacheKey] = field(default_factory=list)
    evicted: list[CacheKey] = field(default_factory=list)
    skipped: list[CacheKey] = field(default_factory=list)


class LowerTier(Protocol):
    """The batch interface of a disk or remote tier actor (called through `.remote`).

    Every method takes a whole request's keys. A miss, an unreachable server or a
    corrupt payload is reported as absence (None / False), never as an exception.
    """

    def put(
        self, keys: list[CacheKey], metas: list[PayloadMeta], batch: list[ray.ObjectRef]
    ) -> PutAck:
        """Write-all: store `ray.get(batch[0])[i]` under `keys[i]`; writes may finish later,
        but a key is visible (contains/get) only once its write is complete."""

    def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """Called with `.options(num_returns=2)`: metas (None for a miss) and the arrays
        (an empty array for a miss), as two objects so the caller can keep the second."""

    def contains(self, keys: list[CacheKey]) -> list[bool]:
        """Which keys are held (complete)."""

    def remove(self, keys: list[CacheKey]) -> int:
        """Drop keys; returns how many were held."""

    def keys(self) -> list[CacheKey]:
        """Every key held, for index rebuilds and controller resyncs."""

    def clear(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """entries, used_bytes, capacity_bytes, hits, misses, evictions, errors, policy."""

    def incarnation(self) -> str:
        """An id that changes when the actor restarts, so callers know to resync."""
