"""L2: the local disk tier. One file per chunk, written in the background, atomic, checksummed.

Layout (diskcache-like)::

    <local_disk>/<layout digest>/<first 2 hex digits of the chunk hash>/<key string>.rkv

The layout digest covers (model_name, layout, kv_dtype, chunk_size), so two models or
chunkings never mix. A file holds one `raykv.payload` codec record (header with the key
string and checksums, then the raw bytes). It is written to a hidden temp file in the
same directory and renamed into place with `os.replace`, so a visible `.rkv` file is
always complete; a crash leaves at most a temp file, which `check(fix=True)` removes.

`DiskStore` is a plain, thread-safe class that does all the work (unit-tested without
Ray); `DiskStoreActor` is a thin threaded Ray actor around one instance. The lock only
guards the in-memory index: no file I/O and no waiting happens while it is held.
Whoever is about to unlink a key's final file marks the key "deleting" first, and a put
of a deleting key is skipped, so an unlink never races with a new write of the same key.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from raykv import metrics
from raykv.errors import InvalidInputError, PayloadError
from raykv.keys import CacheKey
from raykv.payload import (
    EMPTY,
    LAYOUT_KV_2LTD,
    PayloadMeta,
    buffer_problem,
    decode,
    encode_parts,
    secret_tag,
)
from raykv.tiers.budget import (
    DEFAULT_EXPECTED_CHUNK_BYTES,
    ByteBudgetIndex,
    check_priority,
    check_put_lengths,
)
from raykv.tiers.chunkfiles import (
    DISK_FULL,
    SUFFIX,
    ChunkFiles,
    KeyParser,
    file_name,
    unlink,
)
from raykv.tiers.disk_scan import DiskScan
from raykv.wire import TIER_DISK, PutAck

logger = logging.getLogger(__name__)

# Batches whose chunks average at least this many bytes are read on the read pool.
PARALLEL_READ_BYTES = 512 << 10
# Files get the policy's recency as mtimes in batches this long after it changed.
STAMP_DELAY_S = 2.0
# `put_written` reports a write still running after this long as skipped.
WRITTEN_ACK_TIMEOUT_SECS = 120.0


def layout_digest(
    model_name: str, layout: str, kv_dtype: str, chunk_size: int, secret_name: str = ""
) -> str:
    """16 hex digits naming the directory of one (model, layout, dtype, chunk size) and
    `payload_secret` (its public `secret_tag`; none: the plain records' directory), so
    deployments keyed apart never index, evict or delete each other's files."""
    parts = (
        model_name,
        layout,
        kv_dtype,
        str(chunk_size),
        *((secret_name,) if secret_name else ()),
    )
    return xxhash.xxh3_64_hexdigest("\x00".join(parts).encode("utf-8"))


@functools.lru_cache(maxsize=256)
def _header_len(dtype: str, shape0: int, ndim: int, layout: str, key: str) -> int:
    # The header's length depends on ndim and the key only: encode a one-element probe.
    meta = PayloadMeta(dtype, (shape0,) + (1,) * (ndim - 1), layout)
    head, _ = encode_parts(np.zeros(meta.nbytes, np.uint8), meta, key)
    return len(head)


def record_size(meta: PayloadMeta, key: CacheKey) -> int:
    """Bytes of the file holding one chunk: codec header plus body."""
    shape0 = meta.shape[0] if meta.shape else 0
    return _header_len(meta.dtype, shape0, len(meta.shape), meta.layout, key.to_string()) + (
        meta.nbytes
    )


@dataclass(slots=True, eq=False)
class _Pending:
    """A write in flight: the caller's array is held until the file is complete."""

    key: CacheKey
    meta: PayloadMeta
    array: np.ndarray | None
    reserved: int
    tmp_path: str
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)  # set when it ended
    stamp_ns: int = 0  # the file's mtime once complete (`DiskStore._stamps`)


class DiskStore(DiskScan):
    """The disk tier's logic: index, byte budget, policy, background writer, reader.

    Thread-safe. `put` admits chunks synchronously (evicting files to make room, so the
    evicted keys come back in the `PutAck`) and writes them on a bounded thread pool; a
    key becomes visible to `contains`/`get` only once its file is complete. A corrupt,
    truncated or vanished file is a miss (and is removed), never an exception.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        model_name: str = "default",
        kv_dtype: str = "bfloat16",
        chunk_size: int = 256,
        layout: str = LAYOUT_KV_2LTD,
        policy: str = "lru",
        write_workers: int = 2,
        max_pending_writes: int = 64,
        fsync: bool = False,
        queue_wait_s: float = 1.0,
        expected_chunk_bytes: int = DEFAULT_EXPECTED_CHUNK_BYTES,
        read_workers: int = 2,
        payload_secret: str | None = None,
        files: type[ChunkFiles] = ChunkFiles,
    ) -> None:
        if payload_secret is not None and not payload_secret:
            raise InvalidInputError("payload_secret must be None or a non-empty string")
        if write_workers < 1 or max_pending_writes < 1:
            raise InvalidInputError(
                f"write_workers={write_workers} and max_pending_writes={max_pending_writes} "
                "must both be >= 1"
            )
        self.directory = os.path.join(
            os.path.abspath(os.fspath(root_dir)),
            layout_digest(
                model_name,
                layout,
                kv_dtype,
                chunk_size,
                secret_tag(payload_secret) if payload_secret else "",
            ),
        )
        self._layout = {
            "model_name": model_name,
            "layout": layout,
            "kv_dtype": kv_dtype,
            "chunk_size": chunk_size,
        }
        self._fsync = fsync
        # Files are keyed (HMAC) records when set: see raykv.payload. Never shown anywhere.
        self._secret = payload_secret
        self._queue_wait_s = queue_wait_s
        self._index = ByteBudgetIndex(capacity_bytes, policy, expected_chunk_bytes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stamps_due: dict[CacheKey, int] = {}  # mtimes not yet given (`_note_stamps`)
        self._stamp_timer: threading.Timer | None = None
        self._pending: dict[CacheKey, _Pending] = {}
        self._deleting: set[CacheKey] = set()
        self._finishing = 0  # cancelled writes whose file is still being removed
        self._slots = threading.BoundedSemaphore(max_pending_writes)
        self._pool = ThreadPoolExecutor(write_workers, thread_name_prefix="raykv-disk-write")
        self._read_pool = (
            ThreadPoolExecutor(read_workers, thread_name_prefix="raykv-disk-read")
            if read_workers > 1
            else None
        )
        self._parse = KeyParser()
        self._counts = dict.fromkeys(
            ("hits", "misses", "evictions", "errors", "skipped", "stored_bytes"), 0
        )
        self.incarnation = uuid.uuid4().hex
        self._closed = False
        # How records reach files (a subclass injected by tests: a full disk, a torn file).
        self._files = files(self.directory, fsync=fsync)
        self._files.write_layout_file(self._layout)
        self._rebuild()

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> DiskStore:
        """A store for `config.local_disk` sized by `max_local_disk_size`.

        Every other setting comes from its `config` field (`disk_write_workers`,
        `disk_fsync`, `disk_queue_wait_secs`, ...); `overrides` (constructor keywords) win.
        """
        if not config.local_disk:
            raise InvalidInputError("local_disk is not set; the disk tier is disabled")
        kwargs: dict[str, Any] = {
            "model_name": config.model_name,
            "kv_dtype": config.kv_dtype,
            "chunk_size": config.chunk_size,
            "policy": config.policy_for(TIER_DISK),
            "write_workers": config.disk_write_workers,
            "max_pending_writes": config.disk_max_pending_writes,
            "fsync": config.disk_fsync,
            "queue_wait_s": config.disk_queue_wait_secs,
            "payload_secret": config.payload_secret,
        }
        kwargs.update(overrides)
        return cls(config.local_disk, config.max_local_disk_bytes, **kwargs)

    def __repr__(self) -> str:
        return (
            f"DiskStore({self.directory!r}, entries={len(self._index)}, "
            f"used={self._index.used}/{self._index.capacity})"
        )

    def path_of(self, key: CacheKey) -> str:
        """The final file of `key`; `InvalidInputError` for a key that is no safe file name."""
        return self._files.path_of(key)

    # ----- writes -----

    def put(
        self,
        keys: Sequence[CacheKey],
        metas: Sequence[PayloadMeta],
        arrays: Sequence[np.ndarray],
        priority: float | None = None,
        prefix: Sequence[CacheKey] = (),
    ) -> PutAck:
        """Admit chunks (evicting to make room) and write them in the background.

        `keys` are one request's chunks in order; `prefix` names the request's chunks
        before `keys[0]` when the caller sends only the new ones. A key already held or
        being written is accepted without a rewrite. The request's chain (`prefix` +
        `keys`) stays prefix-closed: its held chunks are not evicted to make room for
        its new ones, and once the new files are complete the chain is placed deepest
        first (see `ByteBudgetIndex.place`); new chunks enter the policy with `priority`.
        When the write queue is full, waits for a slot until one deadline,
        `queue_wait_s` after the call, for the whole put; once it passed, the remaining
        chunks are skipped.
        """
        check_put_lengths(keys, metas, arrays)
        check_priority(priority)
        if self._closed:
            raise InvalidInputError("put on a closed DiskStore")
        ack = PutAck()
        chain = [*prefix, *keys]
        stamps = self._stamps(chain)
        deadline = time.monotonic() + self._queue_wait_s
        queue_full = 0
        with self._lock:
            self._index.spare(chain)
        try:
            for key, meta, array in zip(keys, metas, arrays, strict=True):
                if queue_full:
                    ack.skipped.append(key)
                    queue_full += 1
                elif not self._put_one(key, meta, array, ack, deadline, stamps[key]):
                    queue_full = 1
        finally:
            with self._lock:
                self._index.place(chain, priority, spared=True)
                # its held chunks now; a new one's write stamps its file once complete
                self._note_stamps((k, ns) for k, ns in stamps.items() if k in self._index)
        if queue_full:
            logger.warning(
                "disk tier: write queue full for %.1f s, skipping %d chunk(s)",
                self._queue_wait_s,
                queue_full,
            )
        if ack.skipped:
            self._count("skipped", len(ack.skipped))
            metrics.inc("raykv_skipped_stores", len(ack.skipped), tier=TIER_DISK)
        self._count("evictions", len(ack.evicted))
        self._publish()
        return ack

    def put_written(
        self,
        keys: Sequence[CacheKey],
        metas: Sequence[PayloadMeta],
        arrays: Sequence[np.ndarray],
        priority: float | None = None,
        prefix: Sequence[CacheKey] = (),
        timeout: float = WRITTEN_ACK_TIMEOUT_SECS,
    ) -> PutAck:
        """`put`, acked once its writes ended: `accepted` names only the chunks whose
        files are complete (or were already), so whoever indexes the ack never lists a
        chunk a failed write (ENOSPC, EIO) did not store; those move to `skipped` and a
        later put writes them again. A write still running after `timeout` is reported
        skipped too (the index then learns of it from a later put or a resync)."""
        ack = self.put(keys, metas, arrays, priority, prefix)
        deadline = time.monotonic() + timeout
        with self._lock:
            waits = [self._pending.get(k) for k in ack.accepted]
        for rec in waits:
            if rec is not None:
                rec.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            written = [k for k in ack.accepted if k in self._index]
        if len(written) < len(ack.accepted):
            lost = set(ack.accepted).difference(written)
            ack.skipped.extend(k for k in ack.accepted if k in lost)
            ack.accepted = written
        return ack

    @staticmethod
    def _stamps(chain: Sequence[CacheKey]) -> dict[CacheKey, int]:
        """An mtime for each file of a request's `chain` (shallowest first), the first
        chunk the most recent: a restart orders the policy by mtime (`_rebuild`), so it
        evicts a chain deepest first (with write times, its prefix went first)."""
        now = time.time_ns()
        return {key: now + (len(chain) - j) * 1000 for j, key in enumerate(chain)}

    def _note_stamps(self, stamps: Iterable[tuple[CacheKey, int]]) -> None:
        """Queue mtimes for files (under the lock): applied in one batch off the request
        path `STAMP_DELAY_S` later, and at close (a crash loses at most that much)."""
        self._stamps_due.update(stamps)
        if self._stamp_timer is None and not self._closed:
            self._stamp_timer = threading.Timer(STAMP_DELAY_S, self._apply_stamps)
            self._stamp_timer.daemon = True
            self._stamp_timer.start()

    def _apply_stamps(self) -> None:
        """Give the files their queued mtimes (best effort: one gone meanwhile, or not
        written yet, is skipped; a write stamps its own file once complete)."""
        with self._lock:
            due, self._stamps_due = self._stamps_due, {}
            self._stamp_timer = None
        for key, ns in due.items():
            self._files.stamp(key, ns)

    def _put_one(
        self,
        key: CacheKey,
        meta: PayloadMeta,
        array: np.ndarray,
        ack: PutAck,
        deadline: float,
        stamp_ns: int = 0,
    ) -> bool:
        """Admit one chunk; False only if no write slot freed up before `deadline`."""
        try:
            file_name(key)
        except InvalidInputError as exc:
            logger.warning("disk tier: skipping a chunk: %s", exc)
            ack.skipped.append(key)
            return True
        problem = buffer_problem(array, meta)
        if problem is not None:
            logger.warning("disk tier: skipping %s: %s", key, problem)
            ack.skipped.append(key)
            return True
        state = self._held(key)
        if state is not None:
            (ack.accepted if state else ack.skipped).append(key)
            return True
        try:
            reserve = record_size(meta, key)
        except Exception as exc:  # a meta the codec cannot frame (one that came pickled)
            logger.warning("disk tier: skipping %s: %r", key, exc)
            ack.skipped.append(key)
            return True
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            ack.skipped.append(key)
            return False
        rec: _Pending | None = None
        victims: list[tuple[Hashable, int]] = []
        with self._lock:
            state = self._held(key, locked=True)
            if state is None:
                fits, victims = self._index.reserve(key, reserve)
                self._deleting.update(k for k, _ in victims)
                if fits:
                    tmp = self._files.tmp_path(key)
                    rec = _Pending(key, meta, array, reserve, tmp, stamp_ns=stamp_ns)
                    self._pending[key] = rec
        if rec is None:
            self._slots.release()
            (ack.accepted if state else ack.skipped).append(key)
        else:
            ack.accepted.append(key)
        ack.evicted.extend(k for k, _ in victims)
        self._unlink_keys([k for k, _ in victims])
        if rec is not None:
            try:
                self._pool.submit(self._write, rec)
            except RuntimeError:  # the write pool shut down (a close): nothing is written
                self._abandon(rec)
                ack.accepted.remove(key)
                ack.skipped.append(key)
        return True

    def _abandon(self, rec: _Pending) -> None:
        """Undo a write that was never started: its reservation, pending entry, slot."""
        with self._lock:
            self._pending.pop(rec.key, None)
            self._index.unreserve(rec.key)
            self._notify_if_idle()
        rec.array = None
        rec.done.set()
        self._slots.release()

    def _held(self, key: CacheKey, locked: bool = False) -> bool | None:
        """True if held or being written, False if it must be skipped now, None if new."""
        if not locked:
            with self._lock:
                return self._held(key, locked=True)
        if key in self._index:
            return True
        pending = self._pending.get(key)
        if pending is not None:
            return not pending.cancelled
        if key in self._deleting:
            return False
        return None

    def _write(self, rec: _Pending) -> None:
        """Worker thread: encode, write the temp file, rename it into place, commit."""
        size = -1
        try:
            head, body = encode_parts(rec.array, rec.meta, rec.key.to_string(), secret=self._secret)
            # Neither file is left behind by a failure (a file outside the index and the
            # budget would be an orphan).
            size = self._files.write(rec.key, rec.tmp_path, (head, body))
        except OSError as exc:
            kind = "disk_full" if exc.errno in DISK_FULL else "write"
            logger.warning(
                "disk tier: dropped a write of %d bytes (%s): %s", rec.meta.nbytes, kind, exc
            )
            self._error(kind)
        except Exception as exc:  # a bug or a bad payload must not kill the writer thread
            logger.error("disk tier: write of %s failed: %s", rec.key, exc, exc_info=True)
            self._error("write")
        cancelled = False
        with self._lock:
            self._pending.pop(rec.key, None)
            if size >= 0 and not rec.cancelled:
                self._index.commit(rec.key, size)
                self._counts["stored_bytes"] += size
                if rec.stamp_ns:
                    self._note_stamps([(rec.key, rec.stamp_ns)])
            else:
                self._index.unreserve(rec.key)
                if size >= 0:  # removed while in flight: delete the file just written
                    cancelled = True
                    self._deleting.add(rec.key)
                    self._finishing += 1
            self._notify_if_idle()
        rec.array = None
        rec.done.set()
        self._slots.release()
        if cancelled:
            self._unlink_keys([rec.key])
            with self._lock:
                self._finishing -= 1
                self._notify_if_idle()
        elif size >= 0:
            metrics.inc("raykv_stored_bytes", size, tier=TIER_DISK)
        self._publish()

    def _notify_if_idle(self) -> None:
        if not self._pending and not self._finishing:
            self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending write has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending and not self._finishing, timeout)

    # ----- reads -----

    def get(self, keys: Sequence[CacheKey]) -> list[tuple[PayloadMeta, np.ndarray] | None]:
        """(meta, flat uint8 array) per key, None for a miss; hits are touched deepest first."""
        with self._lock:
            sizes = [self._index.size_of(key) for key in keys]
            # deepest first: see put()
            self._index.touch_prefix([k for k, n in zip(keys, sizes, strict=True) if n is not None])
        found = [key for key, size in zip(keys, sizes, strict=True) if size is not None]
        big = sum(s for s in sizes if s is not None) >= PARALLEL_READ_BYTES * len(found)
        if self._read_pool is not None and len(found) > 1 and big:
            # Large chunks: read (and checksum) several files at once, one per thread.
            loaded = iter(list(self._read_pool.map(self._read, found)))
        else:
            loaded = iter([self._read(key) for key in found])
        out = [next(loaded) if size is not None else None for size in sizes]
        hit = [key for key, item in zip(keys, out, strict=True) if item is not None]
        stamps = self._stamps(hit)
        with self._lock:
            self._note_stamps(stamps.items())  # as recent as the policy has them
        hits = len(hit)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += len(keys) - hits
        return out

    def location(self) -> tuple[str, str]:
        """(directory, `secret_tag` of the records' secret or "": what a reader of the
        files needs to know beside the secret itself)."""
        return self.directory, secret_tag(self._secret) if self._secret else ""

    def touch(self, keys: Sequence[CacheKey]) -> None:
        """Count `keys` (a request's prefix, in order) as hits read by a client from the
        files themselves (`raykv.client.direct`): touched deepest first, as `get` does."""
        with self._lock:
            held = [k for k in keys if self._index.size_of(k) is not None]
            self._index.touch_prefix(held)
            self._note_stamps(self._stamps(held).items())
            self._counts["hits"] += len(held)
            self._counts["misses"] += len(keys) - len(held)

    def get_batch(
        self, keys: Sequence[CacheKey]
    ) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """The `LowerTier.get_batch` shape: metas (None = miss) and arrays (empty = miss)."""
        found = self.get(keys)
        metas = [item[0] if item is not None else None for item in found]
        arrays = [item[1] if item is not None else EMPTY for item in found]
        return metas, arrays

    def _read(self, key: CacheKey) -> tuple[PayloadMeta, np.ndarray] | None:
        path = self.path_of(key)
        with self._lock:
            expected = self._index.size_of(key)
        try:
            data = self._files.read(key, expected, self._index.capacity, self._secret)
            decoded = decode(data, key.to_string(), key.kv_dtype, secret=self._secret)
        except FileNotFoundError:
            logger.info("disk tier: file of %s vanished", key)
            self._drop(key, unlink=False)
            return None
        except (OSError, PayloadError) as exc:
            logger.warning("disk tier: removing unreadable %s: %s", path, exc)
            self._error("corrupt" if isinstance(exc, PayloadError) else "read")
            self._drop(key, unlink=True)
            return None
        return decoded.meta, decoded.data

    def contains(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Which keys have a complete file (pending writes are not yet visible)."""
        with self._lock:
            return [key in self._index for key in keys]

    # ----- removal -----

    def remove(self, keys: Sequence[CacheKey]) -> int:
        """Delete keys (and cancel their pending writes); returns how many were held."""
        doomed: list[CacheKey] = []
        with self._lock:
            for key in keys:
                if self._index.discard(key) is not None:
                    doomed.append(key)
                    self._deleting.add(key)
                elif key in self._pending:
                    self._pending[key].cancelled = True
        self._unlink_keys(doomed)
        self._publish()
        return len(doomed)

    def clear(self) -> None:
        """Delete every chunk of this directory and cancel pending writes."""
        with self._lock:
            doomed = self._index.clear()
            for rec in self._pending.values():
                rec.cancelled = True
            self._deleting.update(doomed)
        self._unlink_keys(doomed)
        for _, entry in self._files.scan():  # files this instance never indexed
            if entry.name.endswith(SUFFIX):
                key = self._parse(entry.name[: -len(SUFFIX)])
                with self._lock:
                    skip = key is not None and (key in self._index or key in self._pending)
                if not skip:
                    unlink(entry.path)
        self._publish()

    def _drop(self, key: CacheKey, unlink: bool) -> None:
        """Forget a key whose file is bad or gone; remove the file if asked."""
        with self._lock:
            self._index.discard(key)
            if unlink and key not in self._pending:
                self._deleting.add(key)
            else:
                unlink = False
        if unlink:
            self._unlink_keys([key])
        self._publish()

    def _unlink_keys(self, keys: list[CacheKey]) -> None:
        """Remove the files of keys already marked deleting, then unmark them."""
        if not keys:
            return
        for key in keys:
            self._files.unlink_key(key)
        with self._lock:
            self._deleting.difference_update(keys)

    # ----- introspection -----

    def keys(self) -> list[CacheKey]:
        """Every key with a complete file."""
        with self._lock:
            return self._index.keys()

    def stats(self) -> dict[str, Any]:
        """entries, used_bytes, capacity_bytes, pending writes, hits, misses, evictions..."""
        with self._lock:
            return {
                "tier": TIER_DISK,
                "directory": self.directory,
                "entries": len(self._index),
                "used_bytes": self._index.used,
                "capacity_bytes": self._index.capacity,
                "pending_writes": len(self._pending),
                "pending_bytes": self._index.reserved,
                "policy": self._index.policy_name,
                "incarnation": self.incarnation,
                **self._counts,
            }

    def close(self, wait: bool = True) -> None:
        """Stop the writer threads (finishing queued writes when `wait`), then give the
        files their queued mtimes."""
        self._closed = True
        self._pool.shutdown(wait=wait)
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=wait)
        timer = self._stamp_timer
        if timer is not None:
            timer.cancel()
        self._apply_stamps()

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._lock:
                self._counts[name] += n
            if name == "evictions":
                metrics.inc("raykv_evictions", n, tier=TIER_DISK, policy=self._index.policy_name)

    def _error(self, kind: str) -> None:
        with self._lock:
            self._counts["errors"] += 1
        metrics.inc("raykv_tier_errors", 1, tier=TIER_DISK, kind=kind)

    def _publish(self) -> None:
        policy = self._index.policy_name
        metrics.set_gauge("raykv_used_bytes", self._index.used, tier=TIER_DISK, policy=policy)
        metrics.set_gauge("raykv_entries", len(self._index), tier=TIER_DISK, policy=policy)


__all__ = ["DiskStore", "layout_digest", "record_size"]
