"""Fault injection during a soak: kill every actor in turn (ray.kill and SIGKILL by PID),
stop and restart redis-server, truncate / corrupt / replace disk files, fill the disk.

After each fault the test measures how long until (a) the clients' retrieves hit again
and (b) a probe (store a fresh prompt, then find it in the faulted tier) succeeds, and
what the fault cost (client misses). Throughout: no client ever sees an exception and
no wrong byte is ever returned. The printed report lists every fault.
"""

from __future__ import annotations

import os
import pickle
import resource
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from soak_workload import C, Corpus, Workload, chunk_tensor, sigkill_actor, wait_until

import raykv
from raykv.actors.base import STORAGE_MANAGER_NAME
from raykv.actors.factory import shutdown_namespace
from raykv.tiers.chunkfiles import SUFFIX
from raykv.wire import PackedSpans

pytestmark = [pytest.mark.stress, pytest.mark.usefixtures("ray_session")]

GIB = 1 << 30
RECOVERY_BOUND_S = 30.0  # every fault must recover within this (the measured times are printed)
SETTLE_S = 1.5  # traffic after recovery that still counts towards the fault's cost


class _Marker:
    """Unpickling this creates a marker file: proof that raykv unpickled remote data."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def pickle_bomb(marker: Path) -> bytes:
    return pickle.dumps(_Marker(str(marker)))


@dataclass
class Outcome:
    name: str
    detail: str
    probe_s: float | None  # until the faulted tier serves a fresh chunk again
    client_hit_s: float | None  # until a client's retrieve hits again
    misses: int
    ops: int
    errors: int
    wrong: int

    def line(self) -> str:
        def s(v: float | None) -> str:
            return "  never" if v is None else f"{v:6.2f}s"

        return (
            f"  {self.name:24s} recovered in {s(self.probe_s)} (client hits back in "
            f"{s(self.client_hit_s)}); cost: {self.misses:5d} miss chunks over "
            f"{self.ops:4d} ops, errors {self.errors}, wrong {self.wrong}; {self.detail}"
        )


class FaultRunner:
    """Injects faults into a running workload and measures recovery and cost."""

    def __init__(self, wl: Workload, kwargs: dict[str, Any]) -> None:
        self.wl = wl
        self.kwargs = kwargs
        self.admin = raykv.connect(**kwargs)
        self.manager = ray.get_actor(STORAGE_MANAGER_NAME, namespace=kwargs["namespace"])
        self.tiers: dict[str, Any] = ray.get(self.manager.tier_handles.remote())
        self.rng = np.random.default_rng(12345)
        self.outcomes: list[Outcome] = []

    def close(self) -> None:
        self.admin.close()

    # ----- probes -----

    def probe(self, tier: str) -> bool:
        """Store a fresh prompt; True once `tier` holds it (CPU: a verified retrieve)."""
        tokens = self.rng.integers(0, 50_000, 2 * C)
        kv = self.admin
        spans = kv.spans(tokens)
        kv.store(tokens, [chunk_tensor(s.key) for s in spans])
        if tier == "any":
            import torch

            dest = torch.zeros(2, 2, 2 * C, 64, dtype=torch.float16)
            mask = kv.retrieve(tokens, dest)
            want = [chunk_tensor(s.key) for s in spans]
            return bool(mask.all()) and all(
                torch.equal(dest[:, :, s.start : s.end].view(torch.int16), w.view(torch.int16))
                for s, w in zip(spans, want, strict=True)
            )
        kv.flush(5.0)
        ref = self.manager.lookup.remote(PackedSpans.of(spans), False, [tier])
        return ray.get(ref, timeout=5.0) == spans[-1].end

    def stats(self, tier: str) -> dict[str, Any]:
        return self.admin.stats().get("tiers", {}).get(tier, {})

    # ----- one fault -----

    def run(
        self,
        name: str,
        inject: Callable[[], str],
        tier: str,
        restore: Callable[[], str] | None = None,
        hold_s: float = 0.0,
    ) -> Outcome:
        before = self.wl.snapshot()
        t0 = time.monotonic()
        detail = inject()
        if hold_s:
            time.sleep(hold_s)
        if restore is not None:
            detail += "; " + restore()
        t_up = time.monotonic()
        probe = wait_until(lambda: self.probe(tier), RECOVERY_BOUND_S)
        probe_s = None if probe is None else probe + (t_up - t0)
        client = wait_until(lambda: self.wl.c.last_hit > t0, RECOVERY_BOUND_S, every=0.05)
        client_s = None if client is None else max(0.0, self.wl.c.last_hit - t0)
        time.sleep(SETTLE_S)
        after = self.wl.snapshot()
        out = Outcome(
            name,
            detail,
            probe_s,
            client_s,
            after["miss_chunks"] - before["miss_chunks"],
            after["ops"] - before["ops"],
            after["errors"] - before["errors"],
            after["wrong_chunks"] - before["wrong_chunks"],
        )
        self.outcomes.append(out)
        print(out.line(), flush=True)
        return out

    # ----- the faults -----

    def kill(self, tier: str, how: str) -> Callable[[], str]:
        classes = {
            "cpu": "CPUStoreActor",
            "disk": "DiskStoreActor",
            "remote": "RemoteStoreActor",
            "manager": "StorageManager",
        }

        def inject() -> str:
            self.tiers = ray.get(self.manager.tier_handles.remote(), timeout=30)
            handle = self.manager if tier == "manager" else self.tiers[tier]
            if how == "ray.kill":
                ray.kill(handle, no_restart=False)
                return "ray.kill(no_restart=False)"
            pid = sigkill_actor(handle, classes[tier])
            return f"SIGKILL pid {pid}"

        return inject


def _disk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{SUFFIX}"))


def corrupt_disk(root: Path, rng: np.random.Generator, n: int = 12) -> str:
    """Truncate a third of `n` random chunk files, flip bytes in a third, zero the header of
    the rest; all in place, so the index still names them."""
    files = _disk_files(root)
    picked = rng.choice(len(files), size=min(n, len(files)), replace=False) if files else []
    counts = {"truncated": 0, "flipped": 0, "header": 0}
    for j, i in enumerate(picked):
        path = files[int(i)]
        try:
            size = path.stat().st_size
            if size == 0:  # already emptied by an earlier fault; nothing left to corrupt
                continue
            if j % 3 == 0:
                os.truncate(path, int(rng.integers(0, size)))
                counts["truncated"] += 1
            else:
                with open(path, "r+b") as f:
                    if j % 3 == 1:
                        for pos in rng.integers(0, size, 8):
                            f.seek(int(pos))
                            b = f.read(1)
                            f.seek(int(pos))
                            f.write(bytes([b[0] ^ 0xFF]) if b else b"\x00")
                        counts["flipped"] += 1
                    else:
                        f.write(b"\x00" * 64)
                        counts["header"] += 1
        except FileNotFoundError:
            continue  # evicted meanwhile
    return ", ".join(f"{v} {k}" for k, v in counts.items())


def replace_with_garbage(root: Path, rng: np.random.Generator, marker: Path, n: int = 8) -> str:
    """Overwrite random chunk files with random bytes or a pickle bomb (atomically, by rename),
    and drop stray files (bad names, a FIFO, a symlink) into the shard directories."""
    files = _disk_files(root)
    picked = rng.choice(len(files), size=min(n, len(files)), replace=False) if files else []
    for j, i in enumerate(picked):
        path = files[int(i)]
        data = pickle_bomb(marker) if j % 2 else rng.integers(0, 256, 4096, np.uint8).tobytes()
        tmp = path.with_name(path.name + ".garbage")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    shard = files[0].parent if files else root
    (shard / "not-a-key.rkv").write_bytes(b"garbage")
    (shard.parent / "escape.rkv").write_bytes(b"garbage")
    others = [f for k, f in enumerate(files) if k not in set(int(i) for i in picked)]
    if len(others) >= 2:
        # Special files under chunks' names: reading them must not hang or follow the link.
        os.unlink(others[0])
        os.mkfifo(others[0])
        os.unlink(others[1])
        os.symlink("/dev/zero", others[1])
    return f"{len(picked)} files replaced (half by a pickle bomb), a FIFO, a symlink, 2 strays"


def test_faults_during_soak_cost_misses_never_errors_or_wrong_bytes(
    tmp_path: Path, redis_server: Any
) -> None:
    ns = f"faults-{uuid.uuid4().hex[:8]}"
    disk = tmp_path / "disk"
    marker = tmp_path / "unpickled-marker"
    kwargs = {
        "namespace": ns,
        "chunk_size": C,
        "kv_dtype": "float16",
        "max_local_cpu_size": (1 << 20) / GIB,
        "local_disk": str(disk),
        "max_local_disk_size": (4 << 20) / GIB,
        "remote_url": redis_server.url,
        "lookup_timeout_ms": 2000,
        "blocking_timeout_secs": 0.5,
        "pin_lease_secs": 3.0,
    }
    kv_ns = f"faults-kv-{uuid.uuid4().hex[:8]}"
    kv_server = f"soak-kvserver-{uuid.uuid4().hex[:6]}"
    kwargs_kv = {**kwargs, "namespace": kv_ns, "remote_url": f"ray://{kv_server}"}
    kwargs_kv["local_disk"] = str(tmp_path / "disk-kv")
    report: list[str] = []
    t_start = time.monotonic()
    try:
        wl = Workload(kwargs, n_clients=8, corpus=Corpus(seed=1), seed=1)
        runner = FaultRunner(wl, kwargs)
        wl.start()
        try:
            time.sleep(5.0)  # warm up: every tier holds data
            print(f"\n== faults during a soak: cpu + disk + redis ({ns}) ==", flush=True)
            for how in ("ray.kill", "SIGKILL"):
                runner.run(f"kill CPUStore ({how})", runner.kill("cpu", how), "any")
            entries = runner.stats("disk").get("entries", 0)
            runner.run(
                "replace disk files",
                lambda: replace_with_garbage(disk, runner.rng, marker),
                "disk",
            )
            for how in ("ray.kill", "SIGKILL"):
                runner.run(f"kill DiskStore ({how})", runner.kill("disk", how), "disk")
            rebuilt = runner.stats("disk").get("entries", 0)
            report.append(f"disk index: {entries} entries before the kills, {rebuilt} after")
            for how in ("ray.kill", "SIGKILL"):
                runner.run(f"kill StorageManager ({how})", runner.kill("manager", how), "any")
            runner.run("kill RemoteStore (SIGKILL)", runner.kill("remote", "SIGKILL"), "remote")
            runner.run(
                "redis-server stop/start",
                lambda: (redis_server.stop(), "redis stopped")[1],
                "remote",
                restore=lambda: (redis_server.start(), "restarted on the same port")[1],
                hold_s=3.0,
            )
            runner.run(
                "truncate/corrupt disk files",
                lambda: corrupt_disk(disk, runner.rng),
                "disk",
            )
            runner.run(*disk_full(runner, disk), hold_s=3.0)
            errors_seen = runner.stats("disk").get("errors", 0)
            report.append(f"disk tier errors counted (corrupt reads, failed writes): {errors_seen}")
        finally:
            wl.stop()
            runner.close()
        report.append(
            wl.report("soak with faults (cpu + disk + redis)", time.monotonic() - t_start)
        )
        outcomes = list(runner.outcomes)

        # The ray:// KVServer back end: same workload, kill the server itself.
        wl2 = Workload(kwargs_kv, n_clients=8, corpus=Corpus(seed=2), seed=2)
        runner2 = FaultRunner(wl2, kwargs_kv)
        server = ray.get_actor(kv_server, namespace=kv_ns)
        t2 = time.monotonic()
        wl2.start()
        try:
            time.sleep(4.0)
            print(f"== faults during a soak: cpu + disk + ray:// KVServer ({kv_ns}) ==", flush=True)
            for how in ("ray.kill", "SIGKILL"):

                def inject(how: str = how) -> str:
                    if how == "ray.kill":
                        ray.kill(server, no_restart=False)
                        return "ray.kill(no_restart=False); its data is lost"
                    return f"SIGKILL pid {sigkill_actor(server, 'KVServer')}; its data is lost"

                runner2.run(f"kill KVServer ({how})", inject, "remote")
        finally:
            wl2.stop()
            runner2.close()
        report.append(wl2.report("soak with faults (cpu + disk + ray://)", time.monotonic() - t2))
        outcomes += runner2.outcomes

        print("\n".join(["", "== fault report =="] + [o.line() for o in outcomes] + report))
        for w in (wl, wl2):
            assert w.c.errors == [], w.c.errors[:3]
            assert w.c.wrong_chunks == 0
        assert not marker.exists(), "a pickle placed on disk was unpickled"
        never = [o.name for o in outcomes if o.probe_s is None or o.client_hit_s is None]
        assert not never, f"did not recover within {RECOVERY_BOUND_S} s: {never}"
        assert rebuilt > 0, "the restarted DiskStore did not rebuild its index from its files"
    finally:
        shutdown_namespace(ns)
        shutdown_namespace(kv_ns)
        try:
            ray.kill(ray.get_actor(kv_server, namespace=kv_ns), no_restart=True)
        except ValueError:
            pass


def disk_full(runner: FaultRunner, disk: Path) -> tuple[Any, ...]:
    """Fill the disk for real: a 1 KiB RLIMIT_FSIZE on the DiskStore's process makes every
    chunk write fail with EFBIG (Python ignores SIGXFSZ), as a quota would."""
    from soak_workload import actor_pid

    state: dict[str, Any] = {}

    def inject() -> str:
        pid = actor_pid(runner.tiers["disk"])
        state["pid"] = pid
        state["old"] = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        state["errors"] = runner.stats("disk").get("errors", 0)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1024, state["old"][1]))
        return f"RLIMIT_FSIZE=1KiB on pid {pid}"

    def restore() -> str:
        failed = runner.stats("disk").get("errors", 0) - state["errors"]
        try:
            resource.prlimit(state["pid"], resource.RLIMIT_FSIZE, state["old"])
        except ProcessLookupError:
            return f"{failed} writes failed; the actor had restarted"
        return f"{failed} writes failed while full; limit lifted"

    return ("disk full (EFBIG)", inject, "disk", restore)
