"""Chunking and chained prefix hashing: determinism, prefix property, masks, key strings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, KeyMaker, as_token_array, chain_hashes, make_key

C = 4
tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40)


def hashes(tokens, **kw):
    return [span.key.chunk_hash for span in KeyMaker(chunk_size=C, **kw).keys(tokens)]


def test_chunk_boundaries_drop_trailing_partial_chunk_by_default():
    spans = KeyMaker(chunk_size=C).keys(list(range(10)))
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8)]


def test_save_unfull_chunk_keeps_the_trailing_partial_chunk():
    spans = KeyMaker(chunk_size=C, save_unfull_chunk=True).keys(list(range(10)))
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 10)]
    assert (
        spans[2].key != KeyMaker(chunk_size=C, save_unfull_chunk=True).keys(list(range(11)))[2].key
    )


def test_list_numpy_and_torch_inputs_give_identical_keys():
    toks = list(range(100, 133))
    a = hashes(toks)
    assert a == hashes(np.array(toks, dtype=np.int64)) == hashes(np.array(toks, dtype=np.uint32))
    assert a == hashes(torch.tensor(toks)) == hashes(torch.tensor(toks, dtype=torch.int32))


def test_empty_prompt_gives_no_keys():
    assert KeyMaker(chunk_size=C).keys([]) == []
    assert KeyMaker(chunk_size=C).keys(np.zeros(0, dtype=np.int64)) == []


def test_seed_and_model_identity_change_keys():
    toks = list(range(8))
    assert hashes(toks) != hashes(toks, hash_seed="other")
    a = KeyMaker(chunk_size=C, model_name="m1").keys(toks)[0].key
    b = KeyMaker(chunk_size=C, model_name="m2").keys(toks)[0].key
    assert a.chunk_hash == b.chunk_hash and a != b


def test_known_answer_pins_the_hash_function():
    # Changing the hash construction silently would orphan every stored cache.
    got = chain_hashes([1, 2, 3, 4], 4)[0][2].hex()
    assert got == chain_hashes(np.array([1, 2, 3, 4], dtype="<i4"), 4)[0][2].hex()
    assert got == "e466bd9b585f41fbd4ad6210c33a8dc0"


@settings(max_examples=200, deadline=None)
@given(tokens_st, tokens_st)
def test_same_prefix_gives_same_keys(prefix, suffix):
    a = hashes(prefix)
    b = hashes(prefix + suffix)
    assert b[: len(a)] == a


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=C, max_size=40), st.data())
def test_changing_one_token_changes_its_chunk_and_every_later_one_never_earlier(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = tokens[i] + 1
    a, b = hashes(tokens), hashes(changed)
    chunk = i // C
    assert a[:chunk] == b[:chunk]
    assert all(x != y for x, y in zip(a[chunk:], b[chunk:], strict=True))


@pytest.mark.parametrize(
    "bad",
    [
        [[1, 2], [3, 4]],
        [1.5, 2.0],
        np.array([1.0, 2.0]),
        [-1, 2, 3],
        [2**31],
        "abcd",
        b"abcd",
        None,
        12,
        [True, False],
        torch.zeros(2, 2, dtype=torch.int64),
    ],
)
def test_bad_tokens_raise_invalid_input(bad):
    with pytest.raises(InvalidInputError):
        KeyMaker(chunk_size=C).keys(bad)


def _ids(n: int, last: int, dtype: str, step: int = 1) -> np.ndarray:
    """`n` ids of `dtype` (every `step`-th of a longer array when step > 1), the last one
    `last`: a check that stops early or skips the strided-over ids misses it."""
    arr = np.arange(n * step, dtype=dtype) % 100
    arr[(n - 1) * step] = last
    return arr[::step]


# Short prompts are checked by Python over the raw bytes, long or strided ones by numpy.
LENGTHS = [pytest.param(3, 1, id="short"), pytest.param(5000, 1, id="long")]
LENGTHS += [pytest.param(7, 3, id="strided")]


@pytest.mark.parametrize(("n", "step"), LENGTHS)
@pytest.mark.parametrize("dtype", ["i1", "<i2", ">i2", "<i4", ">i4", "<i8", ">i8"])
def test_token_range_check_holds_for_every_signed_width_and_byte_order(dtype, n, step):
    # The check reads signed ids as unsigned in one pass: a negative id must still fail.
    with pytest.raises(InvalidInputError, match="must lie in"):
        as_token_array(_ids(n, -1, dtype, step))
    ok = _ids(n, 0, dtype, step)
    assert as_token_array(ok).tolist() == ok.tolist()


@pytest.mark.parametrize(("n", "step"), LENGTHS)
@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<u8", ">u8", ">u4", "<u4"])
def test_token_ids_past_int32_fail_in_every_wide_dtype(dtype, n, step):
    with pytest.raises(InvalidInputError, match="must lie in"):
        as_token_array(_ids(n, 2**31, dtype, step))
    top = as_token_array(_ids(n, 2**31 - 1, dtype, step))
    assert top.dtype == np.dtype("<i4") and top[-1] == 2**31 - 1


@pytest.mark.parametrize("dtype", ["u1", "<u2", ">u2"])
def test_narrow_unsigned_token_ids_always_fit(dtype):
    top = np.iinfo(dtype).max
    for n, step in [(3, 1), (5000, 1), (7, 3)]:
        assert as_token_array(_ids(n, top, dtype, step))[-1] == top


@pytest.mark.parametrize("save_unfull", [False, True])
@pytest.mark.parametrize("size", [1, 3, 16])
def test_bounds_are_the_chunks_keys_makes_for_every_length_and_skip(size, save_unfull):
    # A staged store copies by `bounds` and hashes later: the two must never disagree.
    maker = KeyMaker(chunk_size=size, save_unfull_chunk=save_unfull)
    for n in range(0, 4 * size + 2):
        every = [(s.start, s.end) for s in maker.keys(list(range(n)))]
        for skip in range(0, n + 1, size):
            want = [(a, b) for a, b in every if a >= skip]
            got = maker.bounds(n, skip)
            assert [(c.start, c.end) for c in got] == want and all(c.key is None for c in got)


def test_mask_skips_leading_chunks_but_keeps_the_hash_chain():
    toks = list(range(12))
    full = KeyMaker(chunk_size=C).keys(toks)
    mask = [False] * 4 + [True] * 8
    masked = KeyMaker(chunk_size=C).keys(toks, mask=mask)
    assert masked == full[1:]
    assert KeyMaker(chunk_size=C).keys(toks, mask=np.ones(12, dtype=bool)) == full
    assert KeyMaker(chunk_size=C).keys(toks, mask=torch.zeros(12, dtype=torch.bool)) == []


@pytest.mark.parametrize(
    "mask, match",
    [
        ([False] * 3 + [True] * 9, "multiple of chunk_size"),
        ([True] * 4 + [False] * 8, "all False then all True"),
        ([False] * 4 + [True] * 7, "mask length 11"),
        ([0] * 4 + [1] * 8, "bool"),
    ],
)
def test_bad_masks_are_rejected_with_a_reason(mask, match):
    with pytest.raises(InvalidInputError, match=match):
        KeyMaker(chunk_size=C).keys(list(range(12)), mask=mask)


def test_cache_key_string_round_trips_and_is_file_name_safe():
    key = make_key("meta-llama/Llama 3@8B", 2, 1, "ab" * 16, "bfloat16")
    text = key.to_string()
    assert "/" not in text and " " not in text and text.count("@") == 4
    assert CacheKey.from_string(text) == key
    assert str(key) == text


def test_cache_keys_are_hashable_and_orderable():
    a = make_key("m", 1, 0, "0" * 32, "float16")
    b = make_key("m", 1, 0, "1" + "0" * 31, "float16")
    assert sorted([b, a]) == [a, b]
    assert len({a, b, make_key("m", 1, 0, "0" * 32, "float16")}) == 2


def test_cache_key_built_from_its_identity_is_the_same_key_and_survives_pickle():
    import pickle

    from raykv.keys import CacheKey
    from raykv.wire import PackedKeys

    k = make_key("m/x", 2, 1, "ab" * 16, "bfloat16")
    assert CacheKey.of(k.identity, k.chunk_hash) == k and k.identity == ("m/x", 2, 1, "bfloat16")
    for same in (CacheKey.of(k.identity, k.chunk_hash), pickle.loads(pickle.dumps(k))):
        assert type(same) is CacheKey and hash(same) == hash(k) and str(same) == str(k)
    assert PackedKeys.of([k]).keys() == [k] and type(PackedKeys.of([k]).keys()[0]) is CacheKey
    assert str(k) == k.to_string() == "m%2Fx@2@1@" + "ab" * 16 + "@bfloat16"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a@b",
        "m@1@0@zz@float16",
        "m@x@0@" + "0" * 32 + "@f16",
        "m@1@0@" + "0" * 32 + "@f/16",
        "%41@1@0@" + "0" * 32 + "@float16",
        "m@1@0@" + "0" * 32 + "@float16@extra",
        "m@1@3@" + "0" * 32 + "@float16",
        "m@\u00b2@0@" + "0" * 32 + "@float16",
    ],
)
def test_malformed_key_strings_are_rejected(text):
    with pytest.raises(InvalidInputError):
        CacheKey.from_string(text)


def test_precomputed_hashes_map_to_keys_with_offsets():
    km = KeyMaker(chunk_size=C)
    spans = km.keys_from_hashes([123, -5, b"\x01\x02", "abc"], [4, 8, 12, 14])
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 12), (12, 14)]
    assert len({s.key for s in spans}) == 4
    assert spans == km.keys_from_hashes([123, -5, b"\x01\x02", "abc"], [4, 8, 12, 14])
    with pytest.raises(InvalidInputError, match="one offset per hash"):
        km.keys_from_hashes([1, 2], [4])
    with pytest.raises(InvalidInputError, match="strictly increasing"):
        km.keys_from_hashes([1, 2], [4, 4])
    with pytest.raises(InvalidInputError, match="int, bytes or str"):
        km.keys_from_hashes([1.5], [4])


def test_keys_agree_across_processes_with_different_hash_seeds():
    script = textwrap.dedent(
        """
        import numpy as np
        from raykv.keys import KeyMaker
        toks = np.random.default_rng(7).integers(0, 50000, 3000)
        print(",".join(str(s.key) for s in KeyMaker(chunk_size=256).keys(toks)))
        """
    )
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outs.append(proc.stdout.strip())
    assert outs[0] == outs[1] and outs[0].count(",") == 10
