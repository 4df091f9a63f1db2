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

from typing import Any

# Every actor lives in the configured namespace (default "raykv") under these names.
# Node-scoped actors (one per node) append "-<node_id[:12]>" to the name.
DEFAULT_NAMESPACE = "raykv"
STORAGE_MANAGER_NAME = "raykv-storage-manager"
CPU_STORE_NAME = "raykv-cpu-store"
DISK_STORE_NAME = "raykv-disk-store"
REMOTE_STORE_NAME = "raykv-remote-store"
CONTROLLER_NAME = "raykv-controller"


def actor_name(base: str, node_id: str | None = None) -> str:
    """The name of a raykv actor: `base`, or `<base>-<node_id[:12]>` for a node-scoped
    one (one per node). The one place actor names are built."""
    return f"{base}-{node_id[:12]}" if node_id else base


# Restart policy of every raykv actor: restart forever, retry calls in flight.
ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": -1, "max_task_retries": -1}
