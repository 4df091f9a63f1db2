"""The manager's remote probe is closed, not just dropped, when the remote resyncs (a
dropped Redis client keeps its connection pool and sockets for the manager's life)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from raykv.actors.tierset import TierSet
from raykv.config import RayKVConfig
from raykv.tiers.remote import RemoteStore


def test_a_dropped_probe_closes_its_redis_client(redis_server, tmp_path: Path) -> None:
    import redis

    config = RayKVConfig(remote_url=redis_server.url, local_cpu=False, lookup_timeout_ms=100)
    admin = redis.Redis.from_url(redis_server.url)

    def clients() -> int:
        return len(admin.client_list())

    async def scenario() -> list[int]:
        tiers = object.__new__(TierSet)  # only the probe's bookkeeping, no Ray
        tiers._background = set()
        seen = []
        for _ in range(3):
            tiers._probe = RemoteStore(config)
            await tiers._probe.contains([])  # a lookup's probe: its client connects
            await tiers._probe._backend._client.ping()
            seen.append(clients())
            tiers.drop_probe()
            await asyncio.gather(*tiers._background)
            seen.append(clients())
        return seen

    try:
        before = clients()
        seen = asyncio.run(scenario())
    finally:
        admin.close()
    assert seen[0] == before + 1  # the probe's connection
    assert seen[1::2] == [before] * 3  # closed after each drop: no connection piles up


class _SlowOpen:
    """`open_remote` that takes `delay` seconds (a `ray://` server found or created
    through the GCS) or fails, counting its calls."""

    def __init__(self, delay: float, fail: bool = False) -> None:
        self.delay, self.fail, self.calls = delay, fail, 0

    def __call__(self, config: RayKVConfig, timeout_s: float | None = None) -> object:
        import time

        self.calls += 1
        time.sleep(self.delay)  # blocking, as a GCS call is
        if self.fail:
            raise ConnectionError("no such server")
        return _Probe()


class _Probe:
    errors = 0

    async def contains(self, keys: list) -> list[bool]:
        return [True] * len(keys)


def _bare_tierset() -> TierSet:
    tiers = object.__new__(TierSet)  # only the probe's bookkeeping, no Ray
    tiers._config = RayKVConfig(remote_url="ray://kv", local_cpu=False, lookup_timeout_ms=100)
    tiers._background, tiers._probe, tiers._probe_opening = set(), None, None
    tiers._backend = "ray"
    return tiers


def test_the_probe_opens_off_the_loop_once_and_lookups_meanwhile_skip_the_remote(
    monkeypatch,
) -> None:
    """Opening a `ray://` probe waits on the GCS: on the manager's loop it held every
    lookup and report. It runs in a thread, once for all the lookups that need it; a
    lookup waits for it at most the probe's time-out and then misses the remote."""
    from raykv.actors import tierset

    opener = _SlowOpen(delay=0.5)
    monkeypatch.setattr(tierset, "open_remote", opener)

    async def scenario() -> tuple[list, float, tuple]:
        tiers = _bare_tierset()
        lags: list[float] = []

        async def ticker() -> None:  # the loop's other work: how late does it run?
            loop = asyncio.get_running_loop()
            for _ in range(25):
                t = loop.time()
                await asyncio.sleep(0.02)
                lags.append(loop.time() - t - 0.02)

        tick = asyncio.ensure_future(ticker())
        early = await asyncio.gather(*(tiers.probe_remote(["k"]) for _ in range(4)))
        await tick
        await asyncio.gather(*tiers._background)
        return early, max(lags), await tiers.probe_remote(["k", "j"])

    early, lag, later = asyncio.run(scenario())
    assert early == [(None, False)] * 4  # still opening: not asked, not a failure
    assert lag < 0.25, lag  # the loop ran on while the probe opened
    assert later == ([True, True], False) and opener.calls == 1


def test_a_probe_that_cannot_be_opened_is_a_failed_remote_and_is_tried_again(
    monkeypatch,
) -> None:
    from raykv.actors import tierset

    opener = _SlowOpen(delay=0.0, fail=True)
    monkeypatch.setattr(tierset, "open_remote", opener)

    async def scenario() -> list:
        tiers = _bare_tierset()
        return [await tiers.probe_remote(["k"]) for _ in range(2)]

    assert asyncio.run(scenario()) == [(None, True)] * 2
    assert opener.calls == 2


def test_a_probe_dropped_during_its_lookup_answers_that_lookup() -> None:
    """A resync drops the probe (`drop_probe`) while a lookup's `contains` is in flight:
    the lookup read `self._probe.errors` after its await and raised AttributeError."""

    class _Waiting(_Probe):
        def __init__(self) -> None:
            self.go = asyncio.Event()

        async def contains(self, keys: list) -> list[bool]:
            await self.go.wait()
            return [True] * len(keys)

        async def close(self) -> None:
            return None

    async def scenario() -> tuple:
        tiers = _bare_tierset()
        tiers._probe = probe = _Waiting()
        lookup = asyncio.ensure_future(tiers.probe_remote(["k"]))
        await asyncio.sleep(0.01)
        tiers._probe = None  # what `drop_probe` leaves
        probe.go.set()
        return await lookup

    assert asyncio.run(scenario()) == ([True], False)
