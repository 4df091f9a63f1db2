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
