"""Soak: 8 clients on a mixed, verified workload against CPU + disk + Redis tiers.

The CPU tier holds about an eighth of the working set and the disk tier about half, so
eviction, promotion and lower-tier reads run all the time. Pins left by clients that
never come back ("abandon" ops) must be released by the lease. Duration:
`--soak-seconds` or `$RAYKV_SOAK_SECONDS` (default 30 s).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from soak_workload import CHUNK_BYTES, C, Corpus, Workload, wait_until

import raykv
from raykv.actors.disk_store import SUFFIX, TMP_SUFFIX
from raykv.actors.storage_manager import shutdown_manager

pytestmark = [pytest.mark.stress, pytest.mark.usefixtures("ray_session")]

GIB = 1 << 30
CPU_BYTES = 1 << 20
DISK_BYTES = 4 << 20
PIN_LEASE_SECS = 2.0
# Disk overshoot allowed while a victim's unlink races another put's write: a few records.
DISK_SLACK = 16 * (CHUNK_BYTES + 256)


def soak_config(namespace: str, disk: Path, remote_url: str) -> dict[str, Any]:
    return {
        "namespace": namespace,
        "chunk_size": C,
        "kv_dtype": "float16",
        "max_local_cpu_size": CPU_BYTES / GIB,
        "local_disk": str(disk),
        "max_local_disk_size": DISK_BYTES / GIB,
        "remote_url": remote_url,
        "lookup_timeout_ms": 2000,
        "blocking_timeout_secs": 0.5,
        "pin_lease_secs": PIN_LEASE_SECS,
    }


def disk_usage(root: Path) -> tuple[int, int]:
    """(bytes of complete chunk files, bytes of temp files) under `root`."""
    done = tmp = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                size = os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
            if name.endswith(SUFFIX):
                done += size
            elif name.endswith(TMP_SUFFIX):
                tmp += size
    return done, tmp


class BoundsMonitor:
    """Samples the tiers' own accounting and the disk directory twice a second."""

    def __init__(self, kv: raykv.KVCache, disk: Path) -> None:
        self.kv, self.disk = kv, disk
        self.max_cpu = self.max_disk_index = self.max_disk_files = self.max_tmp = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BoundsMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            tiers = self.kv.stats().get("tiers", {})
            cpu, disk = tiers.get("cpu", {}), tiers.get("disk", {})
            files, tmp = disk_usage(self.disk)
            self.max_cpu = max(
                self.max_cpu, cpu.get("used_bytes", 0) + cpu.get("reserved_bytes", 0)
            )
            used = disk.get("used_bytes", 0) + disk.get("pending_bytes", 0)
            self.max_disk_index = max(self.max_disk_index, used)
            self.max_disk_files = max(self.max_disk_files, files)
            self.max_tmp = max(self.max_tmp, tmp)
            self.samples += 1


def test_soak_mixed_workload_verifies_every_hit_and_stays_within_budgets(
    tmp_path: Path, redis_server: Any, soak_seconds: float
) -> None:
    ns = f"soak-{uuid.uuid4().hex[:8]}"
    disk = tmp_path / "disk"
    kwargs = soak_config(ns, disk, redis_server.url)
    corpus = Corpus()
    working_set = corpus.working_set_bytes()
    assert working_set > 6 * CPU_BYTES and working_set > DISK_BYTES
    admin = raykv.connect(**kwargs)
    wl = Workload(kwargs, n_clients=8, corpus=corpus)
    try:
        with BoundsMonitor(admin, disk) as mon:
            t0 = time.monotonic()
            wl.start()
            try:
                time.sleep(soak_seconds)
            finally:
                wl.stop()
            elapsed = time.monotonic() - t0
        # Abandoned pins (and any left by clients cut off mid-request) end with their lease.
        released = wait_until(lambda: _no_pins(admin), timeout=4 * PIN_LEASE_SECS + 10)
        stats = admin.stats()
        print()
        print(wl.report("soak (cpu + disk + redis)", elapsed))
        print(
            f"working set {working_set / 2**20:.1f} MiB; cpu budget {CPU_BYTES / 2**20:.1f} MiB "
            f"max used {mon.max_cpu / 2**20:.2f} MiB; disk budget {DISK_BYTES / 2**20:.1f} MiB "
            f"max indexed {mon.max_disk_index / 2**20:.2f} MiB, max files "
            f"{mon.max_disk_files / 2**20:.2f} MiB (+ max temp {mon.max_tmp / 2**20:.2f} MiB); "
            f"{mon.samples} samples"
        )
        print(
            f"pins released {released if released is None else f'{released:.1f} s'} after the "
            f"clients stopped (lease {PIN_LEASE_SECS} s); cpu evictions "
            f"{stats['tiers']['cpu'].get('evictions')} expired leases "
            f"{stats['tiers']['cpu'].get('expired_leases')}; manager hit rate "
            f"{stats.get('hit_rate', 0):.2f}, remote errors {stats.get('remote_errors')}"
        )
        c = wl.c
        assert c.errors == [], c.errors[:3]
        assert c.wrong_chunks == 0
        assert c.hit_chunks > 0 and c.miss_chunks > 0
        assert mon.samples > 0
        assert mon.max_cpu <= CPU_BYTES
        assert mon.max_disk_index <= DISK_BYTES
        assert mon.max_disk_files <= DISK_BYTES + DISK_SLACK
        assert released is not None, f"pins still held: {_pin_state(admin)}"
    finally:
        admin.close()
        shutdown_manager(ns)


def _pin_state(kv: raykv.KVCache) -> dict[str, Any]:
    stats = kv.stats()
    cpu = stats.get("tiers", {}).get("cpu", {})
    return {
        "pinned_entries": cpu.get("pinned_entries"),
        "leases": cpu.get("leases"),
        "open_lookups": stats.get("open_lookups"),
    }


def _no_pins(kv: raykv.KVCache) -> bool:
    return _pin_state(kv) == {"pinned_entries": 0, "leases": 0, "open_lookups": 0}
