"""Payload buffers and the binary codec: round trips, zero-copy, and rejection of bad bytes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv import payload
from raykv.config import KV_DTYPES
from raykv.errors import PayloadError
from raykv.payload import (
    PayloadMeta,
    buffer_to_tensor,
    buffers_to_tensors,
    decode,
    encode,
    read_header,
    tensor_to_buffer,
)

DTYPES = sorted(payload.DTYPE_CODES)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes make NaNs, which torch.equal treats as unequal)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _tensor(dtype: str, shape=(2, 3, 5, 8), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (int(np.prod(shape)) * getattr(torch, dtype).itemsize,),
        dtype=torch.uint8,
        generator=g,
    )
    return raw.view(getattr(torch, dtype)).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_bit_exactly(dtype):
    t = _tensor(dtype)
    arr, meta = tensor_to_buffer(t)
    out = buffer_to_tensor(decode(encode(arr, meta, key="k")).data, meta)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert _same_bits(out, t)


def test_bfloat16_and_float8_are_supported():
    assert "bfloat16" in payload.DTYPE_CODES
    if hasattr(torch, "float8_e4m3fn"):
        assert "float8_e4m3fn" in payload.DTYPE_CODES


def test_tensor_to_buffer_is_zero_copy_for_contiguous_cpu_tensors():
    t = _tensor("bfloat16")
    arr, _ = tensor_to_buffer(t)
    assert arr.ctypes.data == t.data_ptr()


def test_buffer_to_tensor_is_zero_copy_unless_asked():
    t = _tensor("float16")
    arr, meta = tensor_to_buffer(t)
    assert buffer_to_tensor(arr, meta).data_ptr() == arr.ctypes.data
    assert buffer_to_tensor(arr, meta, copy=True).data_ptr() != arr.ctypes.data


def test_buffers_to_tensors_are_zero_copy_views_like_buffer_to_tensor():
    # Every KV dtype (some have a numpy twin, some are reinterpreted) and one without.
    tensors = [_tensor(name) for name in (*KV_DTYPES, "int16")]
    pairs = [tensor_to_buffer(t) for t in tensors]
    arrs, metas = [a for a, _ in pairs], [m for _, m in pairs]
    arrs[0] = arrs[0].view(np.int16)  # not uint8: still read as its bytes
    arrs[1].setflags(write=False)  # as ray.get hands them out
    out = buffers_to_tensors(arrs, metas)
    for got, arr, t, meta in zip(out, arrs, tensors, metas, strict=True):
        assert got.dtype == t.dtype and got.shape == t.shape, meta
        assert got.data_ptr() == arr.ctypes.data and _same_bits(got, t)
        assert _same_bits(got, buffer_to_tensor(arr, meta))
    assert buffers_to_tensors([], []) == []


def test_buffer_to_tensor_accepts_read_only_buffers():
    t = _tensor("float32")
    arr, meta = tensor_to_buffer(t)
    ro = np.frombuffer(arr.tobytes(), dtype=np.uint8)
    assert not ro.flags.writeable
    assert _same_bits(buffer_to_tensor(ro, meta), t)


def test_non_contiguous_tensor_is_copied_correctly():
    t = _tensor("float32", (2, 3, 8, 5)).transpose(2, 3)
    arr, meta = tensor_to_buffer(t)
    assert _same_bits(buffer_to_tensor(arr, meta), t)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.integers(1, 3),
    st.integers(1, 7),
    st.integers(1, 9),
    st.text(max_size=30),
)
def test_codec_round_trip_property(dtype, layers, tokens, hidden, key):
    t = _tensor(dtype, (2, layers, tokens, hidden))
    arr, meta = tensor_to_buffer(t)
    blob = encode(arr, meta, key=key)
    out = decode(blob, expected_key=key)
    assert out.meta == meta and out.key == key
    assert out.data.tobytes() == arr.tobytes()


def _blob():
    arr, meta = tensor_to_buffer(_tensor("bfloat16"))
    return bytes(encode(arr, meta, key="m@1@0@" + "0" * 32 + "@bfloat16"))


def test_truncated_data_is_rejected():
    blob = _blob()
    for cut in (0, 3, 20, 40, len(blob) - 1):
        with pytest.raises(PayloadError, match="truncated"):
            decode(blob[:cut])


def test_trailing_garbage_is_rejected():
    with pytest.raises(PayloadError, match="trailing"):
        decode(_blob() + b"x")


def test_wrong_magic_and_version_are_rejected():
    blob = bytearray(_blob())
    with pytest.raises(PayloadError, match="magic"):
        decode(b"XXXX" + bytes(blob[4:]))
    blob[4] = 99
    with pytest.raises(PayloadError, match="version"):
        decode(bytes(blob))


def test_checksum_mismatch_in_body_is_rejected():
    blob = bytearray(_blob())
    blob[-1] ^= 0xFF
    with pytest.raises(PayloadError, match="checksum"):
        decode(bytes(blob))


def test_any_single_byte_flip_is_detected():
    blob = _blob()
    header_len = read_header(blob).header_len
    rng = np.random.default_rng(0)
    positions = list(range(header_len)) + list(rng.integers(header_len, len(blob), 50))
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 0x5A
        with pytest.raises(PayloadError):
            decode(bytes(bad))


def test_wrong_key_is_rejected():
    with pytest.raises(PayloadError, match="belongs to key"):
        decode(_blob(), expected_key="another")


def test_absurd_declared_size_is_rejected_before_reading_the_body():
    import struct

    import xxhash

    fixed = payload._FIXED.pack(payload.MAGIC, payload.VERSION, 0, 0, 0, 4, 0, 2**62, 0)
    head = fixed + struct.pack("<4Q", 2, 2**20, 2**20, 2**20)
    head += struct.pack("<I", xxhash.xxh32_intdigest(head))
    with pytest.raises(PayloadError, match="exceeds the limit"):
        read_header(head)


def test_shape_that_disagrees_with_size_is_rejected():
    with pytest.raises(PayloadError, match="data has"):
        payload.encode_parts(np.zeros(10, np.uint8), PayloadMeta("float32", (2, 1, 1, 2)))


def test_random_bytes_never_decode_and_never_unpickle():
    rng = np.random.default_rng(1)
    for n in (0, 1, 10, 40, 100, 1000):
        for _ in range(20):
            with pytest.raises(PayloadError):
                decode(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    with pytest.raises(PayloadError):
        decode(pickle.dumps({"evil": 1}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dtype": "complex64", "shape": (2, 1, 1, 1)}, "unsupported dtype"),
        ({"dtype": "float16", "shape": (3, 1, 1, 1)}, "KV_2LTD"),
        ({"dtype": "float16", "shape": (2, 1, 1)}, "KV_2LTD"),
        ({"dtype": "float16", "shape": (2, -1, 1, 1)}, r"ints in \[1, "),
        ({"dtype": "float16", "shape": (2, 0, 1, 1)}, r"ints in \[1, "),
        ({"dtype": "float16", "shape": (2, 1, 2**33, 1)}, r"ints in \[1, "),
        ({"dtype": "float16", "shape": (2, 1, 1, 1), "layout": "XYZ"}, "unknown layout"),
    ],
)
def test_bad_meta_is_rejected(kwargs, match):
    with pytest.raises(PayloadError, match=match):
        PayloadMeta(**kwargs)


def test_unknown_serde_is_rejected_with_known_names():
    arr, meta = tensor_to_buffer(_tensor("float16"))
    with pytest.raises(PayloadError, match="known"):
        encode(arr, meta, serde="zstd9")


@pytest.mark.parametrize(
    "shape",
    [(2, 0, 2**63, 2**63), (2, 1, 0, 4), (2, 1, 2**40, 1)],
    ids=["zero-and-huge", "zero", "huge"],
)
def test_a_record_with_valid_checksums_and_absurd_dimensions_is_a_payload_error(shape):
    """A hostile writer can make a header's checksums agree with any shape: a zero
    dimension makes a 2**63 one "0 bytes". The dimensions themselves are checked."""
    import struct

    import xxhash

    from raykv import payload as pl

    meta = PayloadMeta("float16", (2, 1, 1, 4))
    key = "m@1@0@" + "0" * 32 + "@float16"
    data = np.zeros(meta.nbytes, np.uint8)
    buf = bytearray(encode(data, meta, key=key).tobytes())
    body_at = pl._FIXED.size + 8 * 4 + len(key) + 4
    buf = buf[:body_at]  # the forged shape declares 0 bytes (or too many): no body
    fixed = list(pl._FIXED.unpack_from(buf))
    fixed[7] = 0  # nbytes
    fixed[8] = xxhash.xxh3_64_intdigest(b"")  # the empty body's checksum
    pl._FIXED.pack_into(buf, 0, *fixed)
    struct.pack_into("<4Q", buf, pl._FIXED.size, *shape)
    end = body_at - 4
    struct.pack_into("<I", buf, end, xxhash.xxh32_intdigest(bytes(buf[:end])))
    with pytest.raises(PayloadError, match=r"ints in \[1, "):
        decode(bytes(buf), expected_key=key)
