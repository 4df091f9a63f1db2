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

import pytest
from ray.exceptions import ActorDiedError

from raykv.actors import peers
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
    tiers.index = type("Index", (), {"counts": {"pull_timeouts": 0}})()
    tiers.handles, tiers._background = {}, set()
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
