"""How the disk tier's chunk records reach files: names, atomic writes, checked reads,
unlinks, directory scans and owner checks, under one directory (diskcache's `Disk`).

`DiskStore` (what the tier knows: index, budget, queue, recovery) takes a `ChunkFiles`
and never touches the file system itself, so its tests can inject a file layer that
fails as a full disk or returns a torn file, without patching `os`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from raykv.errors import ConfigError, InvalidInputError, PayloadError
from raykv.keys import CacheKey, KeyIdentity
from raykv.payload import HEADER_PREFIX_BYTES, MAX_PAYLOAD_BYTES, check_head

logger = logging.getLogger(__name__)

SUFFIX = ".rkv"
TMP_SUFFIX = ".tmp"
# A temp file untouched this long is a crashed write's leftover: a live write keeps its
# file's mtime fresh (each write() updates it), so on start older temps are removed.
STALE_TMP_SECS = 60.0
LAYOUT_FILE = "raykv-layout.json"
SHARD_CHARS = 2  # one level of 256 shard directories: ~400 files each at 100k chunks
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")


def _write_all(fd: int, data: Any) -> int:
    """Write every byte of `data` to `fd` (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    total = view.nbytes
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]
    return total


def _write_file(path: str, parts: Iterable[Any], fsync: bool) -> int:
    """Create `path` exclusively and write `parts` to it; returns the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    size = 0
    try:
        for part in parts:
            size += _write_all(fd, part)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size


def check_owner(path: str) -> None:
    """Raise `ConfigError` if `path` exists and another user owns it (see `_private_dir`)."""
    try:
        uid = os.stat(path).st_uid
    except FileNotFoundError:
        return
    if uid != os.geteuid():
        raise ConfigError(
            f"disk tier directory {path} is owned by uid {uid}, not by this user "
            f"(uid {os.geteuid()}): refusing to keep KV there; point local_disk at a "
            "directory of your own"
        )


def private_dir(path: str, *, restrict: bool = True) -> None:
    """Create `path` (and missing parents) readable by this user only; refuse a directory
    another user owns (who could read the KV, or plant files for us to serve).

    `restrict` also narrows an existing directory to 0700 (for directories raykv owns,
    not for a `local_disk` root the user picked).
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_owner(path)
    if restrict and os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> bool:
    """Remove a file; False if it was already gone or could not be removed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, exc)
        return False


def open_regular(path: str) -> Any:
    """Open `path` for reading only if it is a regular file, never following a symlink and
    never blocking (a FIFO or device dropped under a chunk's name is refused, not read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PayloadError("not a regular file")
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_file(
    path: str,
    expected_size: int | None = None,
    max_nbytes: int = MAX_PAYLOAD_BYTES,
    secret: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The whole file in a fresh uint8 array (one copy, via readinto); short reads raise.
    With `out` (a flat uint8 array at least as long as the file), read into its start
    instead, and return that view: a reader that reuses its buffers (no page faults on
    fresh memory for every chunk).

    Nothing is allocated for the body before the header is read and checked: a file
    whose size is not `expected_size` (the size the index recorded), whose header does
    not parse, declares more than `max_nbytes`, or does not match the file's size is
    refused after reading at most `HEADER_PREFIX_BYTES` bytes (a planted huge file must not
    be read into memory). With `secret`, a plain (unkeyed) record is refused at the header,
    and one without a secret refuses a keyed record (`decode` then checks the tag).
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            raise PayloadError(f"file has {size} bytes, the index recorded {expected_size}")
        head = f.read(min(size, HEADER_PREFIX_BYTES))
        check_head(head, size, max_nbytes, secret=secret)
        buf = np.empty(size, dtype=np.uint8) if out is None or out.size < size else out[:size]
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        view = memoryview(buf)
        done = len(head)
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                raise PayloadError(f"file shrank while reading: {done} of {size} bytes")
            done += n
    return buf


def chunk_path(directory: str, key: CacheKey) -> str:
    """The final file of `key` in a tier directory; `InvalidInputError` for a key that is
    no safe file name."""
    return os.path.join(directory, key.chunk_hash[:SHARD_CHARS], file_name(key) + SUFFIX)


def file_name(key: CacheKey) -> str:
    """`key.to_string()`, checked to be one safe path component.

    `CacheKey`'s constructor does not validate (it is on the hot path), so a key built by
    hand, or sent by a hostile client, could carry a path separator in its hash or dtype.
    """
    text = key.to_string()
    if not _HEX32.match(key.chunk_hash) or "/" in text or "\\" in text or "\x00" in text:
        raise InvalidInputError(f"not a valid chunk key for a file name: {text!r:.120}")
    return text


class KeyParser:
    """Parses file names back to keys; caches each file-name head's `CacheKey.identity`."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, str], KeyIdentity] = {}

    def __call__(self, text: str) -> CacheKey | None:
        head, _, rest = text.rpartition("@")  # rest = dtype
        head, _, chunk_hash = head.rpartition("@")
        cached = self._heads.get((head, rest))
        if cached is None:
            try:
                key = CacheKey.from_string(text)
            except (InvalidInputError, ValueError):
                return None
            self._heads[(head, rest)] = key.identity
            return key
        if not _HEX32.match(chunk_hash):
            return None
        return CacheKey.of(cached, chunk_hash)


class ChunkFiles:
    """The chunk files of one tier directory (created private to this user; a directory
    another user owns is refused). Thread-safe: every call is its own file operation."""

    def __init__(self, directory: str, *, fsync: bool = False) -> None:
        self.directory = directory
        self.fsync = fsync
        private_dir(os.path.dirname(directory), restrict=False)
        private_dir(directory)

    def path_of(self, key: CacheKey) -> str:
        """The final file of `key`; `InvalidInputError` for a key that is no safe file name."""
        return chunk_path(self.directory, key)

    def tmp_path(self, key: CacheKey) -> str:
        name = f".{file_name(key)}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"
        return os.path.join(self.directory, key.chunk_hash[:SHARD_CHARS], name)

    def write_layout_file(self, layout: dict[str, Any]) -> None:
        """Record what the directory holds (informational: the digest in its name rules)."""
        path = os.path.join(self.directory, LAYOUT_FILE)
        if os.path.exists(path):
            return
        tmp = f"{path}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(layout, f)
            os.replace(tmp, path)
        except OSError as exc:  # informational only
            logger.debug("cannot write %s: %s", path, exc)
            unlink(tmp)

    def write(self, key: CacheKey, tmp_path: str, parts: Iterable[Any]) -> int:
        """Write `parts` to the temp file `tmp_path` and rename it to `key`'s file, so a
        visible file is always complete; returns the bytes written. On any failure
        neither file is left behind (a renamed file that could not be made durable
        included), and the error is raised."""
        final = self.path_of(key)
        renamed = False
        try:
            try:
                size = _write_file(tmp_path, parts, self.fsync)
            except FileNotFoundError:  # shard directory not created yet (or removed)
                os.makedirs(os.path.dirname(tmp_path), mode=0o700, exist_ok=True)
                size = _write_file(tmp_path, parts, self.fsync)
            os.replace(tmp_path, final)
            renamed = True
            if self.fsync:  # make the rename itself durable
                _fsync_dir(os.path.dirname(final))
            return size
        except BaseException:
            unlink(tmp_path)
            if renamed:
                unlink(final)
            raise

    def read(
        self,
        key: CacheKey,
        expected_size: int | None = None,
        max_nbytes: int = MAX_PAYLOAD_BYTES,
        secret: str | None = None,
    ) -> np.ndarray:
        """`key`'s whole record, checked before its body is read (`read_file`)."""
        return read_file(self.path_of(key), expected_size, max_nbytes, secret)

    def read_head(self, path: str, n: int) -> tuple[int, bytes]:
        """(file size, its first `n` bytes) of a regular file."""
        with open_regular(path) as f:
            return os.fstat(f.fileno()).st_size, f.read(n)

    def stamp(self, key: CacheKey, ns: int) -> bool:
        """Set `key`'s file's mtime to `ns` (what a restart orders the policy by); False if
        the file is gone (or not written yet), or the key names no file. A symlink is never
        followed."""
        try:
            os.utime(self.path_of(key), ns=(ns, ns), follow_symlinks=False)
        except (OSError, InvalidInputError):
            return False
        return True

    def exists(self, key: CacheKey) -> bool:
        return os.path.exists(self.path_of(key))

    def unlink_key(self, key: CacheKey) -> bool:
        return unlink(self.path_of(key))

    def scan(self) -> Iterable[tuple[os.DirEntry[str], os.DirEntry[str]]]:
        """(shard dir, file) entries of every shard directory, names only (no stat)."""
        try:
            shards = [e for e in os.scandir(self.directory) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        for shard in shards:
            if len(shard.name) != SHARD_CHARS:
                continue
            try:
                with os.scandir(shard.path) as it:
                    for entry in it:
                        yield shard, entry
            except FileNotFoundError:
                continue

    def layout_temps(self) -> list[os.DirEntry[str]]:
        """Temp files of `_write_layout_file` in the layout directory (not in a shard)."""
        try:
            with os.scandir(self.directory) as it:
                return [
                    e
                    for e in it
                    if e.name.startswith(LAYOUT_FILE + ".") and e.name.endswith(TMP_SUFFIX)
                ]
        except FileNotFoundError:
            return []

    @staticmethod
    def remove_if_stale(entry: os.DirEntry[str], now: float) -> bool:
        """Remove a temp file not modified for `STALE_TMP_SECS` (True if removed).

        A younger one may belong to a live writer (another DiskStore on this directory,
        in this process or another); `check(fix=True)` removes those too.
        """
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode) or now - st.st_mtime < STALE_TMP_SECS:
            return False
        return unlink(entry.path)


__all__ = [
    "ChunkFiles",
    "DISK_FULL",
    "KeyParser",
    "LAYOUT_FILE",
    "SHARD_CHARS",
    "STALE_TMP_SECS",
    "SUFFIX",
    "TMP_SUFFIX",
    "check_owner",
    "file_name",
    "open_regular",
    "private_dir",
    "read_file",
    "unlink",
]
