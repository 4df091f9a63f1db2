"""Helpers shared by the tier actors (they need Ray): put batch resolution, a short hold
for handed-out refs, and node-scoped actor names and factories."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.actors.base import ACTOR_OPTIONS, actor_name
from raykv.errors import ConfigError
from raykv.wire import join_parts, split_batch

logger = logging.getLogger(__name__)

# A background loop that raised starts again after this long.
LOOP_RESTART_SECS = 1.0

# Ray keeps task returns up to this size in the owner's process heap (its
# `max_direct_call_object_size`, 100 KiB by default), not in the object store.
INLINE_OBJECT_BYTES = 100 * 1024
# How long a handed-out small ref is held: up to HANDOUT_HOLD_SECS while the held bytes fit
# in HANDOUT_HOLD_BYTES, never less than HANDOUT_MIN_HOLD_SECS. Measured on an idle 2-core
# box: 20 ms already stops the leak, 0 does not.
HANDOUT_HOLD_SECS = 2.0
HANDOUT_MIN_HOLD_SECS = 0.25
HANDOUT_HOLD_BYTES = 1 << 20
# Puts larger than this run in a thread, so the actor's event loop keeps serving.
THREAD_PUT_BYTES = 8 << 20


async def put_own(value: Any, nbytes: int) -> ray.ObjectRef:
    """`ray.put(value)` in this process (which then owns the object); a big put runs in a
    thread so the event loop keeps serving meanwhile."""
    if nbytes >= THREAD_PUT_BYTES:
        return await asyncio.to_thread(ray.put, value)
    return ray.put(value)


class HandoutHold:
    """Keeps refs this process owns but no longer needs alive for a moment more.

    An actor that returns, nested in its reply, a ref to a *small* object it owns (one
    Ray keeps inline, in this process's heap) and drops its own reference at once leaks
    that object's bytes in Ray 2.60: the owner's copy is never freed (measured: +32 KiB
    per call, forever; big objects, and refs the owner holds until the caller has
    registered as a borrower, are fine). So such refs are held a while after the reply:
    `hold_secs`, or only `min_secs` once more than `max_bytes` are held. The held objects
    sit in the object store meanwhile (Ray promotes a handed-out inline object), so the
    cap bounds what the hold costs there: `max_bytes` + what arrives within `min_secs`.
    """

    def __init__(
        self,
        hold_secs: float = HANDOUT_HOLD_SECS,
        min_secs: float = HANDOUT_MIN_HOLD_SECS,
        max_bytes: int = HANDOUT_HOLD_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hold_secs = hold_secs
        self._min_secs = min(min_secs, hold_secs)
        self._max_bytes = max_bytes
        self._clock = clock
        self._held: deque[tuple[float, int, Any]] = deque()  # (held since, nbytes, ref)
        self.nbytes = 0

    def hold(self, ref: Any, nbytes: int) -> None:
        """Hold `ref` (a handed-out object of `nbytes`) if Ray keeps it inline."""
        now = self._clock()
        if nbytes <= INLINE_OBJECT_BYTES:
            self._held.append((now, nbytes, ref))
            self.nbytes += nbytes
        self._release(now)

    def _release(self, now: float) -> None:
        while self._held:
            since, nbytes, _ = self._held[0]
            age = now - since
            if age < self._min_secs or (age < self._hold_secs and self.nbytes <= self._max_bytes):
                break
            self._held.popleft()
            self.nbytes -= nbytes

    def __len__(self) -> int:
        return len(self._held)


def resolve_batch(batch: Any) -> list[np.ndarray]:
    """The arrays of a put's batch (see `raykv.wire.split_batch`); zero-copy on one node."""
    refs, arrays = split_batch(batch, ray.ObjectRef)
    return join_parts(ray.get(refs)) if refs else arrays


def actor_options(
    name: str,
    namespace: str,
    node_id: str | None = None,
    *,
    near_caller: bool = True,
    resources: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The options of every raykv actor: named, detached (it outlives its creator),
    restarted forever, 0 CPUs. Placement: a hard affinity to `node_id` if given, else
    (with `near_caller`) a soft one to the calling node, so tiers sit beside their first
    user; `resources` are custom resources only the wanted nodes offer."""
    options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "get_if_exists": True,
        "lifetime": "detached",
        "num_cpus": 0,
        **ACTOR_OPTIONS,
    }
    node = node_id
    if node is None and near_caller:
        try:
            node = ray.get_runtime_context().get_node_id()
        except Exception:  # not connected to Ray yet: no preference
            node = None
    if node is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=node_id is None)
    if resources:
        options["resources"] = dict(resources)
    return options


def check_actor_class(handle: Any, actor_cls: Any, name: str, namespace: str) -> Any:
    """`handle` if it is an actor of `actor_cls`, else a `ConfigError`.

    `get_if_exists` (and `ray.get_actor`) hand back whatever actor holds the name: a
    detached actor of another class, created first under a raykv name by any job of the
    cluster, would otherwise be used as the tier (it would see every lookup's keys and
    could serve any bytes). The check reads the handle's class descriptor: no call.
    """
    want = actor_cls.__ray_metadata__.actor_creation_function_descriptor
    got = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    if (getattr(got, "module_name", None), getattr(got, "class_name", None)) != (
        want.module_name,
        want.class_name,
    ):
        shown = f"{getattr(got, 'module_name', '?')}.{getattr(got, 'class_name', '?')}"
        raise ConfigError(
            f"the Ray actor named {name!r} in namespace {namespace!r} is a {shown}, not "
            f"raykv's {want.module_name}.{want.class_name}: another job holds the name. "
            "raykv refuses to use it; kill that actor or pick another namespace"
        )
    return handle


async def supervised(name: str, loop: Callable[[], Awaitable[None]]) -> None:
    """Run the background loop `loop()` for good: one that raises is logged and started
    again (a loop that died silently stopped health checks, resyncs or lease expiry)."""
    while True:
        try:
            await loop()
            return
        except Exception:
            logger.exception("raykv background loop %s failed; restarting it", name)
        await asyncio.sleep(LOOP_RESTART_SECS)


def named_actor(actor_cls: Any, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """The actor `options["name"]` (created with `options` and these arguments if
    missing), checked to be an `actor_cls` (see `check_actor_class`)."""
    handle = actor_cls.options(**options).remote(*args, **kwargs)
    return check_actor_class(handle, actor_cls, options["name"], options["namespace"])


def get_or_create_node_actor(
    actor_cls: Any,
    base_name: str,
    namespace: str,
    *args: Any,
    node_id: str | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """The node-scoped tier actor `<base_name>-<node_id[:12]>` of `node_id` (default: this
    node), created if missing and pinned to its node (see `actor_options`)."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    options = actor_options(name or actor_name(base_name, node_id), namespace, node_id)
    return named_actor(actor_cls, options, *args, **kwargs)


__all__ = [
    "HandoutHold",
    "actor_options",
    "check_actor_class",
    "get_or_create_node_actor",
    "named_actor",
    "resolve_batch",
    "supervised",
]
