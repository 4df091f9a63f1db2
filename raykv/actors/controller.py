"""KVController: the optional cluster-wide registry "which instance holds which chunk".

Storage managers (one per node, `instance` = node id) report what their CPU and disk
tiers admitted and evicted. They never send a message per chunk on the hot path: a
`ControllerReporter` buffers the events and the manager flushes them as one bounded
batch on a short interval. The controller answers `best_instances(keys)`: the
instances holding the longest prefix of a request, for cache-aware routing and for
the peer tier (a manager fetches a chunk another node's CPU tier holds).

Consistency is best effort and self-healing:

* every batch carries a per-instance sequence number; a gap (a lost message) or an
  unknown instance (the controller restarted and lost its state) makes `report`
  answer "resync", and the manager sends a full snapshot of its indexes;
* managers also resync periodically, which corrects evictions a tier made on its own
  and any other drift; an empty batch doubles as a heartbeat, so a restarted
  controller is rebuilt from the managers within about a second.

A stale entry costs at most a failed peer fetch (a miss), never a wrong answer: the
data itself is always read from a tier, keyed by the chained prefix hash.

`ControllerState` and `ControllerReporter` are plain classes (unit-tested without Ray);
`KVController` is a thin actor around one `ControllerState`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from raykv.actors.base import CONTROLLER_NAME
from raykv.actors.common import actor_options, named_actor
from raykv.keys import CacheKey
from raykv.wire import TIER_CPU, TIER_DISK, PackedKeys, unpack_keys

logger = logging.getLogger(__name__)

# Tiers a controller tracks per instance (the remote tier is shared by everyone).
TRACKED_TIERS = (TIER_CPU, TIER_DISK)
# A reporter flushes its batch this often (seconds) and when it holds this many events.
FLUSH_INTERVAL_SECS = 0.1
MAX_BATCH_EVENTS = 4096
# Beyond this many buffered events the reporter drops them and resyncs instead.
MAX_PENDING_EVENTS = 65536
# Full resync of every manager this often, whatever happened.
RESYNC_PERIOD_SECS = 30.0
# An instance that sent nothing (not even a heartbeat, one a second) for this long is gone
# (its node scaled away, its manager dead for good): its chunks are forgotten.
SILENT_FORGET_SECS = 3 * RESYNC_PERIOD_SECS

Location = tuple[str, str]  # (instance, tier)


class ControllerState:
    """chunk key -> set of (instance, tier), plus per-instance holdings for resyncs."""

    def __init__(
        self,
        silent_secs: float = SILENT_FORGET_SECS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._where: dict[CacheKey, set[Location]] = {}
        self._held: dict[str, dict[str, set[CacheKey]]] = {}
        self._seq: dict[str, int] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, float] = {}  # instance -> when it last reported or resynced
        self._silent_secs = silent_secs
        self._clock = clock
        self._swept_at = clock()
        self.incarnation = uuid.uuid4().hex

    def _heard(self, instance: str) -> None:
        """`instance` reported: note it, and forget the instances silent for too long
        (checked at most once a second: one pass over the instances)."""
        now = self._clock()
        self._seen[instance] = now
        if now - self._swept_at < 1.0:
            return
        self._swept_at = now
        for other, seen in list(self._seen.items()):
            if now - seen > self._silent_secs:
                logger.info("controller: %s silent for %.0f s, forgetting it", other, now - seen)
                self.forget(other)

    # ----- updates -----

    def _add(self, instance: str, tier: str, keys: Iterable[CacheKey]) -> None:
        held = self._held.setdefault(instance, {}).setdefault(tier, set())
        loc = (instance, tier)
        for key in keys:
            held.add(key)
            self._where.setdefault(key, set()).add(loc)

    def _remove(self, instance: str, tier: str, keys: Iterable[CacheKey]) -> None:
        held = self._held.get(instance, {}).get(tier)
        if held is None:
            return
        loc = (instance, tier)
        for key in keys:
            held.discard(key)
            locs = self._where.get(key)
            if locs is not None:
                locs.discard(loc)
                if not locs:
                    del self._where[key]

    def report(
        self,
        instance: str,
        seq: int,
        admitted: dict[str, list[CacheKey]],
        evicted: dict[str, list[CacheKey]],
    ) -> bool:
        """Apply one batch (evictions first, then admissions); True = please resync.

        A resync is asked for when the instance is unknown (new, or this controller
        restarted) or when `seq` does not follow the last one (a batch was lost).
        """
        self._heard(instance)
        last = self._seq.get(instance)
        self._seq[instance] = seq
        for tier, keys in evicted.items():
            self._remove(instance, tier, keys)
        for tier, keys in admitted.items():
            self._add(instance, tier, keys)
        return last is None or seq != last + 1

    def resync(
        self,
        instance: str,
        seq: int,
        snapshot: dict[str, list[CacheKey] | PackedKeys | bytes],
        info: dict[str, Any] | None = None,
    ) -> None:
        """Replace everything known about `instance` with its full snapshot at `seq`
        (per tier: keys, `PackedKeys` or their wire bytes). Only the difference from what
        was known is applied: a periodic resync of a node whose tiers hold 100k chunks
        touches the few that changed, not every one twice."""
        self._heard(instance)
        self._seq[instance] = seq
        self._info[instance] = dict(info or {})
        held = self._held.setdefault(instance, {})
        for tier in [t for t in held if t not in snapshot]:
            self._remove(instance, tier, list(held[tier]))  # (finds the tier's set in held)
            del held[tier]
        for tier, keys in snapshot.items():
            old = held.get(tier, set())
            if isinstance(keys, bytes | bytearray | memoryview):
                keys = unpack_keys(keys)
            if isinstance(keys, PackedKeys):  # compared by hash: only new keys are built
                model, world, worker, dtype = keys.identity
                hashes, gone = set(keys.hashes), []
                for k in old:  # tuple fields by index: this runs for every key held
                    if k[3] in hashes and k[0] == model and k[1] == world and k[2] == worker:
                        if k[4] == dtype:
                            hashes.discard(k[3])  # held already
                            continue
                    gone.append(k)
                added: Iterable[CacheKey] = CacheKey.many(keys.identity, list(hashes))
            else:
                new = set(keys)
                gone, added = list(old - new), new - old
            self._remove(instance, tier, gone)
            self._add(instance, tier, added)

    def drop(self, instance: str, tier: str, keys: Iterable[CacheKey]) -> None:
        """`instance` was found not to hold `keys` in `tier` (a stale listing): unlist
        them there (the rest of what it holds stays listed)."""
        self._remove(instance, tier, keys)

    def forget(self, instance: str) -> None:
        """Drop an instance (it died, or is about to resync)."""
        for tier, keys in list(self._held.get(instance, {}).items()):
            self._remove(instance, tier, list(keys))
        self._held.pop(instance, None)
        self._seq.pop(instance, None)
        self._info.pop(instance, None)
        self._seen.pop(instance, None)

    # ----- queries -----

    def best_instances(
        self,
        keys: Sequence[CacheKey],
        ends: Sequence[int] | None = None,
        tiers: Sequence[str] = TRACKED_TIERS,
        exclude: Iterable[str] = (),
    ) -> list[tuple[str, int]]:
        """[(instance, prefix)] of every instance holding a prefix of `keys`, longest first.

        `prefix` is in tokens when `ends` (each chunk's end token) is given, else in
        chunks. A chunk counts when the instance holds it in any of `tiers`; ties are
        broken by instance id so answers are deterministic.
        """
        wanted, skip = set(tiers), set(exclude)
        alive: set[str] | None = None
        depth: dict[str, int] = {}
        for i, key in enumerate(keys):
            here = {inst for inst, tier in self._where.get(key, ()) if tier in wanted}
            here -= skip
            alive = here if alive is None else alive & here
            if not alive:
                break
            for inst in alive:
                depth[inst] = i + 1
        out = [(inst, ends[n - 1] if ends is not None else n) for inst, n in depth.items()]
        out.sort(key=lambda item: (-item[1], item[0]))
        return out

    def info(self, instance: str) -> dict[str, Any]:
        """What the instance told about itself at its last resync (manager name, node)."""
        return dict(self._info.get(instance, {}))

    def instances(self) -> list[str]:
        return sorted(set(self._held) | set(self._info))

    def stats(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "keys": len(self._where),
            "instances": {
                inst: {tier: len(keys) for tier, keys in tiers.items()}
                for inst, tiers in self._held.items()
            },
        }


@dataclass(slots=True)
class Batch:
    """One report to the controller: sequence number and events per tier."""

    seq: int
    admitted: dict[str, list[CacheKey]] = field(default_factory=dict)
    evicted: dict[str, list[CacheKey]] = field(default_factory=dict)


class ControllerReporter:
    """The manager's side: buffers admit/evict events and hands out bounded batches.

    Recording an event is a list append. If more than `max_pending` events pile up
    (controller down for a long time), they are dropped and `needs_resync` is set:
    a snapshot replaces them.
    """

    def __init__(
        self,
        instance: str,
        max_batch: int = MAX_BATCH_EVENTS,
        max_pending: int = MAX_PENDING_EVENTS,
    ) -> None:
        self.instance = instance
        self.seq = 0
        self.needs_resync = True  # the controller has never heard of us
        self._max_batch, self._max_pending = max_batch, max_pending
        self._events: list[tuple[bool, str, CacheKey]] = []  # (admitted?, tier, key)

    def _record(self, admitted: bool, tier: str, keys: Iterable[CacheKey]) -> None:
        if self.needs_resync:
            return  # the next snapshot covers it
        self._events.extend((admitted, tier, k) for k in keys)
        if len(self._events) > self._max_pending:
            self._events.clear()
            self.needs_resync = True

    def admitted(self, tier: str, keys: Iterable[CacheKey]) -> None:
        self._record(True, tier, keys)

    def evicted(self, tier: str, keys: Iterable[CacheKey]) -> None:
        self._record(False, tier, keys)

    @property
    def pending(self) -> int:
        return len(self._events)

    def full(self) -> bool:
        """Enough events for a batch: flush now rather than at the next interval."""
        return len(self._events) >= self._max_batch

    def take(self) -> Batch:
        """The next batch (at most `max_batch` events; empty = heartbeat), in event order."""
        events, self._events = self._events[: self._max_batch], self._events[self._max_batch :]
        self.seq += 1
        batch = Batch(self.seq)
        # One entry per (tier, key): its last event wins, so a key evicted and re-admitted
        # within one batch ends up admitted (the controller applies evictions first).
        last: dict[tuple[str, CacheKey], bool] = {}
        for admitted, tier, key in events:
            last.pop((tier, key), None)
            last[(tier, key)] = admitted
        for (tier, key), admitted in last.items():
            (batch.admitted if admitted else batch.evicted).setdefault(tier, []).append(key)
        return batch

    def start_resync(self) -> int:
        """Drop buffered events (the snapshot supersedes them); the snapshot's seq."""
        self._events.clear()
        self.needs_resync = False
        self.seq += 1
        return self.seq

    def lost(self, tier: str | None = None) -> None:
        """A batch may not have arrived (call failed), or `tier`'s index was rebuilt:
        resync next time."""
        self.needs_resync = True


@ray.remote(num_cpus=0)
class KVController:
    """Thin actor around one `ControllerState` (a sync actor: calls apply in order)."""

    def __init__(self) -> None:
        self._state = ControllerState()

    def report(
        self,
        instance: str,
        seq: int,
        admitted: dict[str, list[CacheKey]],
        evicted: dict[str, list[CacheKey]],
    ) -> bool:
        return self._state.report(instance, seq, admitted, evicted)

    def resync(
        self,
        instance: str,
        seq: int,
        snapshot: dict[str, list[CacheKey]],
        info: dict[str, Any] | None = None,
    ) -> None:
        self._state.resync(instance, seq, snapshot, info)

    def forget(self, instance: str) -> None:
        self._state.forget(instance)

    def drop(self, instance: str, tier: str, keys: list[CacheKey]) -> None:
        self._state.drop(instance, tier, keys)

    def best_instances(
        self,
        keys: list[CacheKey],
        ends: list[int] | None = None,
        tiers: Sequence[str] = TRACKED_TIERS,
        exclude: Sequence[str] = (),
    ) -> list[tuple[str, int]]:
        return self._state.best_instances(keys, ends, tiers, exclude)

    def locate(
        self, keys: list[CacheKey], exclude: Sequence[str] = (), tiers: Sequence[str] = (TIER_CPU,)
    ) -> tuple[str, str, int] | None:
        """The best peer for `keys` in `tiers`: (instance, manager name, prefix chunks)."""
        for instance, n in self._state.best_instances(keys, None, tiers, exclude):
            name = self._state.info(instance).get("manager")
            if name:
                return instance, name, n
        return None

    def info(self, instance: str) -> dict[str, Any]:
        return self._state.info(instance)

    def instances(self) -> list[str]:
        return self._state.instances()

    def stats(self) -> dict[str, Any]:
        return self._state.stats()

    def incarnation(self) -> str:
        return self._state.incarnation


def get_or_create_controller(namespace: str) -> Any:
    """The cluster's `KVController` in `namespace` (detached, restarted forever)."""
    return named_actor(KVController, actor_options(CONTROLLER_NAME, namespace, near_caller=False))


def wait_listed(
    namespace: str, keys: Sequence[CacheKey], instance: str, timeout_s: float = 30.0
) -> bool:
    """Block until the controller of `namespace` lists `instance` for all of `keys`
    (True) or `timeout_s` passes (False; also when there is no controller). Reports
    are batched, so a chunk stored a moment ago becomes routable ~FLUSH_INTERVAL_SECS
    later; tests and benchmarks wait here."""
    deadline = time.monotonic() + timeout_s
    keys = list(keys)
    while True:
        left = deadline - time.monotonic()
        try:
            controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
            found = ray.get(controller.best_instances.remote(keys), timeout=max(0.1, left))
            if (instance, len(keys)) in found:
                return True
        except (ValueError, ray.exceptions.RayError):  # not there yet, or restarting
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


__all__ = [
    "Batch",
    "ControllerReporter",
    "ControllerState",
    "KVController",
    "get_or_create_controller",
    "wait_listed",
]
