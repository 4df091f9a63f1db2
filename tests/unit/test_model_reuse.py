"""End to end on a real Llama model: reusing stored prefix KV changes nothing.

Cold path: prefill prefix + suffix from scratch. Warm path: prefill the prefix, cut
its KV into chunk payloads with the connector, push them through the wire codec
(`tensor_to_buffer` -> `encode` -> `decode` -> `buffer_to_tensor`), rebuild the
model's cache from them and prefill only the suffix. The suffix logits must agree
within fp32 tolerance (atol 1e-4; on CPU with SDPA they are in fact bit-identical)
and greedy generations must be identical.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from raykv.demo.model import (  # noqa: E402
    build_demo_model,
    chunks_to_cache,
    greedy_generate,
    kv_to_chunks,
    prefill,
    prefill_suffix,
)
from raykv.keys import KeyMaker  # noqa: E402
from raykv.payload import buffer_to_tensor, decode, encode, tensor_to_buffer  # noqa: E402

SUFFIX = 256
NEW_TOKENS = 16
ATOL = 1e-4


# For 4k tokens a half-size model keeps the test near 5 s on a 2-core CI box.
SMALL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4)


@pytest.fixture(scope="module")
def model():
    return build_demo_model(seed=0)


@pytest.fixture(scope="module")
def small_model():
    return build_demo_model(seed=0, **SMALL)


def prompt(prefix_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (prefix_len + SUFFIX,), generator=g)


def through_the_wire(chunks: list[torch.Tensor], keys) -> list[torch.Tensor]:
    """What a store and a later retrieve do to the bytes: encode, decode, rebuild."""
    out = []
    for chunk, span in zip(chunks, keys, strict=True):
        buf, meta = tensor_to_buffer(chunk)
        blob = encode(buf, meta, key=span.key.to_string())
        decoded = decode(memoryview(blob).toreadonly(), expected_key=span.key.to_string())
        out.append(buffer_to_tensor(decoded.data, decoded.meta))
    return out


@pytest.mark.parametrize(
    ("prefix_len", "which"), [(1024, "model"), (4096, "small_model")], ids=["1k-demo", "4k-small"]
)
def test_reused_prefix_kv_reproduces_full_prefill(request, prefix_len: int, which: str) -> None:
    model = request.getfixturevalue(which)
    layers = model.config.num_hidden_layers
    tokens = prompt(prefix_len, model.config.vocab_size)
    prefix, suffix = tokens[:prefix_len], tokens[prefix_len:]

    cold_logits, _ = prefill(model, tokens, logits_to_keep=SUFFIX)
    cold_gen = greedy_generate(model, tokens, NEW_TOKENS)

    _, prefix_cache = prefill(model, prefix, logits_to_keep=1)
    keys = KeyMaker(model_name="demo", kv_dtype="float32", chunk_size=256).keys(prefix)
    assert [k.end for k in keys][-1] == prefix_len
    chunks = through_the_wire(kv_to_chunks(prefix_cache, keys), keys)
    assert all(c.shape == (2, layers, 256, 2 * 64) for c in chunks)

    cache = chunks_to_cache(chunks, model.config)
    for got, want in zip(cache.layers, prefix_cache.layers, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    warm_logits, cache = prefill_suffix(model, cache, suffix, prefix_len)
    assert cache.get_seq_length() == prefix_len + SUFFIX
    assert warm_logits.shape == cold_logits.shape == (SUFFIX, model.config.vocab_size)
    torch.testing.assert_close(warm_logits, cold_logits, atol=ATOL, rtol=0)

    warm_gen = greedy_generate(
        model, tokens, NEW_TOKENS, cache=chunks_to_cache(chunks, model.config)
    )
    assert warm_gen == cold_gen
    assert len(warm_gen) == NEW_TOKENS


def test_model_is_deterministic_per_seed() -> None:
    kw = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    a, b, c = build_demo_model(3, **kw), build_demo_model(3, **kw), build_demo_model(4, **kw)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_prefill_suffix_rejects_a_wrong_start_position() -> None:
    from raykv.errors import InvalidInputError

    m = build_demo_model(
        0,
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    _, cache = prefill(m, list(range(10)))
    with pytest.raises(InvalidInputError, match="start_pos=8 but the cache holds 10 tokens"):
        prefill_suffix(m, cache, [1, 2], 8)


def test_chunks_to_cache_rejects_chunks_of_another_model(model) -> None:
    from raykv.errors import InvalidInputError

    wrong = torch.zeros(2, 4, 16, 128)
    with pytest.raises(
        InvalidInputError, match="chunks have 4 layers x 128 hidden, the model needs 8"
    ):
        chunks_to_cache([wrong], model.config)
