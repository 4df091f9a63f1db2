"""Process-wide C allocator settings for processes that read chunks into fresh buffers.

A disk read fills a new buffer of the chunk's size, which is freed once the caller has
copied it on (into the object store). glibc hands out blocks over its mmap threshold
(128 KiB at start, raised dynamically) as fresh mappings and gives freed heap above its
trim threshold back to the kernel, so a tier reading 2 MiB chunks faulted in every page
of every buffer again: measured on 32 x 2 MiB cached reads, 15k minor faults and 32 ms
per batch against 3-4k and 12 ms for plain reads in the same process; with the settings
below, 50-150 faults and 12 ms (the plain reads 7 ms).

Kept freed heap is a step in the process's memory after a burst of reads (the remote
store's USS went 106 -> 131 MiB in the 30-minute soak, when it served reads while the
CPU store was down) that would stay for days: `IdleTrim` gives it back to the kernel
once the reads have stopped for `IDLE_TRIM_SECS`.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (and are reused), not from a new mapping;
# above the largest chunk a tier reads in one piece at the default chunk sizes.
MMAP_THRESHOLD_BYTES = 64 << 20
# Freed heap kept for reuse before any is given back to the kernel: bounds what the
# process holds beyond its live buffers.
TRIM_THRESHOLD_BYTES = 256 << 20
# Seconds without a read after which a reading actor gives its freed heap back.
IDLE_TRIM_SECS = 10.0


def _glibc() -> Any:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def reuse_freed_buffers() -> bool:
    """Make this process's glibc reuse freed chunk-sized buffers instead of unmapping
    them (see the module docstring). Returns False, changing nothing, where the C
    library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError) as exc:
        logger.debug("mallopt unavailable: %s", exc)
        return False
    return ok


class IdleTrim:
    """Gives the process's freed heap back to the kernel (`malloc_trim`) once no read
    was noted for `idle_s` seconds, from a daemon thread; a burst of reads keeps its
    buffers for reuse while it lasts. `note()` is one attribute store (any thread)."""

    def __init__(self, idle_s: float = IDLE_TRIM_SECS) -> None:
        self.idle_s = idle_s
        self.trims = 0
        self._last_read = 0.0
        self._trimmed = True  # nothing read since the last trim
        self._libc = _glibc()
        if self._libc is not None:
            threading.Thread(target=self._run, name="raykv-idle-trim", daemon=True).start()

    def note(self) -> None:
        """A read just allocated buffers."""
        self._last_read = time.monotonic()
        self._trimmed = False

    def _run(self) -> None:
        while True:
            time.sleep(self.idle_s / 2)
            if self._trimmed or time.monotonic() - self._last_read < self.idle_s:
                continue
            self._trimmed = True
            try:
                self._libc.malloc_trim(0)
                self.trims += 1
            except (OSError, AttributeError) as exc:  # pragma: no cover - not glibc
                logger.debug("malloc_trim unavailable: %s", exc)
                return


__all__ = [
    "IDLE_TRIM_SECS",
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "IdleTrim",
    "reuse_freed_buffers",
]
