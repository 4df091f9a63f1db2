"""The manager's tiers: their actor handles, their health, and the index of what they hold.

`TierSet` is the half of the `StorageManager` that talks to the tier actors: it re-creates
a tier whose actor died for good (the other tiers serve meanwhile), resyncs an index
whose tier restarted or whose CPU acks went missing, promotes lower-tier chunks into CPU
(`pull`), and runs the bounded background writes to the lower tiers. What it learns goes
into one `PrefixIndex`; the manager answers requests from that index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.exceptions import ActorDiedError, RayActorError

from raykv import metrics
from raykv.actors.common import HandoutHold
from raykv.actors.factory import create_tier, get_or_create_tiers
from raykv.actors.kv_server import open_remote
from raykv.actors.peers import (
    ControllerLink,
    PeerReply,
    ask_peer,
    fetch_reply,
    held,
    read_peer,
    trim,
)
from raykv.config import RayKVConfig
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.cpulog import CPULog, Reporters
from raykv.tiers.index import PrefixIndex
from raykv.tiers.remote import RemoteStore
from raykv.wire import (
    TIER_CPU,
    TIER_DISK,
    TIER_PEER,
    TIER_REMOTE,
    ChunkRef,
    CPUAck,
    PeerTier,
    PutAck,
)

logger = logging.getLogger(__name__)

RESYNC_INTERVAL_SECS = 1.0  # how often every tier is asked for its incarnation
CONTROL_TIMEOUT_SECS = 10.0  # bound on control calls to a tier that may be restarting
# A lookup's remote probe gets this share of `lookup_timeout_ms`, so on a slow remote the
# manager answers first with the CPU/disk part of the prefix.
REMOTE_PROBE_SHARE = 0.5
# A pull (promotion into CPU, or a direct read without a CPU tier) is a miss after this
# many lookup timeouts (the client gives a get four).
PULL_TIMEOUT_FACTOR = 2.0
# Ends of requests (pin drops and hit touches) are sent to the CPU store in one call per
# this window instead of one call per `get`: under load that call cost the manager and
# the store as much CPU as the `get` itself. Any other call on the CPU handle flushes
# them first, so the store still sees them in request order.
RELEASE_BATCH_SECS = 0.02
# A peer's answer asked ahead of the controller's (`locate_peer`) is dropped after this
# long if no pull took it (its refs keep the peer's objects alive meanwhile).
ASKED_KEEP_SECS = 2.0
# An answer asked ahead and kept: (when, the keys asked, the peer's answer).
Asked = tuple[float, list[CacheKey], PeerReply]


class TierSet:
    """Handles of the enabled tiers (`handles`), their `PrefixIndex`, and the calls that
    keep the index true. Runs on the manager's event loop."""

    def __init__(
        self, config: RayKVConfig, node_id: str | None, link: ControllerLink | None
    ) -> None:
        self._config = config
        self._node_id = node_id
        self.link = link
        self.handles = get_or_create_tiers(config, node_id)
        self.cpu_log = CPULog()  # for readers that poll (the vLLM connector's KV events)
        self.index = PrefixIndex(
            list(self.handles),
            lease_secs=config.pin_lease_secs,
            remote_index_max_keys=config.remote_index_max_keys,
            reporter=Reporters(link.reporter if link is not None else None, self.cpu_log),
        )
        if link is not None:
            self.index.enable_peers()
        self._max_writes = config.max_lower_writes_in_flight
        self._writes_in_flight = dict.fromkeys(self.index.lower_tiers, 0)
        self._skip_warned_at = 0.0
        self._background: set[asyncio.Task] = set()
        self.loops_spawned = False  # the manager's background loops (once per process)
        self._recreating: set[str] = set()  # tiers whose dead actor is being re-created
        self._resyncing: dict[str, asyncio.Task] = {}
        self._pull_timeout = config.lookup_timeout_ms / 1000 * PULL_TIMEOUT_FACTOR
        self._backend = (config.remote_url or "").partition("://")[0] or "none"
        self._hold = HandoutHold()
        self._releases: list[tuple[str | None, list[CacheKey]]] = []
        self._release_timer: asyncio.Handle | None = None
        self._loop = asyncio.get_running_loop()  # built on the manager's loop
        self._probe: RemoteStore | None = None  # the remote server, asked by lookups directly
        self._probe_opening: asyncio.Task | None = None  # `open_remote` running off the loop
        # Peers' answers asked ahead of the controller's (`locate_peer`), until their pull:
        # (peer, first key) -> (when, the keys asked, the answer).
        self._asked: dict[tuple[str, CacheKey], Asked] = {}
        self._asked_timer: asyncio.TimerHandle | None = None

    @property
    def peers(self) -> dict[str, Any]:
        return self.link.peers if self.link is not None else {}

    def pending_writes(self) -> list[asyncio.Task]:
        return [t for t in self._background if t.get_name().startswith("raykv-put")]

    @property
    def cpu(self) -> Any:
        """The CPU tier's handle while it is up (None without one, or while re-created).

        Sends the queued request ends first: Ray runs one caller's calls to an actor in
        order, so whatever is called on the handle next comes after them.
        """
        if self._releases:
            self.flush_releases()
        return self.handles.get(TIER_CPU) if self.index.up(TIER_CPU) else None

    def queue_release(self, lookup_id: str | None, touched: list[CacheKey]) -> None:
        """End of a request on the CPU store (drop `lookup_id`'s pins, touch its hits),
        sent with the others of the next `RELEASE_BATCH_SECS` in one call. Callable from
        a Ray thread holding the manager's lock (`ManagerCore.try_get`)."""
        self._releases.append((lookup_id, touched))
        if self._release_timer is None:
            self._release_timer = self._loop.call_soon_threadsafe(self._arm_release)

    def _arm_release(self) -> None:
        self._release_timer = self._loop.call_later(RELEASE_BATCH_SECS, self.flush_releases)

    def flush_releases(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        batch, self._releases = self._releases, []
        handle = self.handles.get(TIER_CPU) if self.index.up(TIER_CPU) else None
        if batch and handle is not None:  # a store that is down has dropped its pins
            handle.release.remote(batch)

    def spawn(self, coro: Any, name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def drop_probe(self) -> None:
        """Forget the remote probe (the next lookup makes a new one) and close its client
        once the calls it may still have in flight are over: a dropped Redis client
        would otherwise keep its connections and sockets for the manager's life."""
        probe, self._probe = self._probe, None
        if probe is not None:
            self.spawn(self._close_later(probe), name="raykv-close-probe")

    @staticmethod
    async def _close_later(probe: RemoteStore) -> None:
        await asyncio.sleep(probe.timeout_s)
        try:
            await probe.close()
        except Exception as exc:  # closing a client of a dead server may fail: nothing lost
            logger.debug("closing the old remote probe failed: %r", exc)

    async def resync(self, tier: str) -> None:
        """Rebuild one tier's index from the tier itself (re-creating a dead tier first)."""
        handle = self.handles[tier]
        if tier == TIER_REMOTE:
            self.drop_probe()  # the server may have been re-created: find it again
        try:
            if tier == TIER_CPU:
                self.index.begin_cpu_resync()
                try:
                    inc, snap, seq = await asyncio.wait_for(
                        handle.snapshot.remote(), CONTROL_TIMEOUT_SECS
                    )
                    self.index.reset_cpu(inc, snap, seq)
                finally:
                    self.index.end_cpu_resync()
            else:
                inc_ref, keys_ref = handle.incarnation.remote(), handle.keys.remote()
                inc = await asyncio.wait_for(inc_ref, CONTROL_TIMEOUT_SECS)
                keys = await asyncio.wait_for(keys_ref, CONTROL_TIMEOUT_SECS)
                self.index.reset_lower(tier, inc, keys)
        except ActorDiedError:
            self.tier_died(tier)
        except Exception as exc:
            logger.warning("cannot resync the %s tier index (%s); will retry", tier, exc)
            self.index.drop(tier)

    def schedule_resync(self, tier: str) -> None:
        if tier not in self._resyncing:
            task = self.spawn(self.resync(tier))
            self._resyncing[tier] = task
            task.add_done_callback(lambda _t: self._resyncing.pop(tier, None))

    def tier_died(self, tier: str) -> None:
        """`tier`'s actor is gone for good: serve without it and re-create it now (off
        the loop: creating a named actor waits on the GCS)."""
        self.index.mark_down(tier)
        if tier in self._recreating:
            return
        logger.warning("the %s tier actor died; re-creating it (the other tiers serve)", tier)
        self.index.counts["recreated_tiers"] += 1
        self._recreating.add(tier)
        self.spawn(self._recreate(tier), name=f"raykv-recreate-{tier}")

    async def _recreate(self, tier: str) -> None:
        try:
            handle = await asyncio.to_thread(create_tier, self._config, tier, self._node_id)
        except Exception as exc:  # the next health check (`watch`) tries again
            logger.warning("re-creating the %s tier failed (%r); will retry", tier, exc)
            return
        finally:
            self._recreating.discard(tier)
        self.handles[tier] = handle
        self.schedule_resync(tier)

    async def check(self, tier: str) -> None:
        handle = self.handles[tier]
        try:
            if tier == TIER_CPU:
                inc, seq = await asyncio.wait_for(handle.version.remote(), CONTROL_TIMEOUT_SECS)
                stale = self.index.cpu_lagging(inc, seq)
            else:
                inc = await asyncio.wait_for(handle.incarnation.remote(), CONTROL_TIMEOUT_SECS)
                stale = inc != self.index.incarnations[tier]
        except ActorDiedError:
            self.tier_died(tier)
            return
        except Exception as exc:
            logger.debug("incarnation of %s unavailable: %s", tier, exc)
            return
        if stale:
            if self.index.incarnations[tier] not in (None, inc):
                logger.info("the %s tier restarted (incarnation %s); resyncing", tier, inc[:8])
            await self.resync(tier)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_INTERVAL_SECS)
            await asyncio.gather(*(self.check(t) for t in self.index.order))

    async def probe_remote(self, keys: list[CacheKey]) -> tuple[list[bool] | None, bool]:
        """Which of `keys` (unknown to every index) the remote server holds, and whether
        the call failed (`LookupPlan.give_remote`'s arguments).

        Asked of the remote server itself (a Redis server, a `ray://` KVServer) from this
        process, not through the remote tier's actor: one hop less on every lookup that
        reaches the remote. Behind the remote's circuit breaker; bounded by its time-out.
        The probe is opened off the loop (finding or creating a `ray://` server waits on
        the GCS); a lookup waits for that at most the probe's time-out, and one that
        gives up does not ask the remote (a miss there, not a failure).
        """
        if self._probe is None:
            timeout = self._config.lookup_timeout_ms / 1000 * REMOTE_PROBE_SHARE
            opening = self._probe_opening
            if opening is None:
                opening = self.spawn(self._open_probe(timeout), name="raykv-open-probe")
                self._probe_opening = opening
            try:
                await asyncio.wait_for(asyncio.shield(opening), timeout)
            except asyncio.TimeoutError:
                return None, False
            if self._probe is None:  # it could not be opened (counted by `_open_probe`)
                return None, True
        probe = self._probe  # a resync may drop it (`drop_probe`) during the await
        errors = probe.errors
        found = await probe.contains(keys)
        return found, probe.errors != errors

    async def _open_probe(self, timeout: float) -> None:
        try:
            self._probe = await asyncio.to_thread(open_remote, self._config, timeout_s=timeout)
        except Exception as exc:  # a waiting lookup counts it in the index (`failed`)
            metrics.inc("raykv_remote_errors", backend=self._backend)
            logger.warning("cannot open the remote probe (%r); lookups miss there", exc)
        finally:
            self._probe_opening = None

    def blocking_probe(self) -> RemoteStore | None:
        """The remote probe when it can be asked from a thread that blocks (a `ray://`
        server, once the probe exists): see `ManagerCore.try_lookup`."""
        probe = self._probe
        return probe if probe is not None and probe.contains_blocking is not None else None

    def remote_error(self, what: str, exc: BaseException) -> None:
        self.index.counts["remote_errors"] += 1
        metrics.inc("raykv_remote_errors", backend=self._backend)
        logger.warning("remote %s failed or timed out (%r); counted as misses", what, exc)

    def apply_cpu(self, ack: CPUAck) -> None:
        if not self.index.apply_cpu(ack) and ack.incarnation != self.index.incarnations.get(
            TIER_CPU
        ):
            self.schedule_resync(TIER_CPU)

    async def pull(self, tier: str, keys: list[CacheKey], lookup_id: str | None) -> CPUAck | None:
        """Promote `keys` from a lower tier into CPU (without a CPU tier: serve the tier's
        own reply object); None if that failed or timed out (then they are misses).

        A pull that outlives its timeout is still applied when its reply comes (the CPU
        store may have evicted for it): the index never keeps refs the store dropped.
        """
        if isinstance(tier, PeerTier):
            return await self.pull_peer(tier.manager, keys)
        source = self.handles[tier]
        cpu = self.cpu
        try:
            if cpu is None:
                ack = await self.read_lower(source, keys)
            else:
                reply = asyncio.ensure_future(cpu.pull.remote(source, keys, lookup_id))
                try:
                    ack = await asyncio.wait_for(asyncio.shield(reply), self._pull_timeout)
                except (asyncio.TimeoutError, TimeoutError):
                    self.spawn(self.late_ack(reply))
                    raise
                self.apply_cpu(ack)
        except (asyncio.TimeoutError, TimeoutError):
            self.index.counts["pull_timeouts"] += 1
            logger.warning(
                "read of %d chunks from %s took over %.1f s; counted as misses",
                len(keys),
                tier,
                self._pull_timeout,
            )
            return None
        except Exception as exc:
            logger.warning("read of %d chunks from %s failed: %s", len(keys), tier, exc)
            if isinstance(exc, ActorDiedError):
                self.schedule_check(TIER_CPU if cpu is not None else tier)
            return None
        self.index.apply_pull(tier, ack)
        return ack

    def read_directly(self, keys: list[CacheKey]) -> None:
        """A lookup's caller reads these disk chunks from the files itself
        (`raykv.client.direct`): promote them into CPU behind its back, as a disk hit
        is (the read touches them on disk; a flush waits for it, like a background
        write), or without a CPU tier just touch them."""
        try:
            if self.cpu is not None:
                self.spawn(self.pull(TIER_DISK, keys, None), name="raykv-put-promoted-read")
            else:
                self.handles[TIER_DISK].touch.remote(keys)
        except RayActorError as exc:  # a tier restarting: recency is best effort
            logger.debug("touching %d disk chunks failed: %r", len(keys), exc)

    async def locate_peer(
        self, keys: list[CacheKey], ahead: bool = False
    ) -> tuple[PeerTier, int] | None:
        """The peer whose CPU tier holds the longest prefix of `keys`, and its length in
        chunks (`ControllerLink.locate`). With `ahead` (a lookup that pulls what it
        finds), the peer the last locate named is asked for `keys` (`peer_read`) at the
        same time: if the controller names that peer too, or none while that peer holds
        some (its report not in yet), its answer is kept for the pull (`pull_peer`),
        which then skips its own call. A hinted peer that fails or does not answer in
        time makes this lookup a miss (a pull that failed would be one too) and loses
        its hint; one that holds none of a lookup no peer could serve loses it too."""
        link = self.link
        if link is None:
            return None
        hint = link.hint() if ahead else None
        if hint is None:
            return await link.locate(keys)
        asking = asyncio.ensure_future(ask_peer(self.peers[hint], keys))
        loop = asyncio.get_running_loop()
        guess_until = loop.time() + link.timeout  # a guess gets a locate's time, in all
        try:
            found = await link.locate(keys)
        except BaseException:  # cancelled: so is the question
            asking.cancel()
            raise
        if found is not None and found[0].manager != hint:
            asking.add_done_callback(_unused)
            self.index.counts["peer_asks_unused"] += 1
            return found
        # Named by the controller: the pull's own time; else only a guess: what is left
        # of a locate's time since both questions went out.
        wait = self._pull_timeout if found is not None else max(0.0, guess_until - loop.time())
        try:
            reply = await asyncio.wait_for(asking, wait)
        except Exception as exc:
            self.index.counts["peer_asks_unused"] += 1
            link.unhint(hint)
            named = found is not None
            if isinstance(exc, ActorDiedError) or (named and isinstance(exc, RayActorError)):
                link.lost(hint)  # dead; or unavailable although the controller named it
            elif named and isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                self.index.counts["pull_timeouts"] += 1
            if named:
                logger.warning("peer %s did not answer a read: %r; a miss", hint, exc)
            return None
        n = max(found[1] if found is not None else 0, held(reply))
        if n == 0:
            link.unhint(hint)
            self.index.counts["peer_asks_unused"] += 1
            return None
        self._prune_asked()
        self._asked[(hint, keys[0])] = (time.monotonic(), keys, reply)
        if self._asked_timer is None:  # an idle manager too drops it in time
            self._asked_timer = loop.call_later(ASKED_KEEP_SECS, self._prune_asked_later)
        return PeerTier(hint), n

    def _prune_asked(self) -> None:
        """Drop answers asked ahead that no pull took (their refs keep the peer's objects
        alive): a pull follows its locate within milliseconds."""
        now = time.monotonic()
        for key, (when, _keys, _reply) in list(self._asked.items()):
            if now - when > ASKED_KEEP_SECS:
                del self._asked[key]

    def _prune_asked_later(self) -> None:
        """The one timer's prune, armed again while answers are kept."""
        self._prune_asked()
        self._asked_timer = None
        if self._asked:
            self._asked_timer = asyncio.get_running_loop().call_later(
                ASKED_KEEP_SECS, self._prune_asked_later
            )

    async def pull_peer(self, name: str, keys: list[CacheKey]) -> CPUAck | None:
        """Read `keys` from the peer manager `name` (`read_peer`, or the answer asked
        ahead by `locate_peer`: its objects come to this node, read by this manager) and
        serve them from the peer's objects at once; the CPU store copies the chunks into
        objects of its own afterwards (`adopt`, whose ack enters the index; a flush waits
        for it, like a background write). A read that failed or timed out misses every
        key; a peer that served nothing of what the controller listed: a dead peer is
        forgotten (`ControllerLink.lost`), the chunks a live one no longer holds are
        unlisted (`ControllerLink.stale`)."""
        asked = self._asked.pop((name, keys[0]), None) if keys else None
        self._prune_asked()
        if asked is not None and asked[1][: len(keys)] != keys:
            asked = None  # asked for another request's keys after the same first one
        peer = self.peers.get(name)
        if not keys or (peer is None and asked is None):  # an answer needs no handle
            return None
        try:
            read = self._read_peer(peer, keys, asked)
            ack, metas = await asyncio.wait_for(read, self._pull_timeout)
        except Exception as exc:
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                self.index.counts["pull_timeouts"] += 1
            logger.warning("read of %d chunks from peer %s failed: %r", len(keys), name, exc)
            if isinstance(exc, RayActorError):  # a slow or failed read is no stale listing
                self.link.lost(name)
            return CPUAck("", missing=list(keys))
        self.link.stale(name, ack.missing)
        if len(ack.missing) == len(keys):
            return ack
        cpu = self.cpu
        if cpu is not None:
            served = list(ack.refs)
            where = [(c.ref, c.index) for c in ack.refs.values()]
            self.spawn(self._adopt(cpu, served, metas, where), name="raykv-put-peer-copy")
        return ack

    async def _read_peer(
        self, peer: Any, keys: list[CacheKey], asked: Asked | None
    ) -> tuple[CPUAck, list[PayloadMeta]]:
        """`read_peer`, or the answer asked ahead for a list of keys that begins with
        `keys` (`asked`: when, those keys, the answer)."""
        if asked is not None:
            self.index.counts["peer_asks_used"] += 1
            return await fetch_reply(trim(asked[2], len(keys)), keys)
        return await read_peer(peer, keys)

    async def _adopt(self, cpu: Any, keys: list[CacheKey], metas: list, where: list) -> None:
        try:
            ack = await cpu.adopt.remote(keys, metas, where)
        except Exception as exc:  # the store restarted: the resync covers it
            logger.debug("copying %d peer chunks into the CPU store failed: %s", len(keys), exc)
            return
        self.apply_cpu(ack)

    async def late_ack(self, reply: asyncio.Future) -> None:
        try:
            ack = await reply
        except Exception:
            return
        self.index.counts["late_acks"] += 1
        self.apply_cpu(ack)

    def schedule_check(self, tier: str) -> None:
        if tier in self.handles:
            self.spawn(self.check(tier))

    async def read_lower(self, source: Any, keys: list[CacheKey]) -> CPUAck:
        """Without a CPU tier: read `keys` from `source` and serve its reply object as is
        (the manager owns it and hands out `ChunkRef`s into it; nothing is cached)."""
        metas_ref, arrays_ref = source.get_batch.options(num_returns=2).remote(keys)
        metas = await asyncio.wait_for(metas_ref, self._pull_timeout)
        ack = CPUAck("")
        for i, (key, meta) in enumerate(zip(keys, metas, strict=True)):
            if meta is None:
                ack.missing.append(key)
            else:
                ack.refs[key] = ChunkRef(arrays_ref, i, meta)
        if ack.refs:  # handed out, not kept: hold it past the clients' borrow
            self._hold.hold(arrays_ref, sum(c.meta.nbytes for c in ack.refs.values()))
        return ack

    def write_lower(
        self, keys: list[CacheKey], metas: list[PayloadMeta], batch: list, extra: dict
    ) -> None:
        for tier in self.index.lower_tiers:
            if not self.index.needs_write(tier, keys):
                continue
            if self._writes_in_flight[tier] >= self._max_writes:
                self.skip_lower(tier, len(keys))
                continue
            self._writes_in_flight[tier] += 1
            # The remote tier is shared and keeps no per-writer priority; a ray:// server
            # keeps the request's chain prefix-closed as the disk tier does.
            kw = extra if tier != TIER_REMOTE else {"prefix": extra.get("prefix") or []}
            ref = self.handles[tier].put.remote(keys, metas, batch, **kw)
            self.spawn(self.finish_lower_put(tier, ref, keys, metas), name=f"raykv-put-{tier}")

    def skip_lower(self, tier: str, n: int) -> None:
        """A put finds `tier` with `_max_writes` writes in flight: skip it there."""
        self.index.counts["skipped_lower_writes"] += n
        metrics.inc("raykv_skipped_stores", n, tier=tier)
        now = time.monotonic()
        if now - self._skip_warned_at > 10.0:
            self._skip_warned_at = now
            logger.warning(
                "%s tier has %d writes in flight: skipping %d chunk(s) there (the tier is "
                "slower than the put rate)",
                tier,
                self._writes_in_flight[tier],
                n,
            )

    async def finish_lower_put(
        self, tier: str, ref: Any, keys: list[CacheKey], metas: list[PayloadMeta]
    ) -> None:
        try:
            ack: PutAck = await ref
        except Exception as exc:
            if tier == TIER_REMOTE:
                self.remote_error("put", exc)
            else:
                logger.warning("%s put failed: %s", tier, exc)
            return
        finally:
            self._writes_in_flight[tier] -= 1
        if not self.index.apply_lower(tier, ack):
            self.schedule_check(tier)  # a reply from another incarnation: resync
            return
        if ack.accepted and tier != TIER_DISK:  # the disk tier counts its bytes itself
            accepted = set(ack.accepted)
            nbytes = sum(m.nbytes for k, m in zip(keys, metas, strict=True) if k in accepted)
            metrics.inc("raykv_stored_bytes", nbytes, tier=tier)

    async def stats(self) -> dict[str, Any]:
        """The index's counters, and per tier its own stats beside what the index knows."""
        self.flush_releases()
        index = self.index
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(self.handles[t].stats.remote(), CONTROL_TIMEOUT_SECS)
                for t in index.order
            ),
            return_exceptions=True,
        )
        tiers: dict[str, Any] = {}
        for tier, reply in zip(index.order, replies, strict=True):
            info = dict(reply) if isinstance(reply, dict) else {"error": repr(reply)}
            info["index_entries"] = index.entries(tier)
            info["lookup_hit_chunks"] = index.tier_hits[tier]
            info["lookup_miss_chunks"] = index.tier_misses[tier]
            info["incarnation"] = index.incarnations[tier]
            tiers[tier] = info
        if TIER_PEER in index.tier_hits:
            tiers[TIER_PEER] = {
                "tier": TIER_PEER,
                "lookup_hit_chunks": index.tier_hits[TIER_PEER],
                "lookup_miss_chunks": index.tier_misses[TIER_PEER],
                "peers": sorted(self.peers),
            }
        return {**index.stats(), "tiers": tiers}


def _unused(future: asyncio.Future) -> None:
    """Collect an answer asked ahead that the lookup did not use (its error, if any)."""
    if not future.cancelled():
        future.exception()


__all__ = ["TierSet"]
