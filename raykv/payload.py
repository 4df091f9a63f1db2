"""A KV chunk's bytes plus metadata, and the binary codec used on disk and on the wire.

In memory a payload is a flat `uint8` numpy array (so Ray's object store hands it
out zero-copy, whatever the torch dtype, bfloat16 and float8 included) plus a
`PayloadMeta` (dtype name, shape, layout). On disk and on remote servers it is a
fixed header followed by the raw bytes:

    magic "RKVC" | version u16 | serde u8 | dtype u8 | layout u8 | ndim u8 | key_len u16
    | nbytes u64 | data checksum u64 (XXH3-64) | shape u64 * ndim | key utf-8 | header checksum u32

Version 1 records are checked by those two checksums, which catch corruption but not a
hostile writer. With a shared secret (`payload_secret` in the config) records are
version 2: the two checksum slots hold a 96-bit tag (the first 12 bytes of HMAC-SHA256
keyed by the secret, as HMAC-SHA1-96 in IPsec) over the header (with the tag slots
zeroed) and the body, so a writer without the secret cannot make a record that a reader
with it accepts. Both versions have the same length, so tier budgets do not change. A
reader with a secret accepts only version 2 records whose tag verifies; a reader without
one accepts only version 1.

Decoding never unpickles: malformed, truncated, hostile or corrupt bytes, or a record
whose tag does not verify, raise `PayloadError`, which the tiers turn into a miss.
"""

from __future__ import annotations

import hmac
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash

from raykv.errors import PayloadError

# A zero-length byte array: what a missing or empty payload reads as (one for the package).
EMPTY = np.empty(0, dtype=np.uint8)

if TYPE_CHECKING:  # torch loads only where tensors are converted: tier actors never need it
    import torch

MAGIC = b"RKVC"
VERSION = 1  # checksummed (XXH3-64 body, XXH32 header)
VERSION_KEYED = 2  # tagged: HMAC-SHA256-96 over header and body, keyed by payload_secret
MAC_BYTES = 12  # 8 in the data checksum slot, 4 in the header checksum slot
LAYOUT_KV_2LTD = "KV_2LTD"  # [2 (K,V), num_layers, num_tokens, num_kv_heads * head_dim]
# Whole engine pages, opaque: [num_layers, num_blocks, *one block of one layer]. The block
# interior is whatever the engine's attention backend keeps (e.g. vLLM's CPU backend packs
# K per instruction set), so such a payload is only ever copied back block for block into
# the same layout; the key's layout fingerprint keeps it away from any other.
LAYOUT_PAGES = "PAGES"
MAX_NDIM = 8
MAX_KEY_BYTES = 1024
MAX_PAYLOAD_BYTES = 1 << 36  # 64 GiB: anything larger is a corrupt or hostile header
MAX_DIM = 1 << 32  # no dimension of a chunk's KV comes near this

_FIXED = struct.Struct("<4sHBBBBHQQ")
_HEADER_SUM = struct.Struct("<I")
_SUM_AT = _FIXED.size - 8  # offset of the data checksum slot in the fixed part
_NO_SUM = bytes(8)

# Stable on-disk codes: append only, never renumber.
_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "bool",
)
DTYPE_CODES = {name: code for code, name in enumerate(_DTYPE_NAMES)}
# Bytes per element, as torch has them (a table: the tiers never import torch).
_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "bool": 1,
}
_DTYPE_BY_CODE = {code: name for name, code in DTYPE_CODES.items()}
_LAYOUT_CODES = {LAYOUT_KV_2LTD: 0, "RAW": 1, LAYOUT_PAGES: 2}
_LAYOUT_BY_CODE = {code: name for name, code in _LAYOUT_CODES.items()}
# Serdes by name; the code is recorded in every header. "naive" is LMCache's name for raw.
SERDE_CODES = {"raw": 0, "naive": 0}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name; `PayloadError` if unknown."""
    if dtype not in DTYPE_CODES:
        raise PayloadError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPE_CODES)}")
    return _ITEMSIZE[dtype]


@dataclass(frozen=True, slots=True)
class PayloadMeta:
    """What a flat byte buffer holds: torch dtype name, shape and layout."""

    dtype: str
    shape: tuple[int, ...]
    layout: str = LAYOUT_KV_2LTD

    def __post_init__(self) -> None:
        dtype_itemsize(self.dtype)
        if self.layout not in _LAYOUT_CODES:
            raise PayloadError(f"unknown layout {self.layout!r}; known: {sorted(_LAYOUT_CODES)}")
        shape = tuple(self.shape)
        # Every dimension of both layouts is a count of something (layers, tokens, blocks,
        # heads x dims): at least 1, and none so large that a header could name a tensor
        # no tier could hold (a zero elsewhere would make such a shape 0 bytes).
        if len(shape) > MAX_NDIM or any(
            not isinstance(d, (int, np.integer)) or isinstance(d, bool) or not 1 <= d <= MAX_DIM
            for d in shape
        ):
            raise PayloadError(
                f"shape must be up to {MAX_NDIM} ints in [1, {MAX_DIM}], got {self.shape!r}"
            )
        if self.layout == LAYOUT_KV_2LTD and (len(shape) != 4 or shape[0] != 2):
            raise PayloadError(
                f"layout KV_2LTD needs shape [2, num_layers, num_tokens, hidden], got {list(shape)}"
            )
        if self.layout == LAYOUT_PAGES and len(shape) < 3:
            raise PayloadError(
                f"layout PAGES needs shape [num_layers, num_blocks, *block], got {list(shape)}"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @property
    def nbytes(self) -> int:
        n = dtype_itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n

    @property
    def num_tokens(self) -> int:
        """Tokens in a KV_2LTD chunk."""
        return self.shape[2] if self.layout == LAYOUT_KV_2LTD else 0


def tensor_to_buffer(
    tensor: torch.Tensor, layout: str = LAYOUT_KV_2LTD
) -> tuple[np.ndarray, PayloadMeta]:
    """A torch tensor as a flat uint8 numpy array plus its metadata.

    Zero-copy for a contiguous CPU tensor (the array shares its memory); other
    tensors are copied to contiguous host memory first.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise PayloadError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    meta = PayloadMeta(dtype, tuple(tensor.shape), layout)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return flat.numpy(), meta


def buffer_to_tensor(buf: Any, meta: PayloadMeta, *, copy: bool = False) -> torch.Tensor:
    """Rebuild a tensor from a flat byte buffer without copying unless `copy` is true.

    A zero-copy tensor over a read-only buffer (e.g. from Ray's object store) must
    not be written to; pass `copy=True` for a writable tensor.
    """
    import torch

    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if arr.dtype != np.uint8 or arr.ndim != 1:
        arr = arr.reshape(-1).view(np.uint8)
    if arr.nbytes != meta.nbytes:
        raise PayloadError(
            f"buffer holds {arr.nbytes} bytes but "
            f"{meta.dtype}{list(meta.shape)} needs {meta.nbytes}"
        )
    if copy:
        arr = arr.copy()
    with warnings.catch_warnings():
        # torch warns on read-only numpy memory; the docstring states the contract instead.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(getattr(torch, meta.dtype)).reshape(meta.shape)


# torch warns once per process (TORCH_WARN_ONCE) when it wraps read-only numpy memory:
# after raykv's first such call, entering a warnings scope per call (~1 us warm, tens of us
# on caches a large copy just flushed) buys nothing.
_readonly_warning_spent = False


def buffers_to_tensors(buffers: Sequence[np.ndarray], metas: Sequence[PayloadMeta]) -> list:
    """`buffer_to_tensor` of many flat uint8 arrays whose sizes match their metas (checked
    by the caller), zero-copy and read-only; torch's one warning about read-only memory
    is silenced on the first call that could raise it."""
    import torch

    global _readonly_warning_spent
    flat = [
        b if b.dtype == np.uint8 and b.ndim == 1 else b.reshape(-1).view(np.uint8) for b in buffers
    ]
    if not _readonly_warning_spent and any(not b.flags.writeable for b in flat):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.from_numpy(next(b for b in flat if not b.flags.writeable))
        _readonly_warning_spent = True
    return [
        torch.from_numpy(buf).view(getattr(torch, meta.dtype)).view(meta.shape)
        for buf, meta in zip(flat, metas, strict=True)
    ]


class Header(NamedTuple):
    """A parsed codec header."""

    meta: PayloadMeta
    key: str
    serde: int
    nbytes: int
    checksum: int  # XXH3-64 of the body; in a keyed record, the tag's first 8 bytes
    header_len: int
    keyed: bool = False  # a version 2 record: its tag is checked by `decode`


Secret = str | bytes


def _tag(secret: Secret, head: Any, body: Any) -> bytes:
    """The 96-bit tag of a keyed record: HMAC-SHA256 over `head` (its tag slots excluded or
    zeroed by the caller) then `body`, truncated."""
    key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if not key:
        raise PayloadError("an empty payload secret is no secret: pass None for plain records")
    mac = hmac.new(key, head, "sha256")  # by name: OpenSSL's HMAC, which drops the GIL
    mac.update(body)
    return mac.digest()[:MAC_BYTES]


def secret_tag(secret: Secret) -> str:
    """A short public name of `secret` (an HMAC of a constant, not the secret): a shared
    store keeps each secret's records under names of their own."""
    return _tag(secret, b"raykv record names", b"").hex()[:12]


def buffer_problem(array: Any, meta: Any) -> str | None:
    """Why `array` cannot be stored as the payload `meta` describes, or None if it can.

    The tiers call this on every put, so a wrong-sized, mistyped or object-holding
    buffer is skipped (and counted) instead of stored or raised.
    """
    if not isinstance(meta, PayloadMeta):
        return f"meta is a {type(meta).__name__}, not a PayloadMeta"
    try:  # an unpickled meta skipped __post_init__: validate it again
        declared = PayloadMeta(meta.dtype, meta.shape, meta.layout).nbytes
    except (PayloadError, TypeError, ValueError) as exc:
        return f"invalid meta: {exc}"
    if not isinstance(array, np.ndarray):
        return f"data is a {type(array).__name__}, not a numpy array"
    if array.dtype.hasobject:
        return "data holds Python objects, not bytes"
    if array.nbytes != declared:
        return f"data has {array.nbytes} bytes but meta declares {declared}"
    return None


def encode_parts(
    data: np.ndarray,
    meta: PayloadMeta,
    key: str = "",
    serde: str = "raw",
    *,
    secret: Secret | None = None,
) -> tuple[bytes, memoryview]:
    """Header bytes and a zero-copy view of the body, for writers that send them separately.

    With `secret`, a keyed (version 2) record: see the module docstring.
    """
    if serde not in SERDE_CODES:
        raise PayloadError(f"unknown serde {serde!r}; known: {sorted(SERDE_CODES)}")
    try:
        arr = np.ascontiguousarray(data)
        body = None if arr.dtype.hasobject else memoryview(arr).cast("B")
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"data is not a byte buffer: {exc}") from None
    if body is None:
        raise PayloadError("data holds Python objects, not bytes")
    if body.nbytes != meta.nbytes:
        raise PayloadError(f"data has {body.nbytes} bytes but meta declares {meta.nbytes}")
    key_bytes = key.encode("utf-8")
    if len(key_bytes) > MAX_KEY_BYTES:
        raise PayloadError(f"key is {len(key_bytes)} bytes; at most {MAX_KEY_BYTES} allowed")
    head = _FIXED.pack(
        MAGIC,
        VERSION if secret is None else VERSION_KEYED,
        SERDE_CODES[serde],
        DTYPE_CODES[meta.dtype],
        _LAYOUT_CODES[meta.layout],
        len(meta.shape),
        len(key_bytes),
        body.nbytes,
        0 if secret is not None else xxhash.xxh3_64_intdigest(body),
    )
    head += struct.pack(f"<{len(meta.shape)}Q", *meta.shape) + key_bytes
    if secret is None:
        return head + _HEADER_SUM.pack(xxhash.xxh32_intdigest(head)), body
    tag = _tag(secret, head, body)
    return head[:_SUM_AT] + tag[:8] + head[_FIXED.size :] + tag[8:], body


def encode(
    data: np.ndarray,
    meta: PayloadMeta,
    key: str = "",
    serde: str = "raw",
    *,
    secret: Secret | None = None,
) -> np.ndarray:
    """Header + raw bytes in one flat uint8 array (bytes-like; one copy of the body).

    A numpy buffer rather than `bytes`: large `bytes` objects are several times
    slower to allocate and fill than numpy's (huge-page friendly) allocations.
    With `secret`, a keyed (version 2) record.
    """
    head, body = encode_parts(data, meta, key, serde, secret=secret)
    out = np.empty(len(head) + body.nbytes, dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[len(head) :] = np.frombuffer(body, dtype=np.uint8)
    return out


class ForeignRecordError(PayloadError):
    """A well-formed record this reader may not serve: plain where it needs a keyed one,
    keyed where it has no secret, or keyed with another secret (or forged: the two look
    alike). Another process of a shared store may own it, so a store treats it as a miss
    and leaves it in place; only a malformed record is deleted."""


def _check_version(version: int, keyed: bool) -> None:
    """A reader with a secret takes only keyed records, one without takes only plain ones."""
    if version == (VERSION_KEYED if keyed else VERSION):
        return
    if version == VERSION:
        raise ForeignRecordError(
            "record has no keyed MAC, but this reader requires one (payload_secret)"
        )
    if version == VERSION_KEYED:
        raise ForeignRecordError(
            "record carries a keyed MAC, but this reader has no payload_secret"
        )
    raise PayloadError(
        f"unsupported codec version {version}, expected {VERSION} or {VERSION_KEYED}"
    )


def read_header(
    buf: Any, max_nbytes: int = MAX_PAYLOAD_BYTES, *, secret: Secret | None = None
) -> Header:
    """Parse and check a header; needs only the header's bytes (not the body).

    A reader that allocates from the declared size should pass a tight `max_nbytes`
    (e.g. its tier capacity): a header checksum is no defence against a hostile writer.
    With `secret`, only a keyed record is accepted (its tag covers the body too, so only
    `decode` checks it); without, only a plain one (whose header checksum is checked here).
    """
    view = memoryview(buf).cast("B")
    if len(view) < _FIXED.size:
        raise PayloadError(f"truncated header: {len(view)} bytes, need at least {_FIXED.size}")
    magic, version, serde, dcode, lcode, ndim, klen, nbytes, checksum = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    _check_version(version, secret is not None)
    if ndim > MAX_NDIM or klen > MAX_KEY_BYTES:
        raise PayloadError(f"corrupt header: ndim={ndim} key_len={klen}")
    header_len = _FIXED.size + 8 * ndim + klen + _HEADER_SUM.size
    if len(view) < header_len:
        raise PayloadError(f"truncated header: {len(view)} bytes, need {header_len}")
    (hsum,) = _HEADER_SUM.unpack_from(view, header_len - _HEADER_SUM.size)
    if secret is None and xxhash.xxh32_intdigest(view[: header_len - _HEADER_SUM.size]) != hsum:
        raise PayloadError("header checksum mismatch")
    if serde not in SERDE_CODES.values():
        raise PayloadError(f"unknown serde code {serde}")
    if dcode not in _DTYPE_BY_CODE or lcode not in _LAYOUT_BY_CODE:
        raise PayloadError(f"unknown dtype code {dcode} or layout code {lcode}")
    if nbytes > min(max_nbytes, MAX_PAYLOAD_BYTES):
        raise PayloadError(
            f"declared size {nbytes} exceeds the limit {min(max_nbytes, MAX_PAYLOAD_BYTES)}"
        )
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    try:
        key = bytes(view[_FIXED.size + 8 * ndim : header_len - _HEADER_SUM.size]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError("corrupt header: key is not utf-8") from exc
    meta = PayloadMeta(_DTYPE_BY_CODE[dcode], shape, _LAYOUT_BY_CODE[lcode])
    if meta.nbytes != nbytes:
        raise PayloadError(
            f"shape {list(shape)} of {meta.dtype} needs {meta.nbytes} bytes, header says {nbytes}"
        )
    return Header(meta, key, serde, nbytes, checksum, header_len, secret is not None)


# Bytes that hold any record's header (fixed part, 8 dims, a 1 KiB key, checksums): a
# store reads this much of a value before deciding to read its body.
HEADER_PREFIX_BYTES = 4096


def check_head(
    head: Any, size: int, max_nbytes: int = MAX_PAYLOAD_BYTES, *, secret: Secret | None = None
) -> Header:
    """The header of a stored record of `size` bytes whose first bytes are `head` (at
    least `HEADER_PREFIX_BYTES`, or all of it): a `PayloadError` unless it parses and
    declares exactly `size` bytes, so a store reads no body of junk, however large.
    `ForeignRecordError` (a `PayloadError`) for another secret's well-formed record."""
    header = read_header(head, max_nbytes, secret=secret)
    if header.header_len + header.nbytes != size:
        raise PayloadError(
            f"record has {size} bytes, its header declares {header.header_len} + {header.nbytes}"
        )
    return header


class Decoded(NamedTuple):
    data: np.ndarray  # flat uint8, a view of the input where possible
    meta: PayloadMeta
    key: str


def _verify_tag(view: memoryview, header: Header, secret: Secret) -> None:
    """Recompute a keyed record's tag over its header (tag slots zeroed) and body."""
    hlen = header.header_len - _HEADER_SUM.size
    signed = b"".join((view[:_SUM_AT], _NO_SUM, view[_FIXED.size : hlen]))
    stored = bytes(view[_SUM_AT : _FIXED.size]) + bytes(view[hlen : header.header_len])
    if not hmac.compare_digest(_tag(secret, signed, view[header.header_len :]), stored):
        raise ForeignRecordError("payload MAC mismatch: not written with this payload_secret")


def decode(
    buf: Any,
    expected_key: str | None = None,
    expected_dtype: str | None = None,
    *,
    secret: Secret | None = None,
) -> Decoded:
    """Parse, check and return a payload; a zero-copy view of `buf` where possible.

    Raises `PayloadError` if the bytes are truncated, too long, corrupt, or
    (when `expected_key` is given) belong to another key, or (when `expected_dtype`
    is given: a tier passes its key's `kv_dtype`) hold KV of another dtype, so a tier
    never serves bytes the key's model cannot read. With `secret`, also unless the
    record is keyed and its tag verifies (a plain record, one keyed with another
    secret, or a tampered one is refused); without, a keyed record is refused.
    """
    view = memoryview(buf).cast("B")
    header = read_header(view, secret=secret)
    end = header.header_len + header.nbytes
    if len(view) != end:
        what = "truncated" if len(view) < end else "trailing bytes after"
        raise PayloadError(f"{what} payload: have {len(view)} bytes, header declares {end}")
    body = view[header.header_len :]
    if secret is not None:
        _verify_tag(view, header, secret)
    elif xxhash.xxh3_64_intdigest(body) != header.checksum:
        raise PayloadError("payload checksum mismatch")
    if expected_key is not None and header.key != expected_key:
        raise PayloadError(f"payload belongs to key {header.key!r:.80}, not {expected_key!r:.80}")
    if expected_dtype is not None and header.meta.dtype != expected_dtype:
        raise PayloadError(f"payload holds {header.meta.dtype} KV, not {expected_dtype!r:.40}")
    return Decoded(np.frombuffer(body, dtype=np.uint8), header.meta, header.key)
