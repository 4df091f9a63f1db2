"""Chunking and chained prefix hashing of token sequences into `CacheKey`s.

A prompt is cut into chunks of `chunk_size` tokens. Chunk i's hash covers the
whole prefix up to and including it:

    h_0 = H(seed_digest || tokens[0:C]),   h_i = H(h_{i-1} || tokens[iC:(i+1)C])

where H is XXH3-128 over the little-endian int32 token bytes. The result is the
same in every process and on every machine: no Python `hash()`, no dependence
on PYTHONHASHSEED or on the input container (list, numpy array, torch tensor).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash

from raykv.errors import InvalidInputError

DEFAULT_HASH_SEED = "raykv-v1"
_INT32_MAX = 2**31 - 1
_LE_INT32 = np.dtype("<i4")
# Engine-provided hashes live in their own domain so they never collide with ours.
_EXTERNAL_TAG = b"\x01ext"
_SAFE_CHARS = re.compile(r"[A-Za-z0-9._-]")
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_DTYPE_NAME = re.compile(r"[A-Za-z0-9_]{1,32}\Z")
MAX_KEY_STRING_LEN = 200  # file-name safe on every common file system (limit 255 bytes)


def _quote(text: str) -> str:
    return "".join(
        ch if _SAFE_CHARS.fullmatch(ch) else "".join(f"%{b:02X}" for b in ch.encode())
        for ch in text
    )


def _unquote(text: str) -> str:
    from urllib.parse import unquote_to_bytes

    return unquote_to_bytes(text).decode("utf-8")


def leading(keys: Sequence[Any], start: int, holds: Callable[[Any], bool] | Container) -> int:
    """The end of the run of `keys[start:]` that `holds` (a predicate or a container)
    accepts: how far a chained prefix is held. The one "count leading hits" rule."""
    test = holds if callable(holds) else holds.__contains__
    end, n = start, len(keys)
    while end < n and test(keys[end]):
        end += 1
    return end


# Builds a CacheKey from its five fields without the NamedTuple's Python-level __new__.
_new_key = tuple.__new__

# (model_name, world_size, worker_id, kv_dtype): the fields a request's keys share.
KeyIdentity = tuple[str, int, int, str]


class CacheKey(NamedTuple):
    """Identifies one chunk of KV: (model, world size, worker, chained prefix hash, KV dtype).

    The string form `model@world_size@worker_id@hash@dtype` (model name
    percent-encoded) round-trips through `from_string` and is safe as a file name
    and as a Redis key. A tuple underneath: hashing, equality and ordering run in C,
    which a 512-chunk lookup pays for every key on every hop.
    """

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str  # 32 lower-case hex digits (XXH3-128)
    kv_dtype: str

    def to_string(self) -> str:
        """The stable string form, used as file name and remote key."""
        return (
            f"{_quote(self.model_name)}@{self.world_size}@{self.worker_id}"
            f"@{self.chunk_hash}@{self.kv_dtype}"
        )

    def __str__(self) -> str:
        return self.to_string()

    @property
    def identity(self) -> KeyIdentity:
        """Every field but the hash: whose KV this is (model, layout, worker, dtype)."""
        return (self[0], self[1], self[2], self[4])

    @classmethod
    def of(cls, identity: KeyIdentity, chunk_hash: str) -> CacheKey:
        """The key of `chunk_hash` under `identity` (see `identity`)."""
        model_name, world_size, worker_id, kv_dtype = identity
        return _new_key(cls, (model_name, world_size, worker_id, chunk_hash, kv_dtype))

    @classmethod
    def many(cls, identity: KeyIdentity, chunk_hashes: Iterable[str]) -> list[CacheKey]:
        """`of` for every hash (one loop in C-level tuple building: it runs for every key
        of every request that crosses an actor)."""
        model_name, world_size, worker_id, kv_dtype = identity
        return [
            _new_key(cls, (model_name, world_size, worker_id, h, kv_dtype)) for h in chunk_hashes
        ]

    @classmethod
    def from_string(cls, text: str) -> CacheKey:
        """Parse the string form; raises `InvalidInputError` if it is not one."""
        parts = text.split("@") if isinstance(text, str) else []
        if len(parts) != 5 or len(text) > MAX_KEY_STRING_LEN:
            raise InvalidInputError(
                f"not a CacheKey string: {text!r:.80}; "
                "expected model@world_size@worker_id@hash@dtype"
            )
        model, world, worker, chunk_hash, dtype = parts
        if not (world.isascii() and world.isdigit() and worker.isascii() and worker.isdigit()):
            raise InvalidInputError(
                f"not a CacheKey string: {text!r:.80}; bad world_size/worker_id"
            )
        try:
            model_name = _unquote(model)
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"not a CacheKey string: {text!r:.80}; bad model name") from exc
        key = make_key(model_name, int(world), int(worker), chunk_hash, dtype)
        if key.to_string() != text:  # reject non-canonical spellings, e.g. "%41" for "A"
            raise InvalidInputError(f"not a canonical CacheKey string: {text!r:.80}")
        return key


def make_key(
    model_name: str, world_size: int, worker_id: int, chunk_hash: str, kv_dtype: str
) -> CacheKey:
    """Build a validated `CacheKey` (the constructor itself stays cheap for the hot path)."""
    if not isinstance(model_name, str) or not model_name:
        raise InvalidInputError(f"model_name must be a non-empty str, got {model_name!r}")
    for name, value in (("world_size", world_size), ("worker_id", worker_id)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInputError(f"{name} must be an int >= 0, got {value!r}")
    if world_size < 1 or worker_id >= world_size:
        raise InvalidInputError(
            f"need 0 <= worker_id < world_size, got worker_id={worker_id}, world_size={world_size}"
        )
    if not isinstance(chunk_hash, str) or not _HEX32.match(chunk_hash):
        raise InvalidInputError(f"chunk_hash must be 32 lower-case hex digits, got {chunk_hash!r}")
    if not isinstance(kv_dtype, str) or not _DTYPE_NAME.match(kv_dtype):
        raise InvalidInputError(f"kv_dtype must be a dtype name like 'bfloat16', got {kv_dtype!r}")
    key = CacheKey(model_name, world_size, worker_id, chunk_hash, kv_dtype)
    if len(key.to_string()) > MAX_KEY_STRING_LEN:
        raise InvalidInputError(
            f"model_name {model_name!r:.60} is too long: the key string must stay within "
            f"{MAX_KEY_STRING_LEN} characters"
        )
    return key


class ChunkSpan(NamedTuple):
    """A chunk's token range [start, end) and its key."""

    start: int
    end: int
    key: CacheKey


_SMALL_IDS = 1024  # up to this many ids, range-checked without numpy (`_out_of_range`)
_UNSIGNED = {1: "B", 2: "H", 4: "I", 8: "Q"}  # memoryview formats by width


def as_token_array(tokens: Any) -> np.ndarray:
    """Normalise a 1-D int sequence (list, numpy array, torch tensor) to little-endian int32.

    Raises `InvalidInputError` for anything that is not 1-D integers in [0, 2**31).
    """
    if (
        type(tokens) is np.ndarray
        and tokens.dtype == _LE_INT32
        and tokens.ndim == 1
        and tokens.flags.c_contiguous
    ):  # already int32: only the sign to check
        if tokens.size and _out_of_range(tokens):
            raise InvalidInputError(
                f"token ids must lie in [0, {_INT32_MAX}], got min={int(tokens.min())}"
            )
        return tokens
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        raise InvalidInputError(
            f"tokens must be a 1-D sequence of ints (list, numpy array or torch tensor), "
            f"got {type(tokens).__name__}"
        )
    else:
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"tokens must be a 1-D sequence of ints: {exc}") from exc
        if arr.size == 0:
            arr = np.zeros(0, dtype=np.int32)
    if arr.ndim != 1:
        raise InvalidInputError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and _out_of_range(arr):
        raise InvalidInputError(
            f"token ids must lie in [0, {_INT32_MAX}], "
            f"got min={int(arr.min())} max={int(arr.max())}"
        )
    return arr.astype(_LE_INT32)  # a new contiguous array (1-D)


def _out_of_range(arr: np.ndarray) -> bool:
    """Whether an integer array holds an id outside [0, 2**31): one pass, not a min and a
    max (signed ids are read as unsigned, so a negative one is a huge one)."""
    width = arr.dtype.itemsize
    if width >= 4:
        limit = _INT32_MAX
    elif arr.dtype.kind == "i":  # a negative id read as unsigned exceeds the type's max
        limit = (1 << (8 * width - 1)) - 1
    else:  # uint8/uint16 ids always fit
        return False
    if arr.size <= _SMALL_IDS and arr.dtype.isnative and arr.flags.c_contiguous:
        # A prompt's worth of ids: Python's max over the bytes read as unsigned costs a
        # fifth of a numpy reduction on cold caches (a store runs right after a forward).
        return max(memoryview(arr).cast("B").cast(_UNSIGNED[width])) > limit
    if arr.dtype.kind == "i":
        arr = arr.view(arr.dtype.str.replace("i", "u"))  # same width and byte order
    return int(arr.max()) > limit


@functools.lru_cache(maxsize=64)
def _seed_digest(seed: str | int | bytes) -> bytes:
    if isinstance(seed, int) and not isinstance(seed, bool):
        seed = str(seed)
    if isinstance(seed, str):
        seed = seed.encode("utf-8")
    if not isinstance(seed, bytes):
        raise InvalidInputError(f"hash_seed must be str, int or bytes, got {type(seed).__name__}")
    return xxhash.xxh3_128_digest(b"raykv-seed\x00" + seed)


def chain_hashes(
    tokens: Any,
    chunk_size: int,
    *,
    seed: str | int | bytes = DEFAULT_HASH_SEED,
    save_unfull_chunk: bool = False,
) -> list[tuple[int, int, bytes]]:
    """Chained prefix hashes of `tokens`: one `(start, end, 16-byte digest)` per chunk.

    A trailing partial chunk is hashed only when `save_unfull_chunk` is true.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return _chain(as_token_array(tokens), chunk_size, _seed_digest(seed), save_unfull_chunk)


def _chain(
    arr: np.ndarray, chunk_size: int, seed_digest: bytes, save_unfull_chunk: bool
) -> list[tuple[int, int, bytes]]:
    """`chain_hashes` of an array `as_token_array` returned (not checked again)."""
    data = memoryview(arr).cast("B")
    n = len(arr)
    end_full = n - n % chunk_size
    stop = n if save_unfull_chunk else end_full
    prev = seed_digest
    digest = xxhash.xxh3_128_digest
    out = []
    for start in range(0, stop, chunk_size):
        end = min(start + chunk_size, n)
        prev = digest(prev + data[4 * start : 4 * end])
        out.append((start, end, prev))
    return out


def _mask_skip(mask: Any, n_tokens: int, chunk_size: int) -> int:
    """Validate a store/retrieve mask and return how many leading tokens it skips."""
    if type(mask).__module__.startswith("torch"):
        mask = mask.detach().cpu().numpy()
    arr = np.asarray(mask)
    if arr.ndim != 1 or arr.dtype != np.bool_:
        raise InvalidInputError(
            f"mask must be a 1-D bool sequence, got dtype {arr.dtype} shape {tuple(arr.shape)}"
        )
    if len(arr) != n_tokens:
        raise InvalidInputError(f"mask length {len(arr)} != number of tokens {n_tokens}")
    skip = int(np.argmax(arr)) if arr.any() else len(arr)
    if not arr[skip:].all():
        raise InvalidInputError("mask must be all False then all True (a prefix of skipped tokens)")
    if skip % chunk_size and skip != n_tokens:
        raise InvalidInputError(
            f"mask skips {skip} tokens; the count of False entries must be a multiple of "
            f"chunk_size={chunk_size}"
        )
    return skip


@dataclass(frozen=True, slots=True)
class KeyMaker:
    """Turns token sequences (or an engine's own block hashes) into `ChunkSpan`s for one model."""

    model_name: str = "default"
    world_size: int = 1
    worker_id: int = 0
    kv_dtype: str = "bfloat16"
    chunk_size: int = 256
    hash_seed: str | int | bytes = DEFAULT_HASH_SEED
    save_unfull_chunk: bool = False

    def __post_init__(self) -> None:
        make_key(self.model_name, self.world_size, self.worker_id, "0" * 32, self.kv_dtype)
        size = self.chunk_size
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidInputError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        _seed_digest(self.hash_seed)

    @property
    def identity(self) -> KeyIdentity:
        """The `CacheKey.identity` of every key this maker makes."""
        return (self.model_name, self.world_size, self.worker_id, self.kv_dtype)

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> KeyMaker:  # a RayKVConfig
        """A KeyMaker using the model identity, chunking and seed of `config`."""
        fields = {
            "model_name": config.model_name,
            "world_size": config.world_size,
            "worker_id": config.worker_id,
            "kv_dtype": config.kv_dtype,
            "chunk_size": config.chunk_size,
            "hash_seed": config.hash_seed,
            "save_unfull_chunk": config.save_unfull_chunk,
        }
        fields.update(overrides)
        return cls(**fields)

    def _key(self, digest: bytes) -> CacheKey:
        return CacheKey.of(self.identity, digest.hex())

    def keys(self, tokens: Any, mask: Any = None) -> list[ChunkSpan]:
        """One `ChunkSpan` per chunk of `tokens`; chunks masked out (leading False) are left out
        but still feed the hash chain, so the keys of later chunks are unchanged."""
        return self.keys_of(as_token_array(tokens), mask)

    def skipped(self, mask: Any, n_tokens: int) -> int:
        """Leading tokens a store/retrieve `mask` skips (0 without one); raises
        `InvalidInputError` for a malformed mask."""
        return 0 if mask is None else _mask_skip(mask, n_tokens, self.chunk_size)

    def bounds(self, n_tokens: int, skip: int = 0) -> list[ChunkSpan]:
        """The chunks `keys` makes of `n_tokens` tokens, from token `skip` on, without
        their keys (`key` is None): what a store needs before the keys, which a staged
        store leaves to its worker thread."""
        size = self.chunk_size
        stop = n_tokens if self.save_unfull_chunk else n_tokens - n_tokens % size
        first = -(-skip // size) * size
        return [ChunkSpan(s, min(s + size, n_tokens), None) for s in range(first, stop, size)]  # type: ignore[arg-type]

    def keys_of(self, arr: np.ndarray, mask: Any = None) -> list[ChunkSpan]:
        """`keys` of an array `as_token_array` returned (a caller that checked its tokens
        already: the check is a pass over them)."""
        skip = self.skipped(mask, len(arr))
        spans = _chain(arr, self.chunk_size, _seed_digest(self.hash_seed), self.save_unfull_chunk)
        model_name, world_size, worker_id, kv_dtype = self.identity
        return [
            ChunkSpan(
                s, e, _new_key(CacheKey, (model_name, world_size, worker_id, d.hex(), kv_dtype))
            )
            for s, e, d in spans
            if s >= skip
        ]

    def keys_from_hashes(
        self, hashes: Sequence[int | bytes | str], offsets: Sequence[int]
    ) -> list[ChunkSpan]:
        """Keys for an engine's precomputed chunk hashes.

        `offsets[i]` is the end token offset of chunk i (chunk 0 starts at 0), so
        chunks are contiguous. The engine's hashes must already be chained over the
        prefix (as vLLM's block hashes are); raykv maps each to a key in its own
        domain without re-chaining.
        """
        if len(hashes) != len(offsets):
            raise InvalidInputError(
                f"got {len(hashes)} hashes but {len(offsets)} offsets; need one offset per hash"
            )
        seed = _seed_digest(self.hash_seed)
        spans = []
        start = 0
        for h, end in zip(hashes, offsets, strict=True):
            if not isinstance(end, (int, np.integer)) or isinstance(end, bool) or end <= start:
                raise InvalidInputError(
                    f"offsets must be strictly increasing ints > 0, got {end!r} after {start}"
                )
            digest = xxhash.xxh3_128_digest(seed + _EXTERNAL_TAG + _external_bytes(h))
            spans.append(ChunkSpan(start, int(end), self._key(digest)))
            start = int(end)
        return spans

    def hashes_from_hashes(self, hashes: Sequence[int | bytes | str]) -> list[str]:
        """The chunk hashes `keys_from_hashes` gives the keys of an engine's `hashes`, the
        same on every rank (a rank's key is the hash with its `worker_id`), without
        building keys: what a lookup sends for many candidate chunks."""
        seed = _seed_digest(self.hash_seed) + _EXTERNAL_TAG
        return [xxhash.xxh3_128_hexdigest(seed + _external_bytes(h)) for h in hashes]


def _external_bytes(h: int | bytes | str) -> bytes:
    if isinstance(h, (bytes, bytearray)):
        return b"b" + bytes(h)
    if isinstance(h, str):
        return b"s" + h.encode("utf-8")
    if isinstance(h, (int, np.integer)) and not isinstance(h, bool):
        h = int(h)
        return b"i" + h.to_bytes(h.bit_length() // 8 + 1, "little", signed=True)
    raise InvalidInputError(f"a chunk hash must be int, bytes or str, got {type(h).__name__}")
