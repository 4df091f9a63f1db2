"""The disk tier's scans of its directory: the index rebuilt from file names and sizes
when a store opens (`_rebuild`, no bodies read), and `check`, which reconciles the index
with the files (temp files of crashed writes, bad headers, vanished or unindexed files).

A mixin of `raykv.tiers.disk.DiskStore`: it uses the store's index, lock and files, and
the rules of its module docstring (no file I/O under the lock; a key about to be
unlinked is marked "deleting" first).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import TYPE_CHECKING, Any

from raykv.errors import PayloadError
from raykv.keys import CacheKey
from raykv.payload import decode, read_header
from raykv.tiers.budget import ByteBudgetIndex
from raykv.tiers.chunkfiles import (
    SHARD_CHARS,
    SUFFIX,
    TMP_SUFFIX,
    ChunkFiles,
    KeyParser,
    read_file,
    unlink,
)

if TYPE_CHECKING:
    from raykv.tiers.disk import _Pending

logger = logging.getLogger("raykv.tiers.disk")

_HEADER_PROBE = 2048  # bytes read by check() to validate a header without reading the body


def _in_its_shard(key: CacheKey | None, shard: str) -> CacheKey | None:
    """`key`, unless its file lies in another shard than its own: no path the store
    reads or unlinks names such a file (a check must remove that file, not the key's)."""
    return key if key is not None and key.chunk_hash[:SHARD_CHARS] == shard else None


class DiskScan:
    """`_rebuild` and `check` of a `DiskStore` (see the module docstring)."""

    directory: str
    _files: ChunkFiles
    _index: ByteBudgetIndex
    _lock: threading.Lock
    _pending: dict[CacheKey, _Pending]
    _deleting: set[CacheKey]
    _parse: KeyParser
    _secret: str | None

    def _drop(self, key: CacheKey, unlink: bool) -> None:  # pragma: no cover - DiskStore's
        raise NotImplementedError

    def _unlink_keys(self, keys: list[CacheKey]) -> None:  # pragma: no cover - DiskStore's
        raise NotImplementedError

    def _count(self, name: str, n: int) -> None:  # pragma: no cover - DiskStore's
        raise NotImplementedError

    def _publish(self) -> None:  # pragma: no cover - DiskStore's
        raise NotImplementedError

    def _rebuild(self) -> None:
        """Rebuild the index from names and sizes (no file bodies are read); remove temp
        files that crashed writes left behind (older than `STALE_TMP_SECS`)."""
        found: list[tuple[float, CacheKey, int]] = []
        temps = bad = removed = 0
        now = time.time()
        for entry in self._files.layout_temps():
            removed += self._files.remove_if_stale(entry, now)
        for shard, entry in self._files.scan():
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                if self._files.remove_if_stale(entry, now):
                    removed += 1
                else:
                    temps += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            key = _in_its_shard(self._parse(name[: -len(SUFFIX)]), shard.name)
            if key is None:
                bad += 1
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):  # a symlink, FIFO or device: never ours
                bad += 1
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        found.sort(key=lambda item: item[0])  # oldest first, so LRU order survives a restart
        for _, key, size in found:
            self._index.add(key, size)
        victims = self._index.shrink()
        for key, _ in victims:
            self._files.unlink_key(key)
        self._count("evictions", len(victims))
        if removed:
            logger.info(
                "disk tier %s: removed %d temp files of crashed writes", self.directory, removed
            )
        if temps or bad:
            logger.info(
                "disk tier %s: %d recent temp files and %d unparsable names left; "
                "run check(fix=True)",
                self.directory,
                temps,
                bad,
            )
        logger.info(
            "disk tier %s: reopened %d chunks, %d bytes",
            self.directory,
            len(self._index),
            self._index.used,
        )
        self._publish()

    def check(self, fix: bool = True, deep: bool = False) -> dict[str, Any]:
        """Reconcile the index with the files and return what was found (and fixed).

        Finds temp files left by a crash, files with unparsable names or bad headers
        (all bodies too when `deep`), index entries whose file is gone, and complete
        files missing from the index. With `fix`, removes the bad files and every temp
        file of any age but this store's own writes in flight (so run it while no other
        store writes to this directory), drops dead entries, adopts unindexed files and
        evicts down to capacity.
        """
        report = dict.fromkeys(
            ("files", "temp_files", "bad_files", "missing_files", "adopted", "unknown_files"), 0
        )
        seen: set[CacheKey] = set()
        for entry in self._files.layout_temps():
            report["temp_files"] += 1
            if fix:
                unlink(entry.path)
        for shard, entry in self._files.scan():
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                with self._lock:
                    ours = any(p.tmp_path == entry.path for p in self._pending.values())
                if not ours:
                    report["temp_files"] += 1
                    if fix:
                        unlink(entry.path)
                continue
            if not name.endswith(SUFFIX):
                report["unknown_files"] += 1
                continue
            report["files"] += 1
            key = _in_its_shard(self._parse(name[: -len(SUFFIX)]), shard.name)
            if key is None:
                problem: str | None = "misplaced or unparsable name"
            else:
                problem = self._verify(entry.path, key, deep)
            if problem is not None:
                report["bad_files"] += 1
                logger.warning("disk tier: bad file %s: %s", entry.path, problem)
                if fix:
                    if key is None:
                        unlink(entry.path)
                    else:
                        self._drop(key, unlink=True)
                continue
            assert key is not None
            seen.add(key)
            if fix:
                report["adopted"] += self._adopt(key, entry)
        with self._lock:
            unseen = [k for k in self._index.keys() if k not in seen]
        for key in unseen:
            if not self._files.exists(key):
                report["missing_files"] += 1
                if fix:
                    self._drop(key, unlink=False)
        if fix:
            with self._lock:
                victims = self._index.shrink()
                self._deleting.update(k for k, _ in victims)
            self._unlink_keys([k for k, _ in victims])
            self._count("evictions", len(victims))
        with self._lock:
            report["entries"] = len(self._index)
            report["used_bytes"] = self._index.used
        self._publish()
        return report

    def _verify(self, path: str, key: CacheKey, deep: bool) -> str | None:
        """Why the file at `path` is not a valid record of `key`, or None if it is."""
        try:
            if deep:
                data = read_file(path, None, self._index.capacity, self._secret)
                decode(data, key.to_string(), key.kv_dtype, secret=self._secret)
                return None
            size, head = self._files.read_head(path, _HEADER_PROBE)
            header = read_header(head, secret=self._secret)
        except FileNotFoundError:
            return None  # removed meanwhile: nothing to fix here
        except (OSError, PayloadError) as exc:
            return str(exc)
        if header.key != key.to_string():
            return f"header names key {header.key!r:.80}"
        if header.meta.dtype != key.kv_dtype:
            return f"header declares {header.meta.dtype} KV, the key {key.kv_dtype}"
        if header.header_len + header.nbytes != size:
            return f"size {size} != {header.header_len + header.nbytes} declared"
        return None

    def _adopt(self, key: CacheKey, entry: os.DirEntry[str]) -> int:
        """Index a complete file that the index does not know (1 if adopted)."""
        try:
            size = entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0
        with self._lock:
            if key in self._index or key in self._pending or key in self._deleting:
                return 0
            self._index.add(key, size)
        return 1
