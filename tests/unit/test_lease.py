"""Leases (raykv.tiers.lease): the deadline rule shared by the manager's index and the
CPU tier, and the sweep loop both actors run."""

from __future__ import annotations

import asyncio

from raykv.tiers.lease import Leases, sweep_forever, sweep_period


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_ends_after_its_time_and_renewal_never_shortens_it() -> None:
    clock = Clock()
    leases = Leases(10.0, clock)
    leases.renew("a")
    leases.renew("b", 30.0)
    leases.renew("b", 1.0)  # a shorter renewal keeps the later deadline
    clock.now += 10.0
    assert leases.expired() == ["a"]  # listed until ended
    assert leases.next_deadline() == 110.0
    assert leases.end("a") and not leases.end("a")
    assert leases.next_deadline() == 130.0
    assert "a" not in leases and "b" in leases and len(leases) == 1
    clock.now += 20.0
    assert leases.expired() == ["b"]


def test_the_sweep_period_is_a_quarter_lease_within_bounds() -> None:
    assert sweep_period(4.0) == 1.0
    assert sweep_period(0.001) == 0.05
    assert sweep_period(300.0) == 5.0


def test_the_sweep_releases_expired_leases_and_reports_them() -> None:
    leases = Leases(0.05)
    leases.renew("gone")
    heard: list[list[str]] = []

    def expire() -> list[str]:
        ids = leases.expired()
        for lookup_id in ids:
            leases.end(lookup_id)
        return ids

    async def main() -> None:
        task = asyncio.create_task(sweep_forever(0.05, expire, heard.append))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if heard:
                break
        task.cancel()

    asyncio.run(main())
    assert heard == [["gone"]] and len(leases) == 0
