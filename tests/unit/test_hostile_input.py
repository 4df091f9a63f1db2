"""Hostile and malformed input, without Ray: the payload codec, the disk read path, the Redis
read path (a real redis-server, no Ray), keys and config.

Every case must end in a clear error (`PayloadError`, `InvalidInputError`, `ConfigError`)
or a miss: never a hang, an unbounded allocation, a crash, or code execution. Remote and
disk data is never unpickled: pickles that would create a marker file are planted and
the marker must never appear.
"""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raykv.config import RayKVConfig
from raykv.errors import ConfigError, InvalidInputError, PayloadError
from raykv.keys import CacheKey, KeyMaker, as_token_array, make_key
from raykv.payload import MAX_PAYLOAD_BYTES, PayloadMeta, decode, encode, read_header
from raykv.tiers.disk import DiskStore

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
META = PayloadMeta("float16", (2, 2, 4, 8))
KEY = make_key("m", 1, 0, "ab" * 16, "float16")


def payload(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, META.nbytes, dtype=np.uint8)


def record(seed: int = 0, key: CacheKey = KEY) -> bytes:
    return encode(payload(seed), META, key.to_string()).tobytes()


class Marker:
    """Unpickling this creates `path`: proof that someone unpickled planted data."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def forged_header(
    *,
    dtype: int = 1,
    layout: int = 0,
    shape: tuple[int, ...] = (2, 2, 4, 8),
    nbytes: int | None = None,
    key: bytes = b"",
    ndim: int | None = None,
    serde: int = 0,
) -> bytes:
    """A header with a *valid* header checksum: what a hostile writer can produce."""
    ndim = len(shape) if ndim is None else ndim
    nbytes = 2 * math.prod(shape) if nbytes is None else nbytes
    head = struct.pack(
        "<4sHBBBBHQQ", b"RKVC", 1, serde, dtype, layout, ndim, len(key), nbytes % 2**64, 0
    )
    head += struct.pack(f"<{len(shape)}Q", *shape) + key
    return head + struct.pack("<I", xxhash.xxh32_intdigest(head))


# ----- the codec -----


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_never_decode_and_fail_only_with_payload_error(data: bytes) -> None:
    with pytest.raises(PayloadError):
        decode(data)


@FAST
@given(st.data())
def test_a_truncated_or_bit_flipped_record_is_rejected(data: st.DataObject) -> None:
    good = bytearray(record())
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(good) - 1))
        bad = bytes(good[:cut])
    else:
        pos = data.draw(st.integers(0, len(good) - 1))
        bit = data.draw(st.integers(0, 7))
        good[pos] ^= 1 << bit
        bad = bytes(good)
    with pytest.raises(PayloadError):
        decode(bad, expected_key=KEY.to_string())


@pytest.mark.parametrize(
    "fields",
    [
        {"nbytes": 2**63},  # huge declared size
        {"nbytes": MAX_PAYLOAD_BYTES + 1},
        {"shape": (2**62, 2**62, 2, 2)},  # shape whose product overflows 64 bits
        {"dtype": 200},  # unknown dtype code
        {"layout": 9},  # unknown layout
        {"serde": 7},  # unknown serde
        {"ndim": 200, "shape": ()},  # declared ndim beyond the limit
        {"key": b"\xff\xfe not utf-8"},
        {"shape": (2, 2, 4), "nbytes": 32},  # KV_2LTD with 3 dims
    ],
)
def test_a_forged_header_with_a_valid_checksum_is_rejected_before_any_allocation(
    fields: dict[str, Any],
) -> None:
    head = forged_header(**fields)
    with pytest.raises(PayloadError):
        read_header(head)
    with pytest.raises(PayloadError):
        decode(head + b"\x00" * 64)


def test_read_header_honours_a_tight_size_bound() -> None:
    head = forged_header(nbytes=1 << 30, shape=(2, 1, 1 << 28, 1))
    with pytest.raises(PayloadError, match="exceeds"):
        read_header(head, max_nbytes=1 << 20)


def test_a_record_of_another_key_or_dtype_is_not_accepted_for_this_key() -> None:
    other = make_key("m", 1, 0, "cd" * 16, "float16")
    with pytest.raises(PayloadError, match="belongs to key"):
        decode(record(key=other), expected_key=KEY.to_string())
    # Right key string, valid checksums, but the header declares bfloat16 KV.
    forged = encode(payload(), PayloadMeta("bfloat16", META.shape), KEY.to_string()).tobytes()
    assert decode(forged, KEY.to_string()).meta.dtype == "bfloat16"
    with pytest.raises(PayloadError, match="holds bfloat16 KV"):
        decode(forged, KEY.to_string(), KEY.kv_dtype)


def test_a_pickle_is_never_unpickled_by_the_codec(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    bomb = pickle.dumps(Marker(str(marker)))
    for data in (bomb, b"RKVC" + bomb, forged_header(key=b"k")[:-4] + bomb):
        with pytest.raises(PayloadError):
            decode(data)
    assert not marker.exists()


# ----- the disk read path -----


@pytest.fixture
def disk(tmp_path: Path):
    store = DiskStore(tmp_path / "disk", 1 << 20, kv_dtype="float16", read_workers=1)
    yield store
    store.close()


def dkey(i: int) -> CacheKey:
    return make_key("m", 1, 0, f"{i:032x}", "float16")


def stored(store: DiskStore, n: int = 4) -> list[CacheKey]:
    keys = [dkey(i) for i in range(n)]
    store.put(keys, [META] * n, [payload(i) for i in range(n)])
    assert store.flush(5)
    return keys


def get_within(store: DiskStore, keys: list[CacheKey], timeout: float = 5.0) -> list[Any]:
    """`store.get` on a thread: a read that blocks (a FIFO) must not hang the test."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(store.get(keys)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "a disk read hung"
    return out[0]


@FAST
@given(garbage=st.binary(max_size=2048))
def test_garbage_in_a_chunk_file_is_a_miss_and_the_file_goes(tmp_path_factory, garbage) -> None:
    store = DiskStore(tmp_path_factory.mktemp("d"), 1 << 20, kv_dtype="float16")
    try:
        (key,) = stored(store, 1)
        Path(store.path_of(key)).write_bytes(garbage)
        assert store.get([key]) == [None]
        assert not os.path.exists(store.path_of(key))
        assert store.contains([key]) == [False]
    finally:
        store.close()


def test_a_chunk_file_declaring_another_dtype_is_a_miss_and_check_flags_it(
    disk: DiskStore,
) -> None:
    keys = stored(disk, 2)
    forged = encode(payload(), PayloadMeta("bfloat16", META.shape), keys[0].to_string())
    Path(disk.path_of(keys[0])).write_bytes(forged.tobytes())
    assert disk.check(fix=False)["bad_files"] == 1  # a header-only check sees it too
    got = disk.get(keys)
    assert got[0] is None and got[1] is not None
    assert not os.path.exists(disk.path_of(keys[0]))


def test_a_pickle_bomb_in_a_chunk_file_is_a_miss_and_never_runs(
    disk: DiskStore, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    (key,) = stored(disk, 1)
    Path(disk.path_of(key)).write_bytes(pickle.dumps(Marker(str(marker))))
    assert disk.get([key]) == [None]
    reopened = DiskStore(tmp_path / "disk", 1 << 20, kv_dtype="float16")
    try:
        Path(reopened.path_of(key)).parent.mkdir(exist_ok=True)
        Path(reopened.path_of(key)).write_bytes(pickle.dumps(Marker(str(marker))))
        reopened.check(fix=True, deep=True)
        assert reopened.get([key]) == [None]
    finally:
        reopened.close()
    assert not marker.exists()


def test_a_fifo_under_a_chunk_name_is_a_miss_not_a_hang(disk: DiskStore, tmp_path: Path) -> None:
    keys = stored(disk, 2)
    os.unlink(disk.path_of(keys[0]))
    os.mkfifo(disk.path_of(keys[0]))
    assert get_within(disk, keys)[0] is None
    # check() and a restart must not block on it either.
    done = threading.Event()
    threading.Thread(target=lambda: (disk.check(fix=True), done.set()), daemon=True).start()
    assert done.wait(5), "check() hung on a FIFO"
    if not os.path.lexists(disk.path_of(keys[0])):  # check() removed it: plant it again
        os.mkfifo(disk.path_of(keys[0]))
    reopened = DiskStore(tmp_path / "disk", 1 << 20, kv_dtype="float16")
    try:
        assert keys[0] not in reopened.keys()
        assert get_within(reopened, [keys[0]]) == [None]
    finally:
        reopened.close()


def test_a_symlink_under_a_chunk_name_is_not_followed(disk: DiskStore, tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(record(7, dkey(0)))  # even a valid record behind a link is refused
    keys = stored(disk, 2)
    os.unlink(disk.path_of(keys[0]))
    os.symlink(target, disk.path_of(keys[0]))
    assert disk.get([keys[0]]) == [None]
    assert target.exists()  # the link went, never its target


def test_a_huge_file_under_a_chunk_name_is_not_read_into_memory(disk: DiskStore) -> None:
    (key,) = stored(disk, 1)
    with open(disk.path_of(key), "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB declared, no disk used
    t0 = time.monotonic()
    assert disk.get([key]) == [None]
    assert time.monotonic() - t0 < 2.0


def test_stray_files_in_the_disk_directory_are_ignored_and_check_removes_them(
    disk: DiskStore, tmp_path: Path
) -> None:
    keys = stored(disk, 2)
    shard = Path(disk.path_of(keys[0])).parent
    (shard / "not-a-key.rkv").write_bytes(b"garbage")
    (shard / ".half-written.tmp").write_bytes(b"garbage")
    (Path(disk.directory) / "zz").mkdir()
    (Path(disk.directory) / "zz" / "m@1@0@..%2Fevil@float16.rkv").write_bytes(b"x")
    reopened = DiskStore(tmp_path / "disk", 1 << 20, kv_dtype="float16")
    try:
        assert sorted(reopened.keys()) == sorted(keys)
        report = reopened.check(fix=True)
        assert report["bad_files"] >= 1 and report["temp_files"] == 1
        assert not (shard / "not-a-key.rkv").exists()
        metas, _ = reopened.get_batch(keys)
        assert metas == [META, META]
    finally:
        reopened.close()


@pytest.mark.parametrize(
    "bad",
    [
        CacheKey("m", 1, 0, "../../../../escape0000000000000", "float16"),
        CacheKey("m", 1, 0, "ab" * 16, "f16/../../../escape"),
        CacheKey("m", "1/../..", 0, "ab" * 16, "float16"),  # type: ignore[arg-type]
    ],
)
def test_a_key_with_path_separators_never_becomes_a_path(
    disk: DiskStore, tmp_path: Path, bad: CacheKey
) -> None:
    ack = disk.put([bad], [META], [payload()])
    assert disk.flush(5)
    assert ack.skipped == [bad] and not ack.accepted
    assert disk.get([bad]) == [None] and disk.remove([bad]) == 0
    inside = Path(disk.directory).resolve()
    for path in tmp_path.rglob("*"):
        assert path.resolve() == inside or inside in path.resolve().parents or path.is_dir()
    with pytest.raises(InvalidInputError):
        disk.path_of(bad)


# ----- the Redis read path (a real redis-server; no Ray) -----


def _redis_backend(url: str) -> Any:
    from raykv.tiers.remote import RedisBackend

    return RedisBackend(url, RayKVConfig(namespace="hostile"), timeout_s=2.0)


def test_garbage_under_raykv_redis_names_is_a_miss_and_is_deleted(
    redis_server: Any, tmp_path: Path
) -> None:
    import redis

    marker = tmp_path / "marker"
    keys = [dkey(i) for i in range(6)]
    values = [
        b"",
        b"garbage",
        pickle.dumps(Marker(str(marker))),
        record(1, keys[0]),  # a valid record of another key
        forged_header(nbytes=2**63) + b"x" * 32,
        record(4, keys[4])[:-3],  # truncated
    ]
    client = redis.Redis.from_url(redis_server.url)
    backend = _redis_backend(redis_server.url)
    try:
        for k, v in zip(keys, values, strict=True):
            client.set(f"hostile:kv:{k.to_string()}", v)
        client.set("hostile:kv:not-a-key", b"junk")

        async def scenario() -> tuple[Any, ...]:
            metas, arrays = await backend.get_batch(keys)
            listed = await backend.keys()
            await backend.close()
            return metas, arrays, listed

        metas, arrays, listed = asyncio.run(scenario())
        assert metas == [None] * 6 and all(a.size == 0 for a in arrays)
        assert listed == []  # every garbage value was deleted; "not-a-key" is not listed
        assert client.exists("hostile:kv:not-a-key")
    finally:
        client.close()
    assert not marker.exists()


def test_a_redis_put_whose_array_disagrees_with_its_meta_is_skipped_and_counted(
    redis_server: Any,
) -> None:
    import redis

    keys = [dkey(i) for i in range(6)]
    arrays: list[Any] = [
        payload(0)[:-1],  # one byte short
        np.zeros(META.nbytes * 2, dtype=np.uint8),  # too long
        None,  # not an array
        np.array([object()] * (META.nbytes // 8), dtype=object),  # Python objects, same nbytes
        list(payload(4)),
        payload(5),  # the only good one
    ]
    backend = _redis_backend(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:

        async def scenario() -> tuple[Any, ...]:
            ack = await backend.put(keys, [META] * 6, arrays)  # never raises
            stats = await backend.stats()
            metas, got = await backend.get_batch(keys)
            await backend.close()
            return ack, stats, metas, got

        ack, stats, metas, got = asyncio.run(scenario())
        assert ack.skipped == keys[:5] and ack.accepted == keys[5:]
        assert stats["skipped"] == 5 and stats["entries"] == 1
        assert metas == [None] * 5 + [META] and np.array_equal(got[5], payload(5))
        assert client.keys("hostile:kv:*") == [f"hostile:kv:{keys[5].to_string()}".encode()]
    finally:
        client.close()


# ----- keys and tokens -----


@pytest.mark.parametrize(
    "tokens",
    [
        [1.5, 2.0],
        ["a", "b"],
        [1, None],
        [True, False],
        [[1, 2], [3, 4]],
        [-1, 5],
        [2**31],
        [2**70],
        "hello",
        b"\x00\x01",
        {1, 2},
        np.array([1.0, 2.0]),
        np.array([1, 2], dtype=object),
        3,
        None,
    ],
)
def test_non_integer_negative_or_oversized_tokens_raise_invalid_input(tokens: Any) -> None:
    with pytest.raises(InvalidInputError):
        KeyMaker(chunk_size=4).keys(tokens)


@pytest.mark.parametrize("tokens", [[], np.array([], dtype=np.int64), [1, 2, 3]])
def test_an_empty_or_short_prompt_has_no_keys(tokens: Any) -> None:
    assert KeyMaker(chunk_size=4).keys(tokens) == []


def test_keys_of_a_one_million_token_prompt_are_quick() -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, 1_000_000)
    t0 = time.perf_counter()
    spans = KeyMaker(chunk_size=256).keys(tokens)
    assert len(spans) == 1_000_000 // 256
    assert time.perf_counter() - t0 < 2.0


@FAST
@given(st.text(min_size=1, max_size=40))
def test_key_strings_never_contain_path_separators(model: str) -> None:
    try:
        key = make_key(model, 1, 0, "ab" * 16, "float16")
    except InvalidInputError:
        return  # too long once quoted
    text = key.to_string()
    assert "/" not in text and "\\" not in text and "\x00" not in text
    assert CacheKey.from_string(text) == key


@pytest.mark.parametrize(
    "text",
    ["../x@1@0@" + "ab" * 16 + "@float16", "m@1@0@" + "ab" * 16 + "@../../etc", "a/b@1@0@x@y", ""],
)
def test_key_strings_with_separators_or_junk_do_not_parse(text: str) -> None:
    with pytest.raises(InvalidInputError):
        CacheKey.from_string(text)


# ----- config -----


@pytest.mark.parametrize(
    "field",
    ["max_local_cpu_size", "max_local_disk_size", "max_remote_size", "pin_lease_secs"],
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1", True, None])
def test_nan_infinite_or_mistyped_sizes_fail_at_load_naming_the_key(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        RayKVConfig.load(**{field: value})


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999", "0x10", "ten"])
def test_nan_or_garbage_size_in_the_environment_fails_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("RAYKV_MAX_LOCAL_CPU_SIZE", text)
    with pytest.raises(ConfigError, match="RAYKV_MAX_LOCAL_CPU_SIZE|max_local_cpu_size"):
        RayKVConfig.load()


def test_a_yaml_file_cannot_construct_python_objects(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "raykv.yaml"
    path.write_text(f"extra_config: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    with pytest.raises(ConfigError):
        RayKVConfig.from_file(path)
    assert not marker.exists()


def test_token_arrays_are_normalised_once_to_little_endian_int32() -> None:
    arr = as_token_array(np.array([1, 2, 3], dtype=">i8"))
    assert arr.dtype == np.dtype("<i4") and arr.tolist() == [1, 2, 3]


# ----- wire key forms: any msgpack value may arrive -----

_HASH = "0123456789abcdef" * 2


@pytest.mark.parametrize(
    "identity, hashes",
    [
        (["m", 1, 0, "float16"], [7]),
        (["m", 1, 0, "float16"], [None]),
        (["m", 1, 0, "float16"], [{"a": 1}]),
        (["m", 1, 0, "float16"], [b"\x00" * 16]),
        (["m", 1, 0, "float16"], ["0" * 31]),
        (["m", 1, 0, "float16"], ["G" * 32]),
        (["m", 1, 0, "float16"], [_HASH.upper()]),
        (["m", 1, 0, "float16"], {"h": _HASH}),
        (["m", 1, 0, "float16"], None),
        ([{"m": 1}, 1, 0, "float16"], [_HASH]),
        (["m", "1", 0, "float16"], [_HASH]),
        (["m", 1, 5, "float16"], [_HASH]),
        (["m", 1, 0, None], [_HASH]),
        (None, [_HASH]),
        (["m", 1, 0, "float16"], ["a" * 31, "a" * 33]),  # 64 hex digits, not two of 32
        (["m", 1, 0, "float16"], ["", "a" * 64]),
        (["m", 1, 0, "bf/../x"], [_HASH]),  # no dtype name
        (["m", 1, 0, "x" * 100_000], [_HASH]),
        (["", 1, 0, "float16"], [_HASH]),  # no model name
    ],
)
def test_a_malformed_wire_key_form_is_an_invalid_input_error(identity: Any, hashes: Any) -> None:
    import msgpack

    from raykv.wire import KEYS_WIRE, SPANS_WIRE, split_spans, unpack_keys

    keys_form = msgpack.packb([KEYS_WIRE, identity, hashes])
    with pytest.raises(InvalidInputError, match="malformed"):
        unpack_keys(keys_form)
    ends = list(range(1, 1 + len(hashes))) if isinstance(hashes, list) else [1]
    spans_form = msgpack.packb([SPANS_WIRE, identity, hashes, ends])
    with pytest.raises(InvalidInputError, match="malformed"):
        split_spans(spans_form)
    with pytest.raises(InvalidInputError, match="malformed"):
        unpack_keys(spans_form)


def test_negative_span_ends_in_a_wire_form_are_an_invalid_input_error() -> None:
    import msgpack

    from raykv.wire import SPANS_WIRE, split_spans

    with pytest.raises(InvalidInputError, match="ends"):
        split_spans(msgpack.packb([SPANS_WIRE, ["m", 1, 0, "float16"], [_HASH], [-16]]))


def test_a_msgpack_ext_type_in_a_wire_form_is_an_invalid_input_error() -> None:
    import msgpack

    from raykv.wire import KEYS_WIRE, unpack_keys

    form = msgpack.packb([KEYS_WIRE, ["m", 1, 0, "float16"], [msgpack.ExtType(5, b"x" * 32)]])
    with pytest.raises(InvalidInputError, match="malformed"):
        unpack_keys(form)


def test_well_formed_wire_forms_still_round_trip() -> None:
    from raykv.wire import PackedKeys, PackedSpans, split_spans, unpack_keys

    spans = KeyMaker(chunk_size=4, model_name="m").keys(list(range(1, 13)))
    keys, ends = split_spans(PackedSpans.of(spans).wire())
    assert keys == [s.key for s in spans] and ends == [4, 8, 12]
    assert unpack_keys(PackedKeys.of(keys).wire()) == keys
