"""The client's KV layout (`raykv.client.layout.KVLayout`) without Ray: what it accepts,
what it refuses (naming what was expected), and that a chunk copied into staging memory
and read back as a tensor is the caller's KV, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raykv.client.layout import KVLayout
from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError
from raykv.keys import KeyMaker

C = 16  # chunk tokens
CFG = RayKVConfig(chunk_size=C, kv_dtype="float16")


def kv(tokens: int, layers: int = 2, hidden: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, tokens, hidden, generator=g).half()


def test_the_first_kv_fixes_the_geometry_and_a_later_one_must_match() -> None:
    layout = KVLayout(CFG)
    layout.check_kv_tensor(kv(3 * C), 3 * C, "kv")
    layout.check_kv_tensor(kv(C, seed=1), C, "kv")
    with pytest.raises(InvalidInputError, match="3 layers x 8 hidden, expected 2 x 8"):
        layout.check_kv_tensor(kv(C, layers=3), C, "kv")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.zeros(2, 2, 8), "KV_2LTD tensor"),
        (torch.zeros(3, 2, C, 8).half(), "KV_2LTD tensor"),
        (torch.zeros(2, 2, C, 8), "dtype torch.float32, expected torch.float16"),
        (torch.zeros(2, 2, C - 1, 8).half(), f"covers {C - 1} tokens, expected at least {C}"),
        ("not a tensor", "got str"),
    ],
)
def test_a_bad_kv_tensor_is_refused_with_what_was_expected(bad: object, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        KVLayout(CFG).check_kv_tensor(bad, C, "kv")  # type: ignore[arg-type]


def test_chunks_must_match_the_prompts_chunks_in_number_and_length() -> None:
    spans = KeyMaker.from_config(CFG).keys(list(range(2 * C)))
    layout = KVLayout(CFG)
    with pytest.raises(InvalidInputError, match="got 1 KV chunks for 2 chunks"):
        layout.check_source([kv(C)], spans, 2 * C)
    with pytest.raises(InvalidInputError, match=f"KV chunk 1 has {C + 1} tokens, expected {C}"):
        layout.check_source([kv(C), kv(C + 1)], spans, 2 * C)
    layout.check_source([kv(C), kv(C, seed=2)], spans, 2 * C)


def test_fill_then_materialise_gives_back_the_callers_kv_and_write_puts_it_in_place() -> None:
    tokens = list(range(3 * C))
    spans = KeyMaker.from_config(CFG).keys(tokens)
    source = kv(3 * C)
    layout = KVLayout(CFG)
    layout.check_source(source, spans, 3 * C)
    metas = [layout.meta(s) for s in spans]
    region = np.zeros(sum(m.nbytes for m in metas), dtype=np.uint8)
    layout.fill(region, 0, source, spans, metas)
    bufs, off = [], 0
    for m in metas:
        bufs.append(region[off : off + m.nbytes])
        off += m.nbytes
    read = layout.materialise(list(zip(spans, bufs, metas, strict=True)), None)
    dest = torch.zeros_like(source)
    layout.write(dest, read)
    assert torch.equal(dest, source)
    # A chunk whose meta is not this model's ends the prefix there (a miss, never wrong KV).
    wrong = layout.meta(spans[0]).__class__("float16", (2, 3, C, 8))
    cut = layout.materialise([(spans[0], bufs[0], metas[0]), (spans[1], bufs[1], wrong)], None)
    assert [s for s, _ in cut] == [spans[0]]


def test_a_staging_view_made_under_inference_mode_serves_a_later_store_outside_it() -> None:
    """The ring's views are cached per place: one first made inside
    `torch.inference_mode()` (a model's forward) refused a later in-place copy outside it
    ("Inplace update to inference tensor outside InferenceMode") and the store raised."""
    spans = KeyMaker.from_config(CFG).keys(list(range(C)))
    layout = KVLayout(CFG)
    layout.check_source(kv(C), spans, C)
    metas = [layout.meta(s) for s in spans]
    region = np.zeros(metas[0].nbytes, dtype=np.uint8)
    with torch.inference_mode():
        layout.fill(region, 0, kv(C, seed=3), spans, metas)
    for seed, mode in ((4, False), (5, True)):
        source = kv(C, seed=seed)
        with torch.inference_mode(mode):
            layout.fill(region, 0, source, spans, metas)
        got = torch.from_numpy(region).view(torch.float16).reshape(source.shape)
        assert torch.equal(got, source)
