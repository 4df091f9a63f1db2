"""`reuse_freed_buffers`: a process reading chunks into fresh buffers stops faulting
every page in again (checked by minor-fault counts in fresh processes)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

READS = """
import json, os, resource, sys, tempfile
import numpy as np
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta
from raykv.tiers.disk import DiskStore
from raykv.actors.memory import reuse_freed_buffers

applied = reuse_freed_buffers() if sys.argv[1] == "on" else None
meta = PayloadMeta("uint8", (2, 1, 1024, 1024))  # 2 MiB chunks
keys = [CacheKey("m", 1, 0, f"{i:032x}", "uint8") for i in range(16)]
arrays = [np.full(meta.nbytes, i, dtype=np.uint8) for i in range(16)]
store = DiskStore(tempfile.mkdtemp(), 1 << 30)
store.put(keys, [meta] * 16, arrays)
store.flush()
store.get(keys)  # warm: the files are in the page cache
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    got = store.get(keys)
    assert all(np.array_equal(g[1], a) for g, a in zip(got, arrays))
    del got
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
store.close()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", READS, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_reads_stop_faulting_in_fresh_pages_once_freed_buffers_are_reused() -> None:
    off, on = faults("off"), faults("on")
    assert on["applied"] is True
    # 5 x 16 x 2 MiB read: every page of every buffer (~40k faults) without, few with
    assert on["faults"] < off["faults"] / 4, (on, off)


TRIM = """
import json, time
import numpy as np
from raykv.actors.memory import IdleTrim, reuse_freed_buffers

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

assert reuse_freed_buffers()
trim = IdleTrim(idle_s=0.3)
base = rss_mib()
trim.note()
bufs = [np.ones(2 << 20, dtype=np.uint8) for _ in range(64)]  # a burst of 2 MiB reads
del bufs
kept = rss_mib()  # freed, but kept for reuse
time.sleep(0.1)
busy = rss_mib()  # read again within idle_s: still kept
trim.note()
deadline = time.monotonic() + 5
while trim.trims == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"base": base, "kept": kept, "busy": busy, "after": rss_mib(),
                  "trims": trim.trims}))
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_read_buffers_go_back_to_the_kernel_once_reads_stop() -> None:
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept"] - got["base"] > 100, got  # 128 MiB freed and kept while reads go on
    assert got["busy"] - got["base"] > 100, got
    assert got["trims"] == 1 and got["after"] - got["base"] < 32, got  # given back when idle
