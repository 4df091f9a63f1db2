"""A client's own reads of the disk tier's files (`raykv.client.direct.DiskReader`, the
vLLM worker's `disk_direct_reads`), against files a real `DiskStore` wrote: the bytes
stored, buffers reused, and a gone, damaged or foreign-keyed file ending the read there
(never wrong bytes); which hits a lookup may leave to such reads (`direct_start`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from raykv_testing import seeded_chunk

from raykv.client import direct
from raykv.client.direct import DiskReader
from raykv.integrations.vllm_meta import direct_start
from raykv.keys import make_key
from raykv.payload import secret_tag
from raykv.tiers.chunkfiles import chunk_path
from raykv.tiers.disk import DiskStore

SECRET = "a-secret-of-at-least-16-chars"


def key(i: int):
    return make_key("m", 1, 0, f"{i:032x}", "bfloat16")


def written(tmp_path: Path, n: int, secret: str | None = None) -> tuple[DiskStore, list, list]:
    """A disk tier holding chunks 0..n-1 (files complete), their keys and arrays."""
    store = DiskStore(tmp_path, 1 << 24, model_name="m", payload_secret=secret)
    items = [seeded_chunk(i) for i in range(n)]
    keys = [key(i) for i in range(n)]
    store.put(keys, [m for m, _ in items], [a for _, a in items])
    assert store.flush(10)
    return store, keys, [a for _, a in items]


def test_the_reader_returns_the_stored_bytes_into_reused_buffers(tmp_path):
    store, keys, arrays = written(tmp_path, 3)
    reader = DiskReader(store.directory)
    first, bad = reader.read(keys)
    assert bad is None
    assert [meta for _, meta in first] == [seeded_chunk(i)[0] for i in range(3)]
    for (body, _), want in zip(first, arrays, strict=True):
        assert np.array_equal(body, want)
    homes = [body.base for body, _ in first]
    again, _ = reader.read(keys[::-1])  # the i-th chunk of a call: the i-th buffer
    for (body, _), want in zip(again, arrays[::-1], strict=True):
        assert np.array_equal(body, want)
    assert [np.shares_memory(b, h) for (b, _), h in zip(again, homes, strict=True)] == [True] * 3
    assert reader.read_bytes > 3 * arrays[0].nbytes * 2 and reader.failed_reads == 0
    fresh = DiskReader(store.directory, reuse=False)
    (one, _), (two, _) = fresh.read(keys[:1]), fresh.read(keys[:1])
    assert not np.shares_memory(one[0][0], two[0][0])  # a CUDA copy may still read one
    other: list = []  # another thread (the engine's, beside the loader's) reads into its own
    thread = threading.Thread(target=lambda: other.extend(reader.read(keys)[0]))
    thread.start()
    thread.join()
    assert not any(np.shares_memory(b, h) for (b, _) in other for h in homes)
    assert [np.array_equal(b, a) for (b, _), a in zip(other, arrays, strict=True)] == [True] * 3
    store.close()


def test_a_gone_or_damaged_file_ends_the_read_there(tmp_path):
    store, keys, arrays = written(tmp_path, 4)
    os.unlink(chunk_path(store.directory, keys[2]))  # evicted since the lookup
    reader = DiskReader(store.directory)
    got, bad = reader.read(keys)
    assert len(got) == 2 and np.array_equal(got[1][0], arrays[1]) and bad == keys[2]
    path = chunk_path(store.directory, keys[1])
    raw = bytearray(Path(path).read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the body: the checksum refuses it
    Path(path).write_bytes(bytes(raw))
    assert [len(got) for got in reader.read(keys)[:1]] == [1] and reader.read(keys)[1] == keys[1]
    assert reader.failed_reads == 3
    store.close()


def test_records_keyed_with_a_secret_are_read_only_with_it(tmp_path):
    store, keys, arrays = written(tmp_path, 2, secret=SECRET)
    keyed, _ = DiskReader(store.directory, SECRET).read(keys)
    assert [np.array_equal(b, a) for (b, _), a in zip(keyed, arrays, strict=True)] == [True] * 2
    assert DiskReader(store.directory).read(keys) == ([], keys[0])  # a plain reader refuses
    assert DiskReader(store.directory, SECRET[::-1]).read(keys) == ([], keys[0])
    store.close()


class FakeKV:
    def __init__(self, where: Any) -> None:
        self.where = where

    def disk_location(self) -> Any:
        return self.where


def test_a_reader_is_made_only_where_the_files_can_be_read_as_the_tier_wrote_them(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(direct, "_node_id", lambda: "node-a")
    store, _, _ = written(tmp_path, 1, secret=SECRET)
    here = ("node-a", store.directory, secret_tag(SECRET))
    assert DiskReader.local(FakeKV(here), SECRET).directory == store.directory
    assert DiskReader.local(FakeKV(None), SECRET) is None  # no disk tier (or a fault)
    assert DiskReader.local(FakeKV(("node-b", *here[1:])), SECRET) is None
    assert DiskReader.local(FakeKV(here), None) is None  # keyed records, no secret here
    assert DiskReader.local(FakeKV(here), SECRET[::-1]) is None
    gone = ("node-a", str(tmp_path / "nowhere"), secret_tag(SECRET))
    assert DiskReader.local(FakeKV(gone), SECRET) is None
    store.close()


@pytest.mark.parametrize(
    ("sources", "start"),
    [
        ([("disk", 512)], 0),
        ([("cpu", 256), ("disk", 512)], 256),
        ([("cpu", 256)], None),  # nothing on disk
        ([("cpu", 256), ("disk", 512), ("remote", 768)], None),  # promoted as before
        ([("disk", 256), ("remote", 512)], None),
        ([("remote", 256), ("disk", 512)], None),
        ([("peer", 256), ("disk", 512)], None),
        ([], None),
    ],
)
def test_only_a_cpu_run_then_one_disk_run_is_read_from_the_files(sources, start):
    assert direct_start(sources) == start
    # Several ranks: only a hit wholly on disk (see test_lookup_plan's agreement test).
    assert direct_start(sources, world_size=2) == (start if len(sources) == 1 else None)


def test_a_record_larger_than_the_readers_bound_is_refused_before_its_read(tmp_path):
    store, keys, arrays = written(tmp_path, 1)
    assert len(DiskReader(store.directory, max_nbytes=arrays[0].nbytes).read(keys)[0]) == 1
    small = DiskReader(store.directory, max_nbytes=arrays[0].nbytes - 1)
    assert small.read(keys) == ([], keys[0]) and small.read_bytes == 0 and small.failed_reads == 1
    store.close()
