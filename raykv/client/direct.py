"""A client's own reads of its node's disk tier files (`disk_direct_reads`).

A disk hit promoted the usual way crosses three actors and the object store: the
DiskStore reads and checks each file and returns the arrays (into the object store),
the CPU store keeps that object, the manager replies, and the reader then maps the
object. Measured on a 2-core machine, handing 64 MiB back from the DiskStore was most
of a disk lookup's time (docs/BENCHMARKS.md, "Where the disk read's time goes"), and on
a busy engine that lookup ran at 0.5-0.8 GB/s. A client on the disk tier's node reads
the files itself instead: one `readinto` per file into buffers it reuses, each record
checked as the tier checks it (header, XXH3 checksum or HMAC tag, key, dtype). The
manager answers such a lookup without promoting (`ManagerCore.prefetch(direct=True)`)
and touches the chunks in the disk tier's policy.

The files are only read, never written or removed here. A file gone (evicted since the
lookup) or refused by the checks ends the read there: the caller loads what came before
and vLLM recomputes the rest, never wrong data.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from raykv.errors import ConfigError, PayloadError
from raykv.keys import CacheKey
from raykv.payload import MAX_PAYLOAD_BYTES, PayloadMeta, decode, secret_tag
from raykv.tiers.chunkfiles import check_owner, chunk_path, read_file

logger = logging.getLogger(__name__)


def _node_id() -> str:
    """This process's Ray node."""
    return ray.get_runtime_context().get_node_id()


class DiskReader:
    """Reads chunk records from one disk tier directory on this node (see the module
    docstring). With `reuse`, each `read` fills its thread's buffers (the i-th chunk of a
    call the i-th buffer), so a thread must be done with one call's arrays before its
    next call (another thread's calls use buffers of their own); without, every chunk
    gets a fresh array (a CUDA copy may still read it)."""

    def __init__(
        self,
        directory: str,
        secret: str | None = None,
        *,
        reuse: bool = True,
        max_nbytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        self.directory = directory
        self._secret = secret
        self._reuse = reuse
        self._max_nbytes = max_nbytes  # a record declaring more is refused before its read
        self._mine = threading.local()  # .buffers: this thread's (the loader's, the engine's)
        self.read_bytes = 0
        self.failed_reads = 0

    @classmethod
    def local(cls, kv: Any, secret: str | None, **options: Any) -> DiskReader | None:
        """A reader of `kv`'s disk tier (`options`: the constructor's), or None (logged)
        if this process cannot read it itself: no disk tier, another node, a directory it
        cannot read or another user owns, or records keyed with a secret it lacks."""
        where = kv.disk_location()
        if where is None:
            return None
        node, directory, tag = where
        why = None
        if node != _node_id():
            why = "the disk tier is on another node"
        elif tag != (secret_tag(secret) if secret else ""):
            why = "its records are keyed with another payload_secret than this process's"
        elif not os.access(directory, os.R_OK | os.X_OK):
            why = f"{directory} is not readable here"
        else:
            try:
                check_owner(directory)
            except ConfigError as exc:
                why = str(exc)
        if why is not None:
            logger.info("raykv: disk hits are promoted through the tiers, not read here: %s", why)
            return None
        return cls(directory, secret, **options)

    def read(
        self, keys: Sequence[CacheKey]
    ) -> tuple[list[tuple[np.ndarray, PayloadMeta]], CacheKey | None]:
        """(body, meta) of each of `keys` in order, stopping at the first whose file is
        gone or fails its checks (logged): what came before is still good. Also that key
        (None if every one was read), which the disk tier should drop."""
        out: list[tuple[np.ndarray, PayloadMeta]] = []
        buffers = self._buffers()
        for i, key in enumerate(keys):
            buf = buffers[i] if i < len(buffers) else None
            try:
                data = read_file(
                    chunk_path(self.directory, key), None, self._max_nbytes, self._secret, out=buf
                )
                body = decode(data, key.to_string(), key.kv_dtype, secret=self._secret)
            except FileNotFoundError:
                logger.info("raykv: the file of %s is gone (evicted since its lookup)", key)
                self.failed_reads += 1
                return out, key
            except (OSError, PayloadError) as exc:
                logger.warning("raykv: cannot read the disk tier's file of %s: %s", key, exc)
                self.failed_reads += 1
                return out, key
            if self._reuse and (buf is None or data.base is not buf):  # a fresh array,
                if i < len(buffers):  # kept for this thread's next call
                    buffers[i] = data
                else:
                    buffers.append(data)
            self.read_bytes += data.nbytes
            out.append((body.data, body.meta))
        return out, None

    def _buffers(self) -> list[np.ndarray]:
        """This thread's reused buffers (empty without `reuse`)."""
        if not self._reuse:
            return []
        if not hasattr(self._mine, "buffers"):
            self._mine.buffers = []
        return self._mine.buffers


__all__ = ["DiskReader"]
