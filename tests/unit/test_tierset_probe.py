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
