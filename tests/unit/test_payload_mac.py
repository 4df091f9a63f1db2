"""`payload_secret`: keyed (HMAC) records on disk and in Redis, without Ray.

A writer without the secret (someone who can write the disk directory or the Redis
server) must not be able to plant KV that a reader with the secret serves: a plain
record, one keyed with another secret, and a tampered one whose plain checksums were
recomputed are all misses (never exceptions); the right record reads back bit-exact.
The secret itself never shows in a repr, an error, `config show`, logs or stats.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from raykv_testing import chunk_key

import raykv
from raykv import payload as pl
from raykv.config import RayKVConfig
from raykv.errors import ConfigError, PayloadError
from raykv.keys import CacheKey
from raykv.payload import PayloadMeta, decode, encode, read_header
from raykv.tiers.disk import DiskStore

SECRET = "correct horse battery staple"
OTHER = "another secret of 16+ chars"
META = PayloadMeta("float16", (2, 2, 4, 8))


key = functools.partial(chunk_key, dtype="float16")


def data(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, META.nbytes, dtype=np.uint8)


def rec(seed: int = 0, k: CacheKey | None = None, secret: str | None = SECRET) -> bytes:
    k = key(0) if k is None else k
    return encode(data(seed), META, k.to_string(), secret=secret).tobytes()


def replug_plain(record: bytes) -> bytes:
    """`record` (of any version) rewritten as a plain version 1 record with valid
    checksums: what a writer who knows the format but not the secret can produce."""
    head = read_header(record, secret=SECRET if record[4] == pl.VERSION_KEYED else None)
    body = record[head.header_len :]
    fixed = bytearray(record[: head.header_len - 4])
    struct.pack_into("<H", fixed, 4, pl.VERSION)
    struct.pack_into("<Q", fixed, pl._FIXED.size - 8, xxhash.xxh3_64_intdigest(body))
    return bytes(fixed) + struct.pack("<I", xxhash.xxh32_intdigest(bytes(fixed))) + body


def tamper_body(record: bytes) -> bytes:
    """One body byte flipped, the plain checksums recomputed, the version kept."""
    out = bytearray(record)
    out[-1] ^= 0x5A
    head = read_header(record, secret=SECRET)
    struct.pack_into(
        "<Q", out, pl._FIXED.size - 8, xxhash.xxh3_64_intdigest(bytes(out[head.header_len :]))
    )
    hlen = head.header_len - 4
    struct.pack_into("<I", out, hlen, xxhash.xxh32_intdigest(bytes(out[:hlen])))
    return bytes(out)


def forgeries(k: CacheKey | None = None) -> dict[str, bytes]:
    """Records of `k` that a reader with SECRET must refuse."""
    return {
        "plain": rec(k=k, secret=None),
        "other secret": rec(k=k, secret=OTHER),
        "tampered, checksums recomputed": tamper_body(rec(k=k)),
        "tampered, made plain": replug_plain(tamper_body(rec(k=k))),
        "keyed record made plain": replug_plain(rec(k=k)),
    }


# ----- the codec -----


def test_a_keyed_record_round_trips_bit_exactly_and_is_as_long_as_a_plain_one() -> None:
    keyed = rec()
    assert len(keyed) == len(rec(secret=None))  # tier budgets do not change
    assert keyed[4] == pl.VERSION_KEYED and rec(secret=None)[4] == pl.VERSION
    out = decode(keyed, key(0).to_string(), "float16", secret=SECRET)
    assert np.array_equal(out.data, data()) and out.meta == META
    assert decode(keyed, secret=SECRET.encode()).key == key(0).to_string()  # bytes work too


@pytest.mark.parametrize("name", sorted(forgeries()))
def test_a_reader_with_the_secret_refuses_every_forgery(name: str) -> None:
    with pytest.raises(PayloadError):
        decode(forgeries()[name], key(0).to_string(), "float16", secret=SECRET)


def test_the_tag_covers_the_header_too() -> None:
    other = key(1).to_string().encode()
    keyed = bytearray(rec())
    start = keyed.index(key(0).to_string().encode())
    keyed[start : start + len(other)] = other  # same length: only the key differs
    with pytest.raises(PayloadError, match="MAC mismatch"):
        decode(bytes(keyed), secret=SECRET)


def test_a_reader_without_the_secret_refuses_a_keyed_record() -> None:
    with pytest.raises(PayloadError, match="no payload_secret"):
        decode(rec())
    with pytest.raises(PayloadError, match="no payload_secret"):
        read_header(rec())


def test_the_header_alone_tells_a_keyed_reader_that_a_record_is_plain() -> None:
    header = rec(secret=None)[: pl._FIXED.size + 8 * 4 + len(key(0).to_string()) + 4]
    with pytest.raises(PayloadError, match="requires one"):
        read_header(header, secret=SECRET)
    assert read_header(rec(), secret=SECRET).keyed


def test_any_single_bit_flip_of_a_keyed_record_is_detected() -> None:
    good = rec()
    for pos in range(0, len(good), 7):
        bad = bytearray(good)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(PayloadError):
            decode(bytes(bad), secret=SECRET)


def test_plain_reads_compute_no_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("HMAC computed on the plain path")

    monkeypatch.setattr(hmac, "new", boom)
    assert np.array_equal(decode(rec(secret=None)).data, data())


def test_an_empty_secret_is_refused() -> None:
    with pytest.raises(PayloadError, match="empty"):
        encode(data(), META, "k", secret="")


# ----- config -----


def test_payload_secret_defaults_to_none_and_needs_16_characters() -> None:
    assert RayKVConfig().payload_secret is None
    assert RayKVConfig(payload_secret=SECRET).payload_secret == SECRET
    for bad in ("", "short-secret", "x" * 15):
        with pytest.raises(ConfigError, match="at least 16 characters") as err:
            RayKVConfig(payload_secret=bad)
        assert not bad or bad not in str(err.value)
    with pytest.raises(ConfigError, match="payload_secret") as err:
        RayKVConfig(payload_secret=1234567890123456789)  # type: ignore[arg-type]
    assert "1234567890123456789" not in str(err.value)


def test_payload_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_PAYLOAD_SECRET", SECRET)
    assert RayKVConfig.load().payload_secret == SECRET
    monkeypatch.setenv("RAYKV_PAYLOAD_SECRET", "too-short")
    with pytest.raises(ConfigError, match="RAYKV_PAYLOAD_SECRET") as err:
        RayKVConfig.load()
    assert "too-short" not in str(err.value)


@pytest.mark.parametrize("value", ["", "  ", "none", "null", "NULL", "~"])
def test_an_empty_or_null_env_secret_never_turns_the_mac_off(
    value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "raykv.yaml"
    path.write_text(f"payload_secret: {SECRET}\n")
    monkeypatch.setenv("RAYKV_CONFIG_FILE", str(path))
    assert RayKVConfig.load().payload_secret == SECRET
    monkeypatch.setenv("RAYKV_PAYLOAD_SECRET", value)
    with pytest.raises(ConfigError, match="RAYKV_PAYLOAD_SECRET is set but empty or null"):
        RayKVConfig.load()


def test_a_secret_is_the_same_from_the_file_and_the_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "raykv.yaml"
    path.write_text(f'payload_secret: "{SECRET}"\n')
    from_file = RayKVConfig.from_file(path).payload_secret
    monkeypatch.setenv("RAYKV_PAYLOAD_SECRET", SECRET)
    assert RayKVConfig.from_env().payload_secret == from_file == SECRET
    for padded in (f" {SECRET}", f"{SECRET}\n", f"{SECRET} "):  # never trimmed: refused
        monkeypatch.setenv("RAYKV_PAYLOAD_SECRET", padded)
        with pytest.raises(ConfigError, match="whitespace"):
            RayKVConfig.from_env()
        path.write_text(f"payload_secret: {padded!r}\n".replace("'", '"'))
        with pytest.raises(ConfigError, match="whitespace"):
            RayKVConfig.from_file(path)


def test_payload_secret_is_masked_everywhere_it_could_be_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = RayKVConfig(payload_secret=SECRET)
    shown = [
        repr(cfg),
        str(cfg),
        cfg.to_yaml(mask_secrets=True),
        str(cfg.to_dict(mask_secrets=True)),
    ]
    assert all(SECRET not in text for text in shown)
    assert cfg.to_dict(mask_secrets=True)["payload_secret"] == "***"
    assert RayKVConfig.from_dict(yaml_load(cfg.to_yaml())) == cfg  # unmasked YAML reads back
    with pytest.raises(ConfigError) as err:  # a misspelt key does not echo the value
        RayKVConfig.from_dict({"payload_secert": SECRET})
    assert SECRET not in str(err.value) and "did you mean 'payload_secret'" in str(err.value)
    monkeypatch.setattr(raykv, "__version__", getattr(raykv, "__version__", "0"), raising=False)
    from raykv.cli import main

    monkeypatch.setenv("RAYKV_PAYLOAD_SECRET", SECRET)
    assert main(["config", "show"]) == 0
    assert main(["config", "show", "--json"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and out.count("***") >= 2


def yaml_load(text: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(text)


# ----- the disk tier -----


def disk_store(root: Path, secret: str | None) -> DiskStore:
    return DiskStore(root, 1 << 20, kv_dtype="float16", read_workers=1, payload_secret=secret)


def test_disk_from_config_passes_the_secret(tmp_path: Path) -> None:
    cfg = RayKVConfig(
        local_disk=str(tmp_path),
        max_local_disk_size=0.001,
        payload_secret=SECRET,
        kv_dtype="float16",
    )
    store = DiskStore.from_config(cfg)
    try:
        store.put([key(0)], [META], [data()])
        assert store.flush(5)
        assert Path(store.path_of(key(0))).read_bytes() != rec(secret=None)
        assert decode(Path(store.path_of(key(0))).read_bytes(), secret=SECRET).key
        assert SECRET not in repr(store) and SECRET not in str(store.stats())
    finally:
        store.close()


def test_planted_disk_files_are_misses_for_a_reader_with_the_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = disk_store(tmp_path, SECRET)
    try:
        keys = [key(i) for i in range(len(forgeries()) + 1)]
        store.put(keys, [META] * len(keys), [data(0)] * len(keys))
        assert store.flush(5)
        planted = dict(zip(keys, forgeries().keys(), strict=False))
        for k, name in planted.items():
            # same size as the real file: past the index's size check
            Path(store.path_of(k)).write_bytes(forgeries(k)[name])
        assert store.check(fix=False, deep=True)["bad_files"] == len(planted)
        with caplog.at_level(logging.DEBUG):
            got = store.get(keys)  # never raises
        assert got[: len(planted)] == [None] * len(planted)
        assert got[-1] is not None and np.array_equal(got[-1][1], data(0))
        assert SECRET not in caplog.text
        assert store.stats()["errors"] == len(planted)
        assert all(not Path(store.path_of(k)).exists() for k in planted)
        # a fresh put with the right secret reads back bit-exact
        store.put([keys[0]], [META], [data(0)])
        assert store.flush(5)
        assert np.array_equal(store.get([keys[0]])[0][1], data(0))
    finally:
        store.close()


def test_a_disk_directory_keyed_with_one_secret_is_misses_without_it(tmp_path: Path) -> None:
    """Each secret (and none) has a directory of its own: another secret's reader never
    sees, serves or deletes the files; a file of another secret planted in a reader's
    own directory is refused on read and removed."""
    for writer_secret, reader_secret in ((SECRET, None), (SECRET, OTHER), (None, SECRET)):
        root = tmp_path / f"{writer_secret is None}-{reader_secret is None}-{reader_secret}"
        writer = disk_store(root, writer_secret)
        writer.put([key(0)], [META], [data()])
        assert writer.flush(5)
        written = Path(writer.path_of(key(0)))
        writer.close()
        reader = disk_store(root, reader_secret)
        try:
            assert reader.keys() == [] and reader.get([key(0)]) == [None]
            planted = Path(reader.path_of(key(0)))
            planted.parent.mkdir(parents=True, exist_ok=True)
            planted.write_bytes(written.read_bytes())
        finally:
            reader.close()
        reader = disk_store(root, reader_secret)
        try:
            assert reader.keys() == [key(0)]  # indexed by name, refused on read
            assert reader.get([key(0)]) == [None] and not planted.exists()
        finally:
            reader.close()
        again = disk_store(root, writer_secret)
        try:  # the writer's own file, untouched
            assert again.get([key(0)])[0] is not None and written.exists()
        finally:
            again.close()


# ----- the Redis back end (a real redis-server; no Ray) -----


def redis_backend(url: str, secret: str | None) -> Any:
    from raykv.tiers.remote import RedisBackend

    cfg = RayKVConfig(namespace="mac", payload_secret=secret)
    return RedisBackend(url, cfg, timeout_s=2.0)


def test_planted_redis_values_are_misses_deleted_and_stored_again(redis_server: Any) -> None:
    """Under a secret's own names (`secret_tag`) a value that fails its MAC is corrupt or
    forged, never another secret's: a miss, deleted, and the next put stores the key
    (with SET NX the forgery blocked that key for good)."""
    import redis

    planted = forgeries()
    keys = [key(i) for i in range(len(planted))]
    client = redis.Redis.from_url(redis_server.url)
    backend = redis_backend(redis_server.url, SECRET)
    try:
        for k, name in zip(keys, planted, strict=True):
            client.set(backend._name(k), forgeries(k)[name])

        async def scenario() -> tuple[Any, ...]:
            first = await backend.get_batch(keys)
            left = [client.exists(backend._name(k)) for k in keys]
            ack = await backend.put(keys, [META] * len(keys), [data(3)] * len(keys))
            second = await backend.get_batch(keys)
            stats = await backend.stats()
            await backend.close()
            return first, left, ack, second, stats

        first, left, ack, second, stats = asyncio.run(scenario())
        assert first[0] == [None] * len(keys) and left == [0] * len(keys)
        assert ack.accepted == keys and second[0] == [META] * len(keys)
        assert all(np.array_equal(a, data(3)) for a in second[1])
        assert client.get(backend._name(keys[0]))[4] == pl.VERSION_KEYED
        assert SECRET not in repr(backend) and SECRET not in str(stats)
        assert SECRET not in backend.prefix and backend.prefix.startswith("mac:kv-")
        plain = redis_backend(redis_server.url, None)
        assert plain.prefix == "mac:kv:"  # names without a secret are as they were
    finally:
        client.close()


def test_redis_records_of_another_secret_are_misses_left_in_place(redis_server: Any) -> None:
    writer = redis_backend(redis_server.url, SECRET)
    plain = redis_backend(redis_server.url, None)

    async def scenario() -> tuple[Any, ...]:
        await writer.put([key(0)], [META], [data()])
        await plain.put([key(1)], [META], [data(2)])
        without = await plain.get_batch([key(0)])
        other = await writer.get_batch([key(1)])
        with_it = await writer.get_batch([key(0)])  # the plain reader left it in place
        plain_again = await plain.get_batch([key(1)])
        await writer.close()
        await plain.close()
        return without, with_it, other, plain_again

    without, with_it, other, plain_again = asyncio.run(scenario())
    assert without[0] == [None] and other[0] == [None]  # each other's records: misses
    assert with_it[0] == [META] and np.array_equal(with_it[1][0], data())
    assert plain_again[0] == [META] and np.array_equal(plain_again[1][0], data(2))
