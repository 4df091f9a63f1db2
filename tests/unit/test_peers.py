"""The manager's link to the controller (`raykv.actors.peers.ControllerLink`) and the
peer pulls of its tier set, against fake controllers and peers: no Ray cluster. A
controller that hangs costs one lookup a wait (a circuit breaker), one killed for good
is looked up again after a back-off (not resynced in a hot loop), a peer that no longer
holds what the controller listed gets those listings dropped (not forgotten whole), and
a dead peer is forgotten."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from ray.exceptions import ActorDiedError
from raykv_testing import byte_meta

from raykv.actors import peers
from raykv.actors import tierset as tierset_module
from raykv.actors.controller import ControllerState
from raykv.actors.peers import ControllerLink
from raykv.actors.tierset import TierSet
from raykv.keys import KeyMaker
from raykv.wire import TIER_CPU, CPUAck


class _Call:
    """`handle.method.remote(...)` answered by `fn` (a coroutine function or a plain one)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, []

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        out = self.fn(*args)
        if asyncio.iscoroutine(out):
            return asyncio.ensure_future(out)
        fut = asyncio.get_running_loop().create_future()
        if isinstance(out, BaseException):
            fut.set_exception(out)
        else:
            fut.set_result(out)
        return fut


class FakeController:
    def __init__(self, locate: Any = None, fail: BaseException | None = None) -> None:
        self.state = ControllerState()
        answer = (lambda *a: fail) if fail is not None else None
        self.locate = _Call(locate or (lambda keys, exclude: None))
        self.resync = _Call(answer or self.state.resync)
        self.report = _Call(answer or self.state.report)
        self.forget = _Call(self.state.forget)
        self.drop = _Call(self.state.drop)


def link_to(controller: FakeController, monkeypatch: pytest.MonkeyPatch) -> ControllerLink:
    monkeypatch.setattr(peers, "get_or_create_controller", lambda namespace: controller)
    return ControllerLink("ns", "node-a", "raykv-manager-a", None, locate_timeout_s=0.2)


KEYS = KeyMaker(chunk_size=4, model_name="m").keys_from_hashes([b"a", b"b", b"c"], [4, 8, 12])
KEYS = [span.key for span in KEYS]


def test_after_a_controller_timed_out_lookups_miss_the_peers_at_once(monkeypatch):
    async def hang(keys, exclude):
        await asyncio.sleep(10)

    link = link_to(FakeController(locate=hang), monkeypatch)

    async def scenario() -> tuple[list, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = await asyncio.gather(*(link.locate(KEYS) for _ in range(5)))
        return first, loop.time() - t0, [await link.locate(KEYS) for _ in range(5)]

    first, took, after = asyncio.run(scenario())
    assert first == [None] * 5 and took < 1.0  # the lookups in flight waited 0.2 s
    assert after == [None] * 5
    assert len(link._controller.locate.calls) == 5  # the breaker is open: not asked again


def test_a_controller_killed_for_good_is_looked_up_again_after_a_back_off(monkeypatch):
    """A dead handle failed every call at once: the report loop resynced (a whole
    snapshot) ten times a second, forever, and the peer tier stayed off."""
    dead, alive = FakeController(fail=ActorDiedError()), FakeController()
    monkeypatch.setattr(peers, "RECONNECT_MIN_SECS", 0.3)
    monkeypatch.setattr(peers, "FLUSH_INTERVAL_SECS", 0.01)
    link = link_to(dead, monkeypatch)
    monkeypatch.setattr(peers, "get_or_create_controller", lambda namespace: alive)
    snapshots = []

    def snapshot() -> dict:
        snapshots.append(1)
        return {TIER_CPU: KEYS}

    async def scenario() -> None:
        loop = asyncio.create_task(link.report_loop(snapshot))
        await asyncio.sleep(0.6)
        loop.cancel()

    asyncio.run(scenario())
    assert len(dead.resync.calls) == 1  # then the back-off, not a hot loop
    assert link._controller is alive and alive.resync.calls
    assert alive.state.best_instances(KEYS) == [("node-a", 3)]
    assert len(snapshots) <= 1 + len(alive.resync.calls)


class _Peer:
    """A peer manager whose `peer_read` serves `held` of the keys (its objects inline)."""

    def __init__(self, held: int | BaseException) -> None:
        self.held = held

        async def peer_read(keys):
            if isinstance(held, BaseException):
                raise held
            metas = [None] * len(keys)  # nothing it can serve: every key a miss
            return metas, [], [None] * len(keys)

        self.peer_read = _Call(peer_read)


def tierset_with(link: ControllerLink) -> TierSet:
    tiers = object.__new__(TierSet)  # only the peer pull's bookkeeping
    tiers.link, tiers._pull_timeout = link, 1.0
    counts = {"pull_timeouts": 0, "peer_asks_used": 0, "peer_asks_unused": 0}
    tiers.index = type("Index", (), {"counts": counts, "up": lambda self, tier: False})()
    tiers.handles, tiers._background, tiers._asked, tiers._releases = {}, set(), {}, []
    tiers._asked_timer = None
    return tiers


@pytest.mark.parametrize("peer_fails", [None, ActorDiedError()], ids=["stale-listing", "dead-peer"])
def test_a_peer_without_the_listed_chunks_is_unlisted_for_them_a_dead_one_forgotten(
    monkeypatch, peer_fails
):
    controller = FakeController()
    other = KeyMaker(chunk_size=4, model_name="m").keys_from_hashes([b"x"], [4])[0].key
    controller.state.resync("node-b", 0, {TIER_CPU: [*KEYS, other]}, {"manager": "mgr-b"})
    link = link_to(controller, monkeypatch)
    link.peers["mgr-b"], link._instances["mgr-b"] = _Peer(peer_fails or 0), "node-b"

    async def scenario() -> CPUAck:
        ack = await tierset_with(link).pull_peer("mgr-b", KEYS)
        await asyncio.sleep(0)  # the controller calls are fire-and-forget
        return ack

    ack = asyncio.run(scenario())
    assert ack.missing == KEYS and not ack.refs
    assert controller.state.best_instances(KEYS) == []
    if peer_fails is None:  # the rest of what node-b holds stays listed
        assert controller.state.best_instances([other]) == [("node-b", 1)]
        assert "mgr-b" in link.peers
    else:
        assert controller.state.best_instances([other]) == [] and "mgr-b" not in link.peers


def test_a_peer_no_locate_named_for_a_while_is_dropped_when_another_is_added(monkeypatch):
    """Nodes come and go over days of autoscaling: the link keeps the handles of the
    peers it used lately, not of every peer it ever met."""
    answers = iter([("node-b", "mgr-b", 1), ("node-c", "mgr-c", 1)])
    link = link_to(FakeController(locate=lambda keys, exclude: next(answers)), monkeypatch)
    monkeypatch.setattr(link, "_peer_handle", lambda name: f"handle-{name}")
    clock = [1000.0]
    monkeypatch.setattr(peers, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def scenario() -> None:
        await link.locate(KEYS)
        clock[0] += peers.PEER_IDLE_SECS + 1
        await link.locate(KEYS)

    asyncio.run(scenario())
    assert list(link.peers) == ["mgr-c"] and list(link._instances) == ["mgr-c"]


def test_a_controller_of_an_older_raykv_gets_plain_resyncs_and_no_drops(monkeypatch):
    """A controller is detached and lives on across upgrades: one that cannot read
    packed keys (it raises) gets plain lists from the next resync on, and one without
    `drop` leaves stale listings to its resyncs instead of failing the manager's get."""
    from ray.exceptions import RayTaskError

    old = FakeController()
    plain_resync = old.state.resync

    def resync(instance, seq, snapshot, info):
        if any(not isinstance(keys, list) for keys in snapshot.values()):
            raise RayTaskError("resync", "TypeError", TypeError("not iterable"))
        return plain_resync(instance, seq, snapshot, info)

    old.resync = _Call(resync)
    del old.drop
    monkeypatch.setattr(peers, "FLUSH_INTERVAL_SECS", 0.01)
    link = link_to(old, monkeypatch)
    link._instances["mgr-b"] = "node-b"

    async def scenario() -> None:
        loop = asyncio.create_task(link.report_loop(lambda: {TIER_CPU: list(KEYS)}))
        await asyncio.sleep(0.2)
        loop.cancel()

    asyncio.run(scenario())
    assert old.state.best_instances(KEYS) == [("node-a", 3)]
    link.stale("mgr-b", KEYS)  # no `drop` there: nothing raised


class _Holder:
    """A peer manager whose `peer_read` serves the first `held` of the keys it is asked
    for, all from one object (a done future holding their arrays)."""

    def __init__(self, held: int, fail: BaseException | None = None) -> None:
        self.held = held

        def peer_read(keys):
            if fail is not None:
                return fail
            n = min(self.held, len(keys))
            fut = asyncio.get_running_loop().create_future()
            fut.set_result([np.full(8, i, dtype=np.uint8) for i in range(n)])
            metas = [byte_meta(8)] * n + [None] * (len(keys) - n)
            places = [(0, i) for i in range(n)] + [None] * (len(keys) - n)
            return metas, [fut] if n else [], places

        self.peer_read = _Call(peer_read)


def _lookup(tiers: TierSet, keys: list) -> Any:
    """What the manager does for a lookup that misses its own tiers: locate, then pull."""

    async def scenario() -> tuple[Any, Any]:
        found = await tiers.locate_peer(keys, ahead=True)
        if found is None:
            return None, None
        ack = await tiers.pull_peer(found[0].manager, keys[: found[1]])
        await asyncio.sleep(0)
        return found, ack

    return scenario()


def _located_link(monkeypatch, answers: list) -> tuple[ControllerLink, dict[str, _Holder]]:
    """A link whose controller answers `answers` in turn (instance, manager, n) or None,
    with peers mgr-b and mgr-c, and whose last locate named mgr-b."""
    it = iter(answers)
    link = link_to(FakeController(locate=lambda keys, exclude: next(it)), monkeypatch)
    holders = {"mgr-b": _Holder(3), "mgr-c": _Holder(3)}
    monkeypatch.setattr(link, "_peer_handle", lambda name: holders[name])
    return link, holders


def test_a_lookup_asks_the_last_named_peer_while_it_asks_the_controller(monkeypatch):
    """The answer asked ahead serves the pull: one call to the peer per lookup, and the
    pull's own `peer_read` skipped (a round trip, ~1.5-3 ms of a ~20 ms 4 MiB peer hit)."""
    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3), ("node-b", "mgr-b", 3)])
    tiers = tierset_with(link)

    async def both() -> tuple[Any, Any]:
        return await _lookup(tiers, KEYS), await _lookup(tiers, KEYS)

    (found1, ack1), (found2, ack2) = asyncio.run(both())
    assert found1[1] == found2[1] == 3 and list(ack1.refs) == list(ack2.refs) == KEYS
    # first lookup: no hint yet (locate, then the pull's call); second: one call, ahead
    assert len(holders["mgr-b"].peer_read.calls) == 2
    assert tiers.index.counts["peer_asks_used"] == 1 and not tiers._asked


def test_a_peer_asked_ahead_serves_what_the_controller_has_not_listed_yet(monkeypatch):
    """Reports reach the controller every 0.1 s: a prefix just stored on the hinted peer
    is served from it although the controller names no one (or fewer chunks)."""
    named = ("node-b", "mgr-b", 1)
    link, holders = _located_link(monkeypatch, [named, None, named])
    tiers = tierset_with(link)

    async def three() -> list:
        return [await _lookup(tiers, KEYS) for _ in range(3)]

    first, unlisted, shorter = asyncio.run(three())
    assert first[0][1] == 1
    assert unlisted[0][1] == 3 and list(unlisted[1].refs) == KEYS
    assert shorter[0][1] == 3 and list(shorter[1].refs) == KEYS


def test_an_answer_asked_ahead_of_another_peer_is_dropped_and_misses_stop_asking(monkeypatch):
    """The controller names another peer: the pull asks that one. No one holds the keys:
    the hint is dropped, so the next misses cost the controller's call alone."""
    answers = [("node-b", "mgr-b", 3), ("node-c", "mgr-c", 2), None, None, None]
    link, holders = _located_link(monkeypatch, answers)
    tiers = tierset_with(link)

    async def lookups() -> list:
        out = [await _lookup(tiers, KEYS) for _ in range(2)]
        holders["mgr-c"].held = 0
        out += [await _lookup(tiers, KEYS) for _ in range(3)]
        return out

    out = asyncio.run(lookups())
    assert out[1][0][0].manager == "mgr-c" and list(out[1][1].refs) == KEYS[:2]
    assert [o[0] for o in out[2:]] == [None, None, None]
    assert len(holders["mgr-b"].peer_read.calls) == 2  # its pull, then asked ahead once
    assert len(holders["mgr-c"].peer_read.calls) == 2  # its pull, then the one miss asked
    assert link.hint() is None and not tiers._asked
    assert tiers.index.counts["peer_asks_unused"] == 2


def test_a_hinted_peer_that_fails_makes_a_miss_once_and_loses_its_hint(monkeypatch):
    """The controller names the hinted peer, whose answer fails: a miss (as a pull that
    failed is), not a second call with a second time-out; the hint is dropped."""
    named = ("node-b", "mgr-b", 3)
    link, holders = _located_link(monkeypatch, [named, named, named])
    tiers = tierset_with(link)

    async def lookups() -> tuple[Any, Any]:
        await _lookup(tiers, KEYS)
        holders["mgr-b"].peer_read = _Holder(0, fail=ValueError("boom")).peer_read
        return await _lookup(tiers, KEYS), link.hint()

    failed, hint = asyncio.run(lookups())
    assert failed == (None, None) and hint is None
    assert tiers.index.counts["peer_asks_unused"] == 1
    assert len(holders["mgr-b"].peer_read.calls) == 1  # asked ahead; no pull after it


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_hinted_peer_that_hangs_costs_one_lookup_a_bounded_wait(monkeypatch, named):
    """A guess (the controller names no one) waits at most a locate's time for the
    hinted peer, a named one the pull's own; either way the hint goes, and the next
    lookup asks the controller alone."""
    answer = ("node-b", "mgr-b", 3)
    link, holders = _located_link(monkeypatch, [answer] + [answer if named else None] * 2)
    tiers = tierset_with(link)
    tiers._pull_timeout = 0.4

    async def hang(keys):
        await asyncio.sleep(10)

    async def lookups() -> tuple[Any, float, Any, Any]:
        await _lookup(tiers, KEYS)
        holders["mgr-b"].peer_read = _Call(hang)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        slow = await _lookup(tiers, KEYS)
        took, hint = loop.time() - t0, link.hint()
        return slow, took, hint, await tiers.locate_peer(KEYS, ahead=True)

    slow, took, hint, after = asyncio.run(lookups())
    assert slow == (None, None) and hint is None
    assert took < (0.6 if named else 0.35)  # 0.4 s (the pull's), 0.2 s (a locate's)
    assert len(holders["mgr-b"].peer_read.calls) == 1  # the hang; nothing asked after it
    assert (after is not None) == named


def test_a_dead_hinted_peer_is_forgotten(monkeypatch):
    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3), None])
    tiers = tierset_with(link)

    async def lookups() -> Any:
        await _lookup(tiers, KEYS)
        holders["mgr-b"].peer_read = _Holder(0, fail=ActorDiedError()).peer_read
        return await _lookup(tiers, KEYS)

    assert asyncio.run(lookups()) == (None, None)
    assert "mgr-b" not in link.peers and link.hint() is None


def test_the_answer_asked_ahead_and_the_controllers_question_go_out_together(monkeypatch):
    """Each side answers only once the other has been asked: a lookup that asked one
    after the other's answer would find no one here."""
    asked, located = asyncio.Event(), asyncio.Event()

    async def until(event: asyncio.Event) -> bool:
        try:
            await asyncio.wait_for(event.wait(), 0.1)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        return True

    async def locate(keys, exclude):
        located.set()
        return ("node-b", "mgr-b", 3) if await until(asked) else None

    link = link_to(FakeController(locate=locate), monkeypatch)
    holder = _Holder(3)
    plain = holder.peer_read.fn

    async def peer_read(keys):
        asked.set()
        if not await until(located):
            return [None] * len(keys), [], [None] * len(keys)
        return plain(keys)

    holder.peer_read = _Call(peer_read)
    monkeypatch.setattr(link, "_peer_handle", lambda name: holder)
    link.peers["mgr-b"], link._last = holder, "mgr-b"
    found, ack = asyncio.run(_lookup(tierset_with(link), KEYS))
    assert found[1] == 3 and list(ack.refs) == KEYS and len(holder.peer_read.calls) == 1


def test_an_answer_asked_ahead_serves_only_a_pull_of_the_same_keys(monkeypatch):
    """Kept under (peer, first key): a pull whose keys go on differently after that
    first key is another request's, and the peer is asked again."""
    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3)] * 2)
    tiers = tierset_with(link)
    other = KeyMaker(chunk_size=4, model_name="m").keys_from_hashes([b"a", b"z"], [4, 8])
    other = [span.key for span in other]
    assert other[0] == KEYS[0] and other[1] != KEYS[1]

    async def scenario() -> CPUAck:
        await _lookup(tiers, KEYS)
        assert (await tiers.locate_peer(KEYS, ahead=True))[1] == 3
        return await tiers.pull_peer("mgr-b", other)

    ack = asyncio.run(scenario())
    assert list(ack.refs) == other and len(holders["mgr-b"].peer_read.calls) == 3
    assert tiers.index.counts["peer_asks_used"] == 0


def test_a_reply_trimmed_names_only_the_objects_its_keys_use():
    one, two = object(), object()
    metas = [byte_meta(8)] * 3
    reply = (metas, [one, two], [(1, 0), (1, 1), (0, 0)])
    assert peers.trim(reply, 2) == (metas[:2], [two], [(0, 0), (0, 1)])
    assert peers.held((metas[:2] + [None], [one], [(0, 0), (0, 1), None])) == 2
    assert peers.held((metas, [one], [(0, 0), None, (0, 1)])) == 1
    # a malformed place is a miss, never an exception in the pull
    assert peers.trim((metas, [one], [7, (0, 1, 2), (5, 0)]), 3) == (metas, [], [None] * 3)


def test_a_lookup_that_does_not_pull_asks_no_peer_ahead_and_an_unpulled_answer_is_dropped(
    monkeypatch,
):
    """A count-only lookup never pulls: an answer kept for it would hold the peer's
    objects alive (borrowed refs) until some later lookup pruned it."""
    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3)] * 3)
    tiers = tierset_with(link)
    clock = [100.0]
    monkeypatch.setattr(tierset_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def scenario() -> None:
        await _lookup(tiers, KEYS)  # names mgr-b: the hint
        assert (await tiers.locate_peer(KEYS))[1] == 3  # a lookup that only counts
        assert len(holders["mgr-b"].peer_read.calls) == 1 and not tiers._asked
        assert (await tiers.locate_peer(KEYS, ahead=True))[1] == 3  # never pulled
        assert len(tiers._asked) == 1
        clock[0] += tierset_module.ASKED_KEEP_SECS + 1
        await tiers.pull_peer("mgr-c", KEYS[1:])  # any later pull prunes it

    asyncio.run(scenario())
    assert not tiers._asked


def test_a_hung_controller_and_a_hung_hinted_peer_cost_one_locate_time_together(monkeypatch):
    """Both questions go out at once, so a guess waits only what is left of the locate's
    time (0.2 s here), not a second one after the controller's."""
    calls = iter([("node-b", "mgr-b", 3)])

    async def locate(keys, exclude):
        answer = next(calls, None)
        if answer is None:
            await asyncio.sleep(10)
        return answer

    link = link_to(FakeController(locate=locate), monkeypatch)
    holder = _Holder(3)
    monkeypatch.setattr(link, "_peer_handle", lambda name: holder)
    tiers = tierset_with(link)

    async def hang(keys):
        await asyncio.sleep(10)

    async def lookups() -> tuple[Any, float]:
        await _lookup(tiers, KEYS)
        holder.peer_read = _Call(hang)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        return await tiers.locate_peer(KEYS, ahead=True), loop.time() - t0

    found, took = asyncio.run(lookups())
    assert found is None and took < 0.3 and link.hint() is None


def test_an_answer_no_pull_took_is_dropped_by_a_timer_on_an_idle_manager(monkeypatch):
    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3)] * 2)
    tiers = tierset_with(link)
    monkeypatch.setattr(tierset_module, "ASKED_KEEP_SECS", 0.05)

    async def scenario() -> tuple[int, int, Any]:
        await _lookup(tiers, KEYS)
        assert (await tiers.locate_peer(KEYS, ahead=True))[1] == 3  # kept, never pulled
        kept = len(tiers._asked)
        await asyncio.sleep(0.3)  # nothing else happens on this manager
        return kept, len(tiers._asked), tiers._asked_timer

    assert asyncio.run(scenario()) == (1, 0, None)


def test_a_guess_that_finds_its_peer_unavailable_for_a_moment_keeps_the_peer(monkeypatch):
    """Only a dead peer (or one the controller named) is forgotten: a transient
    `ActorUnavailableError` on a guess drops the hint, not the handle."""
    from ray.exceptions import ActorUnavailableError

    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3), None])
    tiers = tierset_with(link)

    async def lookups() -> Any:
        await _lookup(tiers, KEYS)
        holders["mgr-b"].peer_read = _Holder(0, fail=ActorUnavailableError("busy", None)).peer_read
        return await _lookup(tiers, KEYS)

    assert asyncio.run(lookups()) == (None, None)
    assert "mgr-b" in link.peers and link.hint() is None


def test_an_answer_asked_ahead_serves_its_pull_after_the_peers_handle_was_dropped(monkeypatch):
    """The answer holds the peer's refs; its pull needs no handle (a concurrent lookup's
    failed read may have dropped it meanwhile)."""
    link, holders = _located_link(monkeypatch, [("node-b", "mgr-b", 3)] * 2)
    tiers = tierset_with(link)

    async def scenario() -> CPUAck:
        await _lookup(tiers, KEYS)
        assert (await tiers.locate_peer(KEYS, ahead=True))[1] == 3
        link.peers.pop("mgr-b")
        return await tiers.pull_peer("mgr-b", KEYS)

    ack = asyncio.run(scenario())
    assert list(ack.refs) == KEYS and tiers.index.counts["peer_asks_used"] == 1
