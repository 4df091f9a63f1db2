"""The manager's link to the cluster's KVController: the peer tier and the event reports.

With `enable_controller`, every node's StorageManager reports what enters and leaves its
CPU and disk tiers (batched admit/evict events, a snapshot when a batch was lost or the
controller restarted), and asks the controller which peer's CPU tier holds a prefix its
own tiers miss; the peer then serves it through its manager's `peer_read` (its batch
objects as they are): this node's manager fetches each object once (`read_peer`), serves
the request from them, and has its CPU store copy what it keeps afterwards. While it
asks the controller, it already asks the peer the last answer named (a hint, as a
client of a sharded store remembers the last owner): when the controller names the
same peer, its answer is in by then, so a peer hit costs one round trip less.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayTaskError

from raykv.actors.common import check_actor_class
from raykv.actors.controller import (
    FLUSH_INTERVAL_SECS,
    RESYNC_PERIOD_SECS,
    ControllerReporter,
    get_or_create_controller,
)
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.breaker import Breaker
from raykv.tiers.cpu import payload_problems
from raykv.wire import TIER_CPU, ChunkRef, CPUAck, PackedKeys, PeerTier

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_SECS = 10.0  # bound on a call to a controller that may be restarting
HEARTBEAT_SECS = 1.0  # a report (maybe empty) goes out at least this often
# A controller killed for good is looked up (re-created) again after this back-off,
# doubling up to the maximum while it fails.
RECONNECT_MIN_SECS, RECONNECT_MAX_SECS = 1.0, 30.0
# A peer's handle not named by a locate for this long is dropped when a new one is added
# (nodes come and go over days of autoscaling).
PEER_IDLE_SECS = 600.0


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
        self._used: dict[str, float] = {}  # manager name -> when a locate last named it
        self._info = {"manager": manager, "node_id": node_id}
        self._timeout = locate_timeout_s
        self._controller = get_or_create_controller(namespace)
        # A controller that fails or times out costs one lookup a wait, not every lookup.
        self._breaker = Breaker(f"the raykv controller in {namespace!r}")
        self._reconnect_s = RECONNECT_MIN_SECS
        self._packed = True  # snapshots as PackedKeys (False: a controller of an older raykv)
        self._last: str | None = None  # the peer the last locate named

    async def locate(self, keys: list[CacheKey]) -> tuple[PeerTier, int] | None:
        """(the peer, chunks) of the peer holding the longest prefix of `keys` in
        its CPU tier, per the controller; None if none (or the controller is away: then
        the lookups behind the first one miss at once, until a trial call answers)."""
        trial = self._breaker.admit()
        if trial is None:
            return None
        try:
            found = await asyncio.wait_for(
                self._controller.locate.remote(keys, [self.instance]), self._timeout
            )
        except asyncio.CancelledError:
            self._breaker.cancel(trial)
            raise
        except Exception as exc:
            if self._breaker.settle(trial, exc):
                logger.warning("the raykv controller failed (%r); peers skipped a while", exc)
            return None
        if self._breaker.settle(trial):
            logger.info("the raykv controller answers again")
        if not found:
            return None
        instance, name, n = found
        now = time.monotonic()
        if name not in self.peers:
            self._prune(now)
            try:  # off the loop: the GCS answers
                self.peers[name] = await asyncio.to_thread(self._peer_handle, name)
            except ValueError:  # gone (or not a raykv manager: ConfigError is a ValueError)
                self._controller.forget.remote(instance)  # that manager is gone
                return None
            except Exception as exc:  # the GCS away: this lookup misses the peer
                logger.debug("peer manager %s unavailable: %r", name, exc)
                return None
        self._instances[name] = instance
        self._used[name] = now
        self._last = name
        return PeerTier(name), n

    @property
    def timeout(self) -> float:
        """Seconds a locate may take (then it is a miss)."""
        return self._timeout

    def hint(self) -> str | None:
        """The peer the last locate named, while we hold its handle: the next lookup asks
        it for the chunks while it asks the controller (`TierSet.locate_peer`)."""
        name = self._last
        return name if name in self.peers else None

    def unhint(self, name: str) -> None:
        """`name` held none of a lookup that no peer could serve, or failed to answer:
        stop asking it ahead (until a locate names a peer again), so that misses cost
        one call, not two."""
        if self._last == name:
            self._last = None

    def _prune(self, now: float) -> None:
        for name, used in list(self._used.items()):
            if now - used > PEER_IDLE_SECS:
                self._drop_peer(name)

    def _drop_peer(self, name: str) -> str | None:
        """Forget our handle of the peer `name`; its instance, if we knew it."""
        self.peers.pop(name, None)
        self._used.pop(name, None)
        if self._last == name:
            self._last = None
        return self._instances.pop(name, None)

    def _peer_handle(self, name: str) -> Any:
        from raykv.actors.storage_manager import StorageManager

        peer = ray.get_actor(name, namespace=self.namespace)
        return check_actor_class(peer, StorageManager, name, self.namespace)

    def lost(self, name: str) -> None:
        """The peer `name` is dead: drop our handle and let the controller forget it
        (a peer that comes back is rebuilt from its next heartbeat's resync)."""
        instance = self._drop_peer(name)
        if instance is not None:
            self._controller.forget.remote(instance)

    def stale(self, name: str, keys: list[CacheKey]) -> None:
        """The live peer `name` did not hold `keys`, which the controller listed (it
        evicted them since its last report): the controller drops those listings only."""
        instance = self._instances.get(name)
        if instance is not None and keys:
            try:
                self._controller.drop.remote(instance, TIER_CPU, keys)
            except AttributeError:  # a controller of an older raykv (no `drop`): its resync
                logger.debug("the raykv controller cannot drop listings; left to its resync")

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
                    # Packed: a list of 300k CacheKeys took 0.4 s to pickle on the loop,
                    # their hashes 0.07 s (and the controller builds only the new keys).
                    snap: dict[str, Any] = snapshot()
                    if self._packed:
                        snap = {tier: PackedKeys.of(keys) for tier, keys in snap.items()}
                    ref = self._controller.resync.remote(self.instance, seq, snap, self._info)
                    await asyncio.wait_for(ref, CONTROL_TIMEOUT_SECS)
                    last_full = last_sent = now
                    self._reconnect_s = RECONNECT_MIN_SECS
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
                self._reconnect_s = RECONNECT_MIN_SECS
            except ActorDiedError as exc:  # killed for good: a restart would not say so
                rep.lost()
                await self._reconnect(exc)
            except RayTaskError as exc:  # it raised: maybe an older raykv's, unable to read
                if self._packed:  # packed keys; plain lists from now on
                    logger.info("the raykv controller refused a packed resync (%s)", exc)
                    self._packed = False
                rep.lost()
            except Exception as exc:
                logger.debug("controller report failed (%s); will resync", exc)
                rep.lost()

    async def _reconnect(self, exc: BaseException) -> None:
        """Find (or create) the controller again after a back-off: one that died for
        good left every call failing at once, and this loop resyncing in a hot loop."""
        logger.warning(
            "the raykv controller died (%r); looking it up again in %.0f s", exc, self._reconnect_s
        )
        await asyncio.sleep(self._reconnect_s)
        self._reconnect_s = min(RECONNECT_MAX_SECS, 2 * self._reconnect_s)
        try:  # off the loop: the GCS answers
            self._controller = await asyncio.to_thread(get_or_create_controller, self.namespace)
        except Exception as err:
            logger.debug("the raykv controller cannot be created yet: %r", err)


# `peer_read`'s answer: (metas, objects, places); chunk i is `objects[o][j]` for
# `places[i] == (o, j)`, and its meta None where the peer does not hold it.
PeerReply = tuple[list[PayloadMeta | None], list[ray.ObjectRef], list[tuple[int, int] | None]]


def plan_reply(chunks: list[ChunkRef | None]) -> tuple[PeerReply, list[int]]:
    """A peer's answer from the CPU tier's `chunks` (None: not held), and the positions
    of the chunks still to gather into one new object (`add_gathered`).

    A batch object goes as it is (a ref: nothing is copied, the reader fetches it once)
    when the chunks wanted from it are at least half its bytes; the chunks of other
    batches are gathered, so a reader never fetches much more than it asked for."""
    wanted: dict[ray.ObjectRef, int] = {}
    size: dict[ray.ObjectRef, int] = {}
    for c in chunks:
        if c is not None:
            wanted[c.ref] = wanted.get(c.ref, 0) + c.meta.nbytes
            size[c.ref] = c.batch_nbytes
    whole = {r: i for i, r in enumerate(r for r in wanted if 2 * wanted[r] >= size[r] > 0)}
    places: list[tuple[int, int] | None] = [
        (whole[c.ref], c.index) if c is not None and c.ref in whole else None for c in chunks
    ]
    rest = [i for i, c in enumerate(chunks) if c is not None and c.ref not in whole]
    metas = [c.meta if c is not None else None for c in chunks]
    return (metas, list(whole), places), rest


def add_gathered(reply: PeerReply, rest: list[int], gathered: ray.ObjectRef | None) -> None:
    """Place the chunks at `rest` in `gathered` (one object, in order), or drop them
    (None: they could not be gathered)."""
    metas, objects, places = reply
    if gathered is None:
        for i in rest:
            metas[i] = None
        return
    objects.append(gathered)
    for j, i in enumerate(rest):
        places[i] = (len(objects) - 1, j)


async def ask_peer(peer: Any, keys: list[CacheKey]) -> PeerReply:
    """A peer manager's `peer_read` of `keys` (its objects not fetched yet); a malformed
    reply raises."""
    metas, objects, places = await peer.peer_read.remote(keys)
    if not len(metas) == len(places) == len(keys):
        got = f"{len(metas)} metas, {len(places)} places"
        raise ValueError(f"the peer sent {got} for {len(keys)} keys")
    return metas, objects, places


def held(reply: PeerReply) -> int:
    """How many leading keys a peer's answer lists."""
    metas, _objects, places = reply
    n = 0
    for meta, place in zip(metas, places, strict=True):
        if meta is None or place is None:
            break
        n += 1
    return n


def trim(reply: PeerReply, n: int) -> PeerReply:
    """A peer's answer for its first `n` keys alone, with only the objects they name."""
    metas, objects, places = reply
    keep: dict[int, int] = {}
    out: list[tuple[int, int] | None] = []
    for place in places[:n]:
        try:
            o, j = place  # type: ignore[misc]
            ok = 0 <= o < len(objects)
        except (TypeError, ValueError):  # None, or a malformed place: that chunk a miss
            ok = False
        if not ok:
            out.append(None)
            continue
        out.append((keep.setdefault(o, len(keep)), j))
    return metas[:n], [objects[o] for o in keep], out


async def read_peer(peer: Any, keys: list[CacheKey]) -> tuple[CPUAck, list[PayloadMeta]]:
    """A peer manager's `peer_read` of `keys`, fetched to this node (`fetch_reply`)."""
    return await fetch_reply(await ask_peer(peer, keys), keys)


async def fetch_reply(reply: PeerReply, keys: list[CacheKey]) -> tuple[CPUAck, list[PayloadMeta]]:
    """A peer's answer for `keys`, fetched to this node: an ack serving each chunk from
    the peer's object (`refs`; the others `missing`), and the metas of the served ones
    in order. Each object is fetched once, concurrently; the chunks of one that cannot
    be read, or whose array is not its meta's size, are misses."""
    metas, objects, places = reply
    values = await asyncio.gather(*objects, return_exceptions=True) if objects else []
    failed = {i for i, v in enumerate(values) if isinstance(v, BaseException)}
    if failed:
        logger.warning("%d of %d objects from a peer could not be read", len(failed), len(values))
    listed = [
        i
        for i, (meta, place) in enumerate(zip(metas, places, strict=True))
        if meta is not None and place is not None and place[0] not in failed
    ]
    arrays = [_pick(values, place) for place in places]
    bad = payload_problems(metas, arrays, listed)
    if bad:
        first = next(iter(bad.values()))
        logger.warning("a peer sent %d unreadable chunks (%s): misses", len(bad), first)
    del values, arrays  # the bytes stay on this node, in the objects the refs name
    ack = CPUAck("")
    served: list[PayloadMeta] = []
    ok = set(listed).difference(bad)
    for i, key in enumerate(keys):
        if i not in ok:
            ack.missing.append(key)
            continue
        ack.refs[key] = ChunkRef(objects[places[i][0]], places[i][1], metas[i])
        served.append(metas[i])
    return ack, served


def _pick(values: list[Any], place: tuple[int, int] | None) -> Any:
    """`values[o][j]` for `place` (o, j); None where there is no such array."""
    try:
        return values[place[0]][place[1]] if place is not None else None
    except Exception:  # a malformed place: that chunk is a miss
        return None


__all__ = [
    "ControllerLink",
    "PeerReply",
    "add_gathered",
    "ask_peer",
    "fetch_reply",
    "held",
    "plan_reply",
    "read_peer",
    "trim",
]
