"""Background stores: the caller copies its KV into a staging ring and goes on.

`ray.put` runs at ~1-2 GB/s on a small machine and the manager call adds a round trip,
so a store that waits for both blocks the serving engine for 10-50x the time of one
memcpy. A `Stager` takes the request's bytes with one copy into a preallocated ring
(warm pages, no allocation per store) and a single worker thread does the `ray.put`
and the manager call in order. The ring is the staging budget: when it is full, a
new store is dropped and counted, the caller never waits. A chunk is served only once
the CPU tier has it (the manager indexes it from the tier's ack), as before.

Ray-free: the worker runs whatever `submit` is given.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ALIGN = 64  # regions start on a cache line


class StagingRing:
    """A ring of `capacity` bytes: regions are taken at the tail and may be given back in
    any order (stores staged by several threads reach the worker in the order they were
    queued, not taken); a region's bytes are reused only once every older region is back
    too. The memory is allocated on first use and its pages stay warm, so staging a
    store costs one memcpy."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"staging capacity must be > 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self._buf: np.ndarray | None = None
        self._head = 0  # start of the oldest region in use
        self._tail = 0  # where the next region starts
        self._used = 0  # bytes held by regions, padding skipped at a wrap included (stats)
        # [start, bytes incl. padding, given back] of the regions not yet reusable
        self._regions: deque[list[Any]] = deque()
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        """A region of `nbytes` (its token and its bytes), or None if it does not fit now."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            if self._buf is None:
                self._buf = np.empty(self.capacity, dtype=np.uint8)
            if size > self.capacity:
                return None
            start, pad = self._tail, 0
            if self._regions and self._tail <= self._head:  # wrapped: room up to the head
                fits = self._head - self._tail >= size
            elif start + size <= self.capacity:
                fits = True
            else:  # no room at the end: skip to the front (something is in use: head > 0)
                pad, start = self.capacity - start, 0
                fits = self._head >= size
            if not fits:
                return None
            self._tail = (start + size) % self.capacity
            self._used += pad + size
            self._regions.append([start, pad + size, False])
            return start, self._buf[start : start + nbytes]

    def give_back(self, token: int) -> None:
        """Return the region that starts at `token` (the token `take` gave)."""
        with self._lock:
            region = next((r for r in self._regions if r[0] == token and not r[2]), None)
            if region is None:
                raise RuntimeError(f"no staging region in use starts at {token}")
            region[2] = True
            while self._regions and self._regions[0][2]:  # the oldest ones are free again
                self._used -= self._regions.popleft()[1]
            if self._regions:
                self._head = self._regions[0][0]
            else:
                self._head = self._tail = 0


def copy_buffers(region: np.ndarray, buffers: Sequence[np.ndarray]) -> None:
    """Copy flat uint8 `buffers` into `region`, back to back."""
    off = 0
    for buf in buffers:
        n = buf.nbytes
        np.copyto(region[off : off + n], buf.reshape(-1).view(np.uint8))
        off += n


def _send_nothing(_region: np.ndarray, done: Callable[[], None]) -> None:
    done()


class SerialWorker:
    """One daemon thread that runs submitted jobs in order, started on first use (and
    again after a fork lost it). A job's exception is logged and the next job runs;
    `drain` waits until every job submitted so far has run."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._name = name
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, job: Callable[[], Any]) -> None:
        with self._idle:
            self._pending += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as exc:  # the job's own failure handling let it through
                logger.debug("raykv %s: a job failed (%s)", self._name, exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued (up to `timeout`), then stop the thread."""
        ok = self.drain(timeout)
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
        return ok


class Stager:
    """A `SerialWorker` that runs staged stores in order, with a bounded ring of bytes.

    `stage(nbytes, fill, send)`: takes a region, calls `fill(region, offset)` in the
    caller's thread (the one copy; `offset` is where the region starts in the ring, the
    same memory each time it comes round), then the worker calls `send(region)` (the
    `ray.put` and the manager call), and gives the region back once `send` says the
    bytes are out of it.
    """

    def __init__(self, capacity: int, name: str = "raykv-stager") -> None:
        self.ring = StagingRing(capacity)
        self._worker = SerialWorker(name)
        self.staged = 0
        self.dropped = 0
        self.failed = 0

    def stage(
        self,
        nbytes: int,
        fill: Callable[[np.ndarray, int], None],
        send: Callable[[np.ndarray, Callable[[], None]], None],
    ) -> bool:
        """Stage one store; False (and counted) if the ring is full right now.

        `send(region, done)` runs on the worker and must call `done()` once the region's
        bytes are no longer needed (after the `ray.put`), so the ring can be reused while
        the manager call is still out. An exception in `fill` propagates to the caller
        (bad input); one in `send` is logged and counted (a fault costs the store).
        """
        got = self.ring.take(nbytes)
        if got is None:
            self.dropped += 1
            return False
        token, region = got
        try:
            fill(region, token)
        except BaseException:
            self._queue(token, region, _send_nothing)  # regions go back in order
            raise
        self.staged += 1
        self._queue(token, region, send)
        return True

    def _queue(self, token: int, region: np.ndarray, send: Callable[..., Any]) -> None:
        self._worker.submit(lambda: self._send(token, region, send))

    def _send(self, token: int, region: np.ndarray, send: Callable[..., Any]) -> None:
        released = False

        def done() -> None:
            nonlocal released
            if not released:
                released = True
                self.ring.give_back(token)

        try:
            send(region, done)
        except Exception:
            self.failed += 1
            logger.exception("raykv background store failed; those chunks are not cached")
        finally:
            done()

    @property
    def pending(self) -> int:
        return self._worker.pending

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every staged store has been sent; False on timeout."""
        return self._worker.drain(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Send what is staged (up to `timeout`), then stop the worker."""
        return self._worker.close(timeout)

    def stats(self) -> dict[str, int]:
        return {
            "staging_capacity_bytes": self.ring.capacity,
            "staging_used_bytes": self.ring.used,
            "staged_stores": self.staged,
            "dropped_stores": self.dropped,
            "failed_stores": self.failed,
            "pending_stores": self._worker.pending,
        }


class BufferPool:
    """Flat uint8 buffers kept for reuse, by size, up to `capacity` bytes in all: a copy
    into a buffer that was written before costs a memcpy, one into fresh memory also
    pays its page faults (about as much again). Not thread-safe: the caller locks."""

    def __init__(self, capacity: int, alloc: Callable[[int], np.ndarray] | None = None) -> None:
        self.capacity = capacity
        self.held = 0
        self._free: dict[int, list[np.ndarray]] = {}
        # Makes a new buffer of n bytes: plain memory, or pinned memory for device copies.
        self.alloc = alloc or (lambda n: np.empty(n, dtype=np.uint8))

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of `nbytes`: a kept one if any, else a new one."""
        kept = self._free.get(nbytes)
        if kept:
            self.held -= nbytes
            return kept.pop()
        return self.alloc(nbytes)

    def give(self, buf: np.ndarray) -> None:
        """Keep `buf` for a later `take` (dropped when the pool is full)."""
        if self.held + buf.nbytes <= self.capacity:
            self._free.setdefault(buf.nbytes, []).append(buf)
            self.held += buf.nbytes


def pinned_buffer(nbytes: int) -> np.ndarray:
    """A flat uint8 buffer in pinned host memory (`BufferPool.alloc` for a CUDA engine's
    device->host copies, which run async only into pinned memory)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


__all__ = ["BufferPool", "SerialWorker", "Stager", "StagingRing", "copy_buffers", "pinned_buffer"]
