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
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from raykv.errors import ConfigError, PayloadError
from raykv.keys import CacheKey
from raykv.payload import MAX_PAYLOAD_BYTES, PayloadMeta, decode, secret_tag
from raykv.tiers.chunkfiles import check_owner, chunk_path, read_file

logger = logging.getLogger(__name__)


class DiskReader:
    """Reads chunk records from one disk tier directory on this node (see the module
    docstring). With `reuse`, each `read` fills the same buffers (the i-th chunk of a
    call the i-th buffer), so a caller must be done with one call's arrays before the
    next; without, every chunk gets a fresh array (a CUDA copy may still read it)."""

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
        self._buffers: list[np.ndarray] = []
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
        if node != ray.get_runtime_context().get_node_id():
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

    def read(self, keys: Sequence[CacheKey]) -> list[tuple[np.ndarray, PayloadMeta]]:
        """(body, meta) of each of `keys` in order, stopping at the first that cannot be
        read or fails its checks (logged): what came before is still good."""
        out: list[tuple[np.ndarray, PayloadMeta]] = []
        for i, key in enumerate(keys):
            buf = self._buffers[i] if self._reuse and i < len(self._buffers) else None
            try:
                data = read_file(
                    chunk_path(self.directory, key), None, self._max_nbytes, self._secret, out=buf
                )
                body = decode(data, key.to_string(), key.kv_dtype, secret=self._secret)
            except FileNotFoundError:
                logger.info("raykv: the file of %s is gone (evicted since its lookup)", key)
                self.failed_reads += 1
                break
            except (OSError, PayloadError) as exc:
                logger.warning("raykv: cannot read the disk tier's file of %s: %s", key, exc)
                self.failed_reads += 1
                break
            if buf is None or data.base is not buf:  # a fresh array: the next call reuses it
                self._keep(i, data)
            self.read_bytes += data.nbytes
            out.append((body.data, body.meta))
        return out

    def _keep(self, i: int, data: np.ndarray) -> None:
        """Keep the fresh array a read made as the i-th buffer (one per position)."""
        if not self._reuse:
            return
        if i < len(self._buffers):
            self._buffers[i] = data
        else:
            self._buffers.append(data)


__all__ = ["DiskReader"]
