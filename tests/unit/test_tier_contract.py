"""One contract that every Ray-free lower tier passes: the disk tier (`DiskStore`), the
`ray://` KV server's state (`KVServerState`) and the remote tier over a real Redis
(`RemoteStore` + `RedisBackend`). No Ray is started here.

The contract (what the manager relies on): a put returns a `PutAck` naming what it
accepted; a read of a held key is bit-exact with its meta; a miss is `None` plus an empty
array, never an exception; a chunk whose bytes disagree with its meta is skipped, never
stored, never raised; `contains`, `remove`, `keys` and `clear` agree with the puts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from raykv_testing import chunk_key

from raykv.config import RayKVConfig
from raykv.payload import PayloadMeta
from raykv.tiers.disk import DiskStore
from raykv.tiers.kv_server import KVServerState
from raykv.tiers.remote import RemoteStore

META = PayloadMeta("float16", (2, 2, 16, 8))


key = functools.partial(chunk_key, model="contract", dtype="float16")


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, META.nbytes, dtype=np.uint8)


class Tier:
    """A synchronous view of one tier: the same calls whatever the tier's style."""

    def __init__(self, store: Any, run: Any = None, settle: Any = None) -> None:
        self.store, self._run, self._settle = store, run, settle

    def call(self, name: str, *args: Any) -> Any:
        out = getattr(self.store, name)(*args)
        return self._run(out) if self._run is not None else out

    def put(self, keys: list, metas: list, arrays: list) -> Any:
        ack = self.call("put", keys, metas, arrays)
        if self._settle is not None:
            self._settle()
        return ack


@pytest.fixture(params=["disk", "kv_server", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "disk":
        store = DiskStore(tmp_path / "disk", 64 << 20, model_name="contract", kv_dtype="float16")
        try:
            yield Tier(store, settle=lambda: store.flush(10))
        finally:
            store.close()
    elif request.param == "kv_server":
        yield Tier(KVServerState(64 << 20, store=lambda a: a.copy(), load=list))
    else:
        server = request.getfixturevalue("redis_server")
        loop = asyncio.new_event_loop()
        store = RemoteStore(RayKVConfig(remote_url=server.url, lookup_timeout_ms=2000))
        try:
            yield Tier(store, run=loop.run_until_complete)
        finally:
            loop.run_until_complete(store.close())
            loop.close()


def test_a_put_chunk_reads_back_bit_exact_with_its_meta(tier: Tier) -> None:
    keys = [key(0), key(1)]
    ack = tier.put(keys, [META, META], [payload(0), payload(1)])
    assert sorted(ack.accepted) == sorted(keys) and not ack.skipped
    metas, arrays = tier.call("get_batch", keys)
    assert metas == [META, META]
    for i, array in enumerate(arrays):
        assert np.array_equal(np.asarray(array, dtype=np.uint8).reshape(-1), payload(i))


def test_a_miss_is_none_and_an_empty_array(tier: Tier) -> None:
    tier.put([key(0)], [META], [payload(0)])
    metas, arrays = tier.call("get_batch", [key(7), key(0)])
    assert metas[0] is None and len(arrays[0]) == 0
    assert metas[1] == META


def test_a_chunk_whose_bytes_disagree_with_its_meta_is_skipped_not_stored(tier: Tier) -> None:
    short = payload(1)[:-1]
    ack = tier.put([key(0), key(1)], [META, META], [payload(0), short])
    assert key(1) not in ack.accepted and key(0) in ack.accepted
    assert tier.call("contains", [key(0), key(1)]) == [True, False]
    metas, _ = tier.call("get_batch", [key(1)])
    assert metas == [None]


def test_contains_remove_keys_and_clear_agree_with_the_puts(tier: Tier) -> None:
    keys = [key(i) for i in range(3)]
    tier.put(keys, [META] * 3, [payload(i) for i in range(3)])
    assert tier.call("contains", keys) == [True, True, True]
    assert sorted(tier.call("keys")) == sorted(keys)
    assert tier.call("remove", [key(1), key(9)]) == 1
    assert tier.call("contains", keys) == [True, False, True]
    tier.call("clear")
    assert tier.call("contains", keys) == [False, False, False]
    assert tier.call("keys") == []


def test_a_second_put_of_a_held_key_keeps_it_readable(tier: Tier) -> None:
    tier.put([key(0)], [META], [payload(0)])
    tier.put([key(0)], [META], [payload(0)])
    metas, arrays = tier.call("get_batch", [key(0)])
    assert metas == [META]
    assert np.array_equal(np.asarray(arrays[0], dtype=np.uint8).reshape(-1), payload(0))
