"""`KVCache.store` without Ray: a failing `ray.put` of the batch costs the chunks (0
stored, logged), never an exception; bad input still raises `InvalidInputError`."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import ray
import torch
from ray.exceptions import ObjectStoreFullError

from raykv.client import kvcache as engine
from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError
from raykv.payload import PayloadMeta

CHUNK, LAYERS, HIDDEN = 4, 2, 8


class NoManager:
    """Any call to the manager fails the test: a failed put must not reach it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the manager was called ({name}) after ray.put failed")


class RayUp:
    """The `ray` module as the client sees it, saying Ray is up. Patching
    `ray.is_initialized` itself would also fool Ray's own log filter (installed once any
    test started Ray), which then asks a worker that is gone for its id."""

    def __getattr__(self, name: str) -> Any:
        return getattr(ray, name)

    @staticmethod
    def is_initialized() -> bool:
        return True


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> engine.KVCache:
    monkeypatch.setattr(engine, "ray", RayUp())
    cfg = RayKVConfig(chunk_size=CHUNK, kv_dtype="float32")
    return engine.KVCache(cfg, NoManager())


def kv_tensor(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, LAYERS, n, HIDDEN).to(dtype)


@pytest.mark.parametrize(
    "fault",
    [
        ObjectStoreFullError("object store full"),
        OSError(28, "No space left on device (spilling)"),
        MemoryError("cannot allocate"),
        RuntimeError("plasma store connection reset"),
        ConnectionError("raylet went away"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_failing_ray_put_stores_nothing_and_never_raises(
    kv: engine.KVCache,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault: BaseException,
) -> None:
    def failing_put(*args: Any, **kwargs: Any) -> Any:
        raise fault

    monkeypatch.setattr(engine.ray, "put", failing_put)
    tokens = list(range(3 * CHUNK))
    with caplog.at_level(logging.WARNING, logger="raykv.client.kvcache"):
        assert kv.store(tokens, kv_tensor(len(tokens))) == 0
    assert "not cached" in caplog.text and type(fault).__name__ in caplog.text
    meta = PayloadMeta("float32", (2, LAYERS, CHUNK, HIDDEN))
    buf = np.zeros(meta.nbytes, dtype=np.uint8)
    assert kv.put_chunks(kv.spans(tokens)[:1], [buf], [meta]) == 0


def test_bad_input_still_raises_when_ray_put_would_fail(
    kv: engine.KVCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_put(*args: Any, **kwargs: Any) -> Any:
        raise OSError("object store gone")

    monkeypatch.setattr(engine.ray, "put", failing_put)
    tokens = list(range(2 * CHUNK))
    with pytest.raises(InvalidInputError, match="dtype"):
        kv.store(tokens, kv_tensor(len(tokens), torch.float16))
    with pytest.raises(InvalidInputError, match="KV_2LTD"):
        kv.store(tokens, torch.zeros(3, 3))
    with pytest.raises(InvalidInputError, match="3 KV chunks for 2"):
        kv.store(tokens, [kv_tensor(CHUNK)] * 3)  # three chunks for two
    meta = PayloadMeta("float32", (2, LAYERS, CHUNK, HIDDEN))
    with pytest.raises(InvalidInputError, match="flat uint8"):
        kv.put_chunks(kv.spans(tokens)[:1], [np.zeros(3, dtype=np.uint8)], [meta])
