"""The plain DiskStore (no Ray): files, index, budget, restart, check, failures."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from raykv_testing import seeded_chunk

from raykv.keys import make_key
from raykv.tiers import chunkfiles as cf
from raykv.tiers import disk as ds
from raykv.tiers.disk import DiskStore, layout_digest


def key(i: int, model: str = "m"):
    return make_key(model, 1, 0, f"{i:032x}", "bfloat16")


chunk = seeded_chunk


class GatedFiles(cf.ChunkFiles):
    """A slow disk: every write waits for `gate` (set it to let writes finish)."""

    gate = threading.Event()

    def write(self, key, tmp_path, parts):
        self.gate.wait(10)
        return super().write(key, tmp_path, parts)


class FullFiles(cf.ChunkFiles):
    """A disk with no space left while `full` is set: writes fail, nothing is written."""

    full = True

    def write(self, key, tmp_path, parts):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(key, tmp_path, parts)


class TornFiles(cf.ChunkFiles):
    """Reads see a record cut short (a torn file made visible): 7 bytes are missing."""

    def read(self, key, expected_size=None, max_nbytes=cf.MAX_PAYLOAD_BYTES, secret=None):
        return super().read(key, None, max_nbytes, secret)[:-7]


def one_slot_store(tmp_path: Path, queue_wait_s: float) -> DiskStore:
    """A store with one write slot on a slow disk (`GatedFiles`)."""
    return DiskStore(
        tmp_path,
        1 << 20,
        max_pending_writes=1,
        write_workers=1,
        queue_wait_s=queue_wait_s,
        files=GatedFiles,
    )


@pytest.fixture
def gate():
    GatedFiles.gate = threading.Event()
    yield GatedFiles.gate
    GatedFiles.gate.set()


CHUNK_BYTES = chunk(0)[0].nbytes  # 4096


def put(store: DiskStore, ids, tokens: int = 16, flush: bool = True):
    keys = [key(i) for i in ids]
    items = [chunk(i, tokens) for i in ids]
    ack = store.put(keys, [m for m, _ in items], [a for _, a in items])
    if flush:
        assert store.flush(5)
    return ack


def files(store: DiskStore, pattern: str = "*.rkv") -> list[Path]:
    return sorted(Path(store.directory).glob(f"*/{pattern}")) + sorted(
        Path(store.directory).glob(f"*/.{pattern}")
    )


@pytest.fixture
def store(tmp_path: Path):
    s = DiskStore(tmp_path, 1 << 20)
    yield s
    s.close()


def test_stores_of_other_payload_secrets_keep_apart_and_never_delete_each_others_files(
    tmp_path: Path,
) -> None:
    """Two deployments on one disk, keyed apart, shared one directory: each indexed the
    other's files into its budget, then deleted them on read (they fail its MAC)."""
    plain = DiskStore(tmp_path, 1 << 20)
    keyed = DiskStore(tmp_path, 1 << 20, payload_secret="s" * 16)
    stores = [plain, keyed]
    try:
        assert plain.directory != keyed.directory
        plain_dir = layout_digest("default", "KV_2LTD", "bfloat16", 256)
        assert os.path.basename(plain.directory) == plain_dir  # as before secrets named dirs
        put(plain, [1])
        put(keyed, [2])
        stores.append(again := DiskStore(tmp_path, 1 << 20, payload_secret="s" * 16))
        assert again.keys() == [key(2)] and again.get([key(1)]) == [None]
        assert again.get([key(2)])[0] is not None
        assert plain.keys() == [key(1)] and len(files(plain)) == len(files(keyed)) == 1
        # A file in a secret's directory that fails its MAC is junk there: deleted.
        (path,) = files(plain)
        planted = Path(keyed.directory) / path.parent.name / path.name
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(path.read_bytes())
        stores.append(third := DiskStore(tmp_path, 1 << 20, payload_secret="s" * 16))
        assert third.get([key(1)]) == [None] and not planted.exists() and path.exists()
    finally:
        for s in stores:
            s.close()


def test_a_put_whose_meta_is_invalid_skips_that_chunk_and_stores_the_rest(store) -> None:
    """A meta that skipped validation (unpickled with an unknown dtype) raised out of the
    put after its first chunks were written: the manager indexed none of them."""
    from raykv.payload import PayloadMeta

    good, array = chunk(0)
    bad = object.__new__(PayloadMeta)
    for name in ("dtype", "shape", "layout"):
        object.__setattr__(bad, name, getattr(good, name))
    object.__setattr__(bad, "dtype", "bogus")
    ack = store.put([key(0), key(1)], [good, bad], [array, chunk(1)[1]])
    assert store.flush(5)
    assert ack.accepted == [key(0)] and ack.skipped == [key(1)]
    assert store.keys() == [key(0)]


def test_put_then_get_returns_identical_bytes_and_meta(store: DiskStore) -> None:
    ack = put(store, range(3))
    assert ack.accepted == [key(i) for i in range(3)] and not ack.skipped and not ack.evicted
    assert store.contains([key(0), key(1), key(2), key(9)]) == [True, True, True, False]
    metas, arrays = store.get_batch([key(1), key(9), key(0)])
    assert metas == [chunk(1)[0], None, chunk(0)[0]]
    assert np.array_equal(arrays[0], chunk(1)[1]) and np.array_equal(arrays[2], chunk(0)[1])
    assert arrays[1].size == 0 and arrays[0].dtype == np.uint8
    st = store.stats()
    assert st["entries"] == 3 and st["hits"] == 2 and st["misses"] == 1
    assert st["used_bytes"] == sum(p.stat().st_size for p in files(store))


def test_layout_digest_names_the_directory_so_models_never_mix(tmp_path: Path) -> None:
    a = DiskStore(tmp_path, 1 << 20, model_name="a")
    b = DiskStore(tmp_path, 1 << 20, model_name="b", chunk_size=128)
    assert a.directory != b.directory
    assert os.path.basename(a.directory) == layout_digest("a", "KV_2LTD", "bfloat16", 256)
    put(a, [1])
    assert b.keys() == [] and DiskStore(tmp_path, 1 << 20, model_name="a").keys() == [key(1)]
    # one file per chunk, in a shard directory named after the chunk hash
    (path,) = files(a)
    assert path.parent.name == key(1).chunk_hash[:2]
    assert path.name == key(1).to_string() + ".rkv"


def test_key_is_invisible_until_its_file_is_complete(tmp_path: Path, gate) -> None:
    store = DiskStore(tmp_path, 1 << 20, files=GatedFiles)
    ack = put(store, [1], flush=False)
    assert ack.accepted == [key(1)]
    assert store.contains([key(1)]) == [False] and store.get([key(1)]) == [None]
    assert store.stats()["pending_writes"] == 1
    gate.set()
    assert store.flush(5)
    assert store.contains([key(1)]) == [True]
    store.close()


def test_second_put_of_a_key_keeps_the_first(store: DiskStore) -> None:
    put(store, [1])
    (path,) = files(store)
    inode = path.stat().st_ino
    meta, other = chunk(99)
    ack = store.put([key(1)], [meta], [other])
    store.flush(5)
    assert ack.accepted == [key(1)]
    assert path.stat().st_ino == inode
    assert np.array_equal(store.get([key(1)])[0][1], chunk(1)[1])


def test_remove_clear_and_keys(store: DiskStore) -> None:
    put(store, range(5))
    assert sorted(store.keys()) == [key(i) for i in range(5)]
    assert store.remove([key(0), key(1), key(42)]) == 2
    assert sorted(store.keys()) == [key(i) for i in range(2, 5)]
    assert len(files(store)) == 3
    store.clear()
    assert store.keys() == [] and files(store) == [] and store.stats()["used_bytes"] == 0


def test_concurrent_writers_of_one_key_leave_one_file_with_the_same_bytes(tmp_path: Path) -> None:
    stores = [DiskStore(tmp_path, 1 << 20) for _ in range(2)]  # e.g. a restarted actor
    meta, data = chunk(7)
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        stores[i % 2].put([key(7)], [meta], [data])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        assert s.flush(5)
    assert len(files(stores[0], "*")) == 1  # no temp files either
    for s in stores:
        assert np.array_equal(s.get([key(7)])[0][1], data)
    assert len(stores[0].stats()["directory"]) > 0 and stores[0].stats()["pending_writes"] == 0


def test_capacity_evicts_by_policy_and_returns_the_evicted_keys(tmp_path: Path) -> None:
    file_size = ds.record_size(chunk(0)[0], key(0))  # body + header
    store = DiskStore(tmp_path, 4 * file_size + 100, policy="lru")  # 4 files fit, not 5
    put(store, range(4))  # one request: ordered deepest first, so 3 is the LRU entry
    store.get([key(3)])  # now 3 is the most recent: 2 is the LRU victim
    ack = put(store, [4])
    assert ack.evicted == [key(2)] and ack.accepted == [key(4)]
    assert not (Path(store.path_of(key(2)))).exists()
    evicted = []
    for i in range(5, 12):
        evicted += put(store, [i]).evicted
    st = store.stats()
    assert st["used_bytes"] <= st["capacity_bytes"] and st["entries"] == 4
    assert st["evictions"] == 1 + len(evicted) == 8
    assert sorted(store.keys()) == [key(i) for i in range(8, 12)]
    assert len(files(store)) == 4


def test_chunk_larger_than_the_budget_is_skipped(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1024)
    ack = put(store, [1])
    assert ack.skipped == [key(1)] and store.keys() == [] and files(store) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "other_key"])
def test_corrupt_or_truncated_file_is_a_miss_and_is_removed(store: DiskStore, damage) -> None:
    put(store, [1, 2])
    path = Path(store.path_of(key(1)))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-10] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage":
        raw = bytearray(b"\x80\x04 not a payload" * 10)
    else:
        raw = bytearray(Path(store.path_of(key(2))).read_bytes())
    path.write_bytes(bytes(raw))
    assert store.get([key(1), key(2)])[0] is None
    assert not path.exists() and store.contains([key(1), key(2)]) == [False, True]
    assert store.stats()["errors"] == 1


def test_vanished_file_is_a_miss(store: DiskStore) -> None:
    put(store, [1])
    os.unlink(store.path_of(key(1)))
    assert store.get_batch([key(1)])[0] == [None]
    assert store.keys() == []


def test_restart_on_the_same_directory_serves_the_same_bytes(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 1 << 20)
    put(first, range(6))
    first.get([key(0)])
    first.close()
    # mtime order stands in for recency after a restart; explicit times, so that no two
    # files tie (writes within one clock tick would)
    for age, i in enumerate([1, 2, 3, 4, 5, 0]):
        os.utime(first.path_of(key(i)), (1_000_000 + age, 1_000_000 + age))
    second = DiskStore(tmp_path, 1 << 20)
    assert second.incarnation != first.incarnation
    assert sorted(second.keys()) == [key(i) for i in range(6)]
    assert second.stats()["used_bytes"] == first.stats()["used_bytes"]
    for i in range(6):
        meta, data = second.get([key(i)])[0]
        assert meta == chunk(i)[0] and np.array_equal(data, chunk(i)[1])
    second.close()  # gives the files their queued mtimes
    # a smaller budget on reopen evicts the least recent first: reads count (5 read last)
    third = DiskStore(tmp_path, 3 * ds.record_size(chunk(0)[0], key(0)) + 100)
    assert sorted(third.keys()) == [key(3), key(4), key(5)]


def test_a_restart_evicts_a_chain_deepest_first_with_its_shared_prefix_kept(tmp_path) -> None:
    """A conversation's turn 2 stores chunks 2-3 after the prefix 0-1 of turn 1; another
    chain comes later. A restart with less room rebuilds the order from the files'
    mtimes: it must evict the deepest chunks, never the prefix the others hang on (with
    write times as mtimes, the prefix, written first, went first)."""
    first = DiskStore(tmp_path, 1 << 20)
    put(first, [0, 1])
    turn2 = [chunk(i) for i in (2, 3)]
    first.put(
        [key(2), key(3)], [m for m, _ in turn2], [a for _, a in turn2], prefix=[key(0), key(1)]
    )
    assert first.flush(5)
    put(first, [9])
    first.close()
    small = DiskStore(tmp_path, 3 * ds.record_size(chunk(0)[0], key(0)) + 100)
    assert sorted(small.keys()) == [key(0), key(1), key(9)]


def test_check_fix_removes_temp_and_bad_files_and_reconciles_the_index(store: DiskStore) -> None:
    put(store, range(4))
    shard = Path(store.path_of(key(0))).parent
    (shard / f".{key(0).to_string()}.deadbeef.tmp").write_bytes(b"partial")  # crash leftover
    Path(store.path_of(key(1))).write_bytes(b"RKVC broken header")
    (shard / "not-a-key.rkv").write_bytes(b"x")
    os.unlink(store.path_of(key(2)))
    # a complete file written by another instance, unknown to this index
    other = DiskStore(Path(store.directory).parent, 1 << 20)
    put(other, [9])
    report = store.check(fix=False)
    assert report["temp_files"] == 1 and report["bad_files"] == 2
    assert report["missing_files"] == 1 and report["adopted"] == 0
    report = store.check(fix=True)
    assert report["temp_files"] == 1 and report["bad_files"] == 2 and report["adopted"] == 1
    assert sorted(store.keys()) == [key(0), key(3), key(9)]
    assert sorted(p.name for p in files(store, "*")) == [
        key(i).to_string() + ".rkv" for i in (0, 3, 9)
    ]
    clean = store.check(fix=True, deep=True)
    assert clean["temp_files"] == clean["bad_files"] == clean["missing_files"] == 0
    assert clean["entries"] == 3


def test_a_file_in_another_shard_than_its_keys_is_removed_and_the_keys_own_kept(
    store: DiskStore,
) -> None:
    """A file named after a key but lying in another shard is no file of that key: a
    check removed the key's real file (its path) and kept the misplaced one, and a
    reopened store indexed the key at a path where nothing was."""
    put(store, [1])
    right = Path(store.path_of(key(1)))
    wrong_shard = "00" if right.parent.name != "00" else "01"
    misplaced = right.parent.parent / wrong_shard / right.name
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(b"garbage")
    report = store.check(fix=True)
    assert report["bad_files"] == 1 and not misplaced.exists() and right.exists()
    assert store.get([key(1)])[0] is not None
    os.unlink(right)
    misplaced.write_bytes(right.name.encode())  # only the misplaced file is left
    reopened = DiskStore(Path(store.directory).parent, 1 << 20)
    try:
        assert reopened.keys() == [] and reopened.get([key(1)]) == [None]
    finally:
        reopened.close()


def test_disk_full_drops_the_write_without_raising(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20, files=FullFiles)
    ack = put(store, [1])  # no exception
    assert ack.accepted == [key(1)]  # admitted; the write then failed in the background
    assert store.contains([key(1)]) == [False] and files(store, "*") == []
    st = store.stats()
    assert st["errors"] == 1 and st["used_bytes"] == 0 and st["pending_bytes"] == 0
    FullFiles.full = False  # space again
    try:
        put(store, [1])
        assert store.contains([key(1)]) == [True]
    finally:
        FullFiles.full = True
        store.close()


def test_a_torn_file_is_a_miss_and_is_removed_never_served(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20, files=TornFiles)
    put(store, [1])
    assert store.contains([key(1)]) == [True] and len(files(store)) == 1
    assert store.get([key(1)]) == [None]  # the torn record is refused, not decoded
    assert store.contains([key(1)]) == [False] and files(store) == []
    assert store.stats()["errors"] == 1
    store.close()


def test_full_write_queue_applies_back_pressure_then_skips(tmp_path: Path, gate) -> None:
    store = one_slot_store(tmp_path, queue_wait_s=0.05)
    assert put(store, [1], flush=False).accepted == [key(1)]
    ack = put(store, [2], flush=False)  # the one slot is taken: waits 50 ms, then skips
    assert ack.skipped == [key(2)] and store.stats()["skipped"] == 1
    gate.set()
    assert store.flush(5) and store.keys() == [key(1)]
    store.close()


def test_a_full_write_queue_costs_one_wait_per_put_not_one_per_chunk(tmp_path: Path, gate) -> None:
    store = one_slot_store(tmp_path, queue_wait_s=0.2)
    try:
        assert put(store, [1], flush=False).accepted == [key(1)]
        t0 = time.monotonic()
        ack = put(store, range(2, 12), flush=False)  # 10 chunks, no slot frees up
        took = time.monotonic() - t0
        assert ack.skipped == [key(i) for i in range(2, 12)] and not ack.accepted
        assert 0.15 < took < 0.6  # one deadline, not 10 x 0.2 s
    finally:
        gate.set()
    assert store.flush(5) and store.keys() == [key(1)]
    store.close()


def test_remove_of_a_pending_write_cancels_it(tmp_path: Path, gate) -> None:
    store = DiskStore(tmp_path, 1 << 20, files=GatedFiles)
    put(store, [1], flush=False)
    assert store.remove([key(1)]) == 0  # not held yet
    gate.set()
    assert store.flush(5)
    assert store.keys() == [] and files(store, "*") == []
    assert store.stats()["pending_bytes"] == 0
    store.close()


def test_wrong_sized_array_is_skipped(store: DiskStore) -> None:
    meta, data = chunk(1)
    ack = store.put([key(1)], [meta], [data[:-1]])
    assert ack.skipped == [key(1)]


def test_files_and_directories_are_private_to_this_user(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "kv", 1 << 20)
    try:
        put(store, range(2))
        assert os.stat(store.directory).st_mode & 0o777 == 0o700
        for path in files(store):
            assert path.stat().st_mode & 0o777 == 0o600, path
            assert path.parent.stat().st_mode & 0o777 == 0o700, path.parent
    finally:
        store.close()


def test_an_existing_layout_directory_is_narrowed_to_this_user(tmp_path: Path) -> None:
    directory = tmp_path / layout_digest("default", "KV_2LTD", "bfloat16", 256)
    directory.mkdir(mode=0o777)
    os.chmod(directory, 0o777)
    DiskStore(tmp_path, 1 << 20).close()
    assert directory.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can chown to another user")
def test_a_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    from raykv.errors import ConfigError

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 12345, 12345)
    with pytest.raises(ConfigError, match="owned by uid 12345.*directory of your own"):
        DiskStore(shared, 1 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can chown to another user")
def test_connect_refuses_a_disk_directory_of_another_user_before_starting_anything(
    tmp_path: Path,
) -> None:
    import raykv
    from raykv.errors import ConfigError

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 12345, 12345)
    with pytest.raises(ConfigError, match="owned by uid 12345"):
        raykv.connect(local_disk=str(shared), max_local_disk_size=0.1, ray_address="unused")


def test_a_planted_huge_file_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    """A valid-looking name over 1 GiB of garbage (sparse) at restart: a miss, and the
    reader never allocates the file's size (header first)."""
    import resource

    first = DiskStore(tmp_path, 4 << 30)
    put(first, [1])
    path = files(first)[0]
    first.close()
    with open(path, "r+b") as f:
        f.truncate(1 << 30)  # the header stays, the size no longer matches it
    store = DiskStore(tmp_path, 4 << 30)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        metas, arrays = store.get_batch([key(1)])
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert metas == [None] and arrays[0].size == 0
        assert grown_kib < 200 * 1024, f"peak RSS grew {grown_kib} KiB"
    finally:
        store.close()


# ----- leftovers of crashed writes (#13) -----


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_restart_removes_stale_temp_files_and_keeps_recent_ones(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 1 << 20)
    put(first, range(2))
    first.close()
    shard = Path(first.path_of(key(0))).parent
    stale = shard / f".{key(5).to_string()}.0123456789ab{cf.TMP_SUFFIX}"  # a crashed write
    recent = shard / f".{key(6).to_string()}.ba9876543210{cf.TMP_SUFFIX}"  # maybe a live one
    layout = Path(first.directory) / f"{cf.LAYOUT_FILE}.deadbeef{cf.TMP_SUFFIX}"
    for path in (stale, recent, layout):
        path.write_bytes(b"partial")
    _age(stale, cf.STALE_TMP_SECS + 5)
    _age(layout, cf.STALE_TMP_SECS + 5)
    second = DiskStore(tmp_path, 1 << 20)
    try:
        assert not stale.exists() and not layout.exists() and recent.exists()
        assert sorted(second.keys()) == [key(0), key(1)]
        report = second.check(fix=True)  # check(fix=True) removes temps of any age
        assert report["temp_files"] == 1 and not recent.exists()
        assert files(second, "*.tmp") == []
    finally:
        second.close()


def test_a_written_ack_names_only_chunks_whose_files_are_complete(
    store: DiskStore, monkeypatch
) -> None:
    """The ack the manager indexes: a write that fails with ENOSPC is skipped, not
    accepted, so no index promises a chunk the disk does not hold; a later put writes it."""
    real = os.write

    def full_for_chunk_2(fd, data):
        if key(2).chunk_hash in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(cf.os, "write", full_for_chunk_2)
    keys, metas, arrays = zip(*[(key(i), *chunk(i)) for i in range(4)], strict=True)
    ack = store.put_written(list(keys), list(metas), list(arrays))
    assert ack.accepted == [key(0), key(1), key(3)] and ack.skipped == [key(2)]
    assert store.contains([key(2)]) == [False] and store.stats()["errors"] == 1
    monkeypatch.undo()
    again = store.put_written([key(2)], [metas[2]], [arrays[2]])
    assert again.accepted == [key(2)] and store.contains([key(2)]) == [True]
    assert store.put_written([key(2)], [metas[2]], [arrays[2]]).accepted == [key(2)]  # held


def test_a_failed_directory_fsync_leaves_no_file_outside_the_index(tmp_path: Path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20, fsync=True)
    try:
        monkeypatch.setattr(cf, "_fsync_dir", lambda path: (_ for _ in ()).throw(OSError(5, "EIO")))
        ack = store.put_written([key(1)], [chunk(1)[0]], [chunk(1)[1]])
        assert ack.skipped == [key(1)] and not ack.accepted
        assert files(store, "*") == [] and store.stats()["used_bytes"] == 0
        monkeypatch.undo()
        assert store.put_written([key(1)], [chunk(1)[0]], [chunk(1)[1]]).accepted == [key(1)]
        assert len(files(store, "*")) == 1
    finally:
        store.close()


def test_a_chunk_whose_meta_cannot_be_framed_is_skipped_and_costs_no_write_slot(
    tmp_path: Path, monkeypatch
) -> None:
    """A meta the codec rejects (one that came pickled, past its own checks) skips its
    chunk; it used to keep a write slot for good, and once all were gone every put
    waited and was skipped."""
    store = DiskStore(tmp_path, 1 << 20, max_pending_writes=2, queue_wait_s=0.05)
    real = ds.record_size

    def picky(meta, k):
        if k == key(1):
            raise ValueError("shape[0] must be 2 for KV_2LTD")
        return real(meta, k)

    monkeypatch.setattr(ds, "record_size", picky)
    for _ in range(3):
        assert put(store, [1], flush=False).skipped == [key(1)]
    assert put(store, [2, 3]).accepted == [key(2), key(3)]
    store.close()


def test_a_put_after_close_is_skipped_and_flush_does_not_wait_for_it(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    store._pool.shutdown(wait=True)  # closing: the write pool is gone
    ack = put(store, [1], flush=False)
    assert ack.skipped == [key(1)] and not ack.accepted
    t0 = time.monotonic()
    assert store.flush(5) and time.monotonic() - t0 < 1
    assert store._index.reserved == 0
    store.close()


def test_recency_reaches_the_files_in_batches_off_the_read_path(
    tmp_path: Path, monkeypatch
) -> None:
    """A read queues its chunks' new mtimes instead of touching each file (a metadata
    write per chunk on the lookup's path): they land in one batch later, or at close."""
    monkeypatch.setattr(ds, "STAMP_DELAY_S", 60.0)
    store = DiskStore(tmp_path, 1 << 20)
    put(store, [1])
    store._apply_stamps()  # what the put queued
    path = store.path_of(key(1))
    before = os.stat(path).st_mtime_ns
    time.sleep(0.01)
    assert store.get([key(1)])[0] is not None
    assert os.stat(path).st_mtime_ns == before  # not on the read's path
    store.close()
    assert os.stat(path).st_mtime_ns > before
