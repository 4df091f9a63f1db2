"""The manager's link to the cluster's KVController: the peer tier and the event reports.

With `enable_controller`, every node's StorageManager reports what enters and leaves its
CPU and disk tiers (batched admit/evict events, a snapshot when a batch was lost or the
controller restarted), and asks the controller which peer's CPU tier holds a prefix its
own tiers miss; the peer then serves it through its manager's `peer_read` (its batch
objects as they are, fetched once by this node's CPU store, which copies what it keeps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from raykv.actors.common import check_actor_class
from raykv.actors.controller import (
    FLUSH_INTERVAL_SECS,
    RESYNC_PERIOD_SECS,
    ControllerReporter,
    get_or_create_controller,
)
from raykv.keys import CacheKey
from raykv.wire import PeerTier

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_SECS = 10.0  # bound on a call to a controller that may be restarting
HEARTBEAT_SECS = 1.0  # a report (maybe empty) goes out at least this often


class ControllerLink:
    """Peers found through the controller, and the report loop that keeps it current.

    `snapshot()` gives what this node's tiers hold (for a full resync of the controller).
    """

    def __init__(
        self,
        namespace: str,
        instance: str,
        manager: str,
        node_id: str | None,
        locate_timeout_s: float,
    ) -> None:
        self.namespace = namespace
        self.instance = instance
        self.reporter = ControllerReporter(instance)
        self.peers: dict[str, Any] = {}  # manager name -> handle
        self._instances: dict[str, str] = {}  # manager name -> instance
        self._info = {"manager": manager, "node_id": node_id}
        self._timeout = locate_timeout_s
        self._controller = get_or_create_controller(namespace)

    async def locate(self, keys: list[CacheKey]) -> tuple[PeerTier, int] | None:
        """(the peer, chunks) of the peer holding the longest prefix of `keys` in
        its CPU tier, per the controller; None if none (or the controller is away)."""
        try:
            found = await asyncio.wait_for(
                self._controller.locate.remote(keys, [self.instance]), self._timeout
            )
        except Exception as exc:
            logger.debug("controller locate failed: %s", exc)
            return None
        if not found:
            return None
        instance, name, n = found
        if name not in self.peers:
            try:
                from raykv.actors.storage_manager import StorageManager

                peer = ray.get_actor(name, namespace=self.namespace)
                self.peers[name] = check_actor_class(peer, StorageManager, name, self.namespace)
            except ValueError:  # gone (or not a raykv manager: ConfigError is a ValueError)
                self._controller.forget.remote(instance)  # that manager is gone
                return None
        self._instances[name] = instance
        return PeerTier(name), n

    def lost(self, name: str) -> None:
        """A peer served none of what the controller listed (dead, or the listing was
        stale): drop our handle and let the controller forget it; a live peer is rebuilt
        from its next heartbeat, which then asks for a resync."""
        self.peers.pop(name, None)
        instance = self._instances.pop(name, None)
        if instance is not None:
            self._controller.forget.remote(instance)

    async def report_loop(self, snapshot: Callable[[], dict[str, list[CacheKey]]]) -> None:
        """Flush admit/evict batches to the controller; resync when it asks (lost batch,
        controller restart), periodically, or when our own index was rebuilt."""
        rep = self.reporter
        last_full = last_sent = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_SECS)
            now = time.monotonic()
            try:
                if rep.needs_resync or now - last_full >= RESYNC_PERIOD_SECS:
                    seq = rep.start_resync()
                    ref = self._controller.resync.remote(self.instance, seq, snapshot(), self._info)
                    await asyncio.wait_for(ref, CONTROL_TIMEOUT_SECS)
                    last_full = last_sent = now
                    continue
                if not rep.pending and now - last_sent < HEARTBEAT_SECS:
                    continue
                while True:
                    batch = rep.take()
                    ref = self._controller.report.remote(
                        self.instance, batch.seq, batch.admitted, batch.evicted
                    )
                    if await asyncio.wait_for(ref, CONTROL_TIMEOUT_SECS):
                        rep.lost()
                        break
                    if not rep.full():
                        break
                last_sent = now
            except Exception as exc:
                logger.debug("controller report failed (%s); will resync", exc)
                rep.lost()


__all__ = ["ControllerLink"]
