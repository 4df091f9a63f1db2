"""Resource sampling for the soak: RSS of each raykv actor process and Ray's object store use.

RSS comes from `/proc/PID/status` (`VmRSS`, with `RssAnon`/`RssShmem` kept apart: pages
of Ray's shared-memory object store that a process touched count towards its RSS). The
object store use is the raylet's own `object_store_bytes_used` (one small gRPC call, the
`ray memory --stats-only` path), so a sample every second costs nothing measurable.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import ray

MIB = 1 << 20


@dataclass(frozen=True)
class Rss:
    """One process's resident memory, in bytes."""

    total: int
    anon: int
    shmem: int


def read_rss(pid: int) -> Rss | None:
    """`VmRSS`/`RssAnon`/`RssShmem` of `pid` from /proc; None if the process is gone."""
    vals: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssShmem"):
                    vals[name] = int(rest.split()[0]) * 1024  # the kernel reports kB
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "VmRSS" not in vals:
        return None  # a zombie has no memory lines
    return Rss(vals["VmRSS"], vals.get("RssAnon", 0), vals.get("RssShmem", 0))


def object_store_used() -> int:
    """Bytes in use in Ray's object store, as the raylet counts them (all of this node)."""
    from ray._private import internal_api

    node = ray._private.worker.global_worker.node
    reply = internal_api.get_memory_info_reply(
        None, node.node_ip_address, node.node_manager_port, timeout_seconds=10.0
    )
    return int(reply.store_stats.object_store_bytes_used)


@dataclass
class Peaks:
    """What the monitor saw: per-process baseline and peak RSS, object store use."""

    baseline: dict[str, Rss] = field(default_factory=dict)
    peak: dict[str, Rss] = field(default_factory=dict)  # componentwise maxima
    store_baseline: int = 0
    store_peak: int = 0
    samples: int = 0
    sample_errors: list[str] = field(default_factory=list)


class ResourceMonitor:
    """Samples the RSS of named processes and the object store every `every` seconds.

    `baseline()` takes the reference sample (call it after a warm-up, before the load);
    peaks are the componentwise maxima of every later sample.
    """

    def __init__(self, pids: dict[str, int], every: float = 1.0) -> None:
        self.pids = dict(pids)
        self.every = every
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-resources", daemon=True)

    def baseline(self) -> None:
        for name, pid in self.pids.items():
            rss = read_rss(pid)
            assert rss is not None, f"{name} (pid {pid}) is not running"
            self.peaks.baseline[name] = self.peaks.peak[name] = rss
        self.peaks.store_baseline = self.peaks.store_peak = object_store_used()

    def __enter__(self) -> ResourceMonitor:
        if not self.peaks.baseline:
            self.baseline()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()  # one last sample, after the load stopped

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        p = self.peaks
        for name, pid in self.pids.items():
            rss = read_rss(pid)
            if rss is None:
                p.sample_errors.append(f"{name} (pid {pid}) gone")
                continue
            old = p.peak[name]
            p.peak[name] = Rss(
                max(old.total, rss.total), max(old.anon, rss.anon), max(old.shmem, rss.shmem)
            )
        try:
            p.store_peak = max(p.store_peak, object_store_used())
        except Exception as exc:  # a slow raylet reply is a lost sample, not a failure
            p.sample_errors.append(f"object store: {type(exc).__name__}: {exc}")
        p.samples += 1


def actor_pids(manager: Any, tiers: dict[str, Any]) -> dict[str, int]:
    """`{"StorageManager": pid, "cpu": pid, ...}` from the GCS actor table."""
    from soak_workload import actor_pid

    out = {"StorageManager": actor_pid(manager)}
    out.update({name: actor_pid(handle) for name, handle in tiers.items()})
    return out


def fmt_mib(n: float) -> str:
    return f"{n / MIB:7.1f} MiB"
