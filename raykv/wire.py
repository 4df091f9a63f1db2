"""Records that cross actors: what a client, the manager and the tiers send each other.

Plain dataclasses with no Ray import (an ObjectRef is only carried, never made here), so
the Ray-free tier classes in `raykv.tiers` and the actor shells share one definition.

* A *batch object* is one Ray object holding `list[np.ndarray]` (flat uint8 chunk
  payloads, see `raykv.payload`): one per request, not one per chunk.
* A chunk in the CPU tier is addressed by a `ChunkRef`: the batch's ObjectRef, the
  chunk's index in it, and its `PayloadMeta`.
* Lower tiers (disk, remote) implement `LowerTier`; `get_batch` is called with
  `num_returns=2` so the caller owns the returned arrays object.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, ChunkSpan, KeyIdentity, make_key

if TYPE_CHECKING:
    import numpy as np
    import ray

    from raykv.payload import PayloadMeta

TIER_CPU = "cpu"
TIER_DISK = "disk"
TIER_REMOTE = "remote"
TIER_ORDER = (TIER_CPU, TIER_DISK, TIER_REMOTE)
# The peer tier: another node's CPU tier, reached through that node's manager.
TIER_PEER = "peer"


@dataclass(frozen=True, slots=True)
class PeerTier:
    """The tier of a lookup plan's segment that another node's manager serves from its
    CPU tier (`manager`: that manager's actor name); `kind` of it is `TIER_PEER`."""

    manager: str

    def __str__(self) -> str:
        return f"{TIER_PEER}:{self.manager}"


def kind(tier: str | PeerTier) -> str:
    """The tier name of a plan segment's tier (a `PeerTier` -> "peer")."""
    return TIER_PEER if isinstance(tier, PeerTier) else tier


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where one cached chunk lives in the CPU tier: `ray.get(ref)[index]` is its flat bytes.

    (In a result read from `RetrieveResult.wire(ids=True)`, `ref` is the object's id.)
    `batch_nbytes` is the whole object's size where the CPU tier knows it (0: unknown):
    a peer read sends an object as it is only when the chunks wanted are most of it."""

    ref: ray.ObjectRef
    index: int
    meta: PayloadMeta
    batch_nbytes: int = field(default=0, compare=False)


@dataclass(slots=True)
class PutAck:
    """What a tier did with a put: which keys it accepted, which it evicted to make room,
    and which it skipped (no room, everything pinned, or a write it refused)."""

    accepted: list[CacheKey] = field(default_factory=list)
    evicted: list[CacheKey] = field(default_factory=list)
    skipped: list[CacheKey] = field(default_factory=list)
    incarnation: str = ""  # the tier's incarnation, where its shell knows it ("" = unknown)


@dataclass(slots=True)
class CPUAck:
    """Reply of `CPUStoreActor.put` / `pull`.

    `refs` maps every requested key now readable to its `ChunkRef`: keys accepted
    now, keys already cached (the first put wins), and, for pulls, chunks served but
    not cached for lack of room (or served from a peer's objects, not copied yet: see
    `CPUStoreActor.adopt`). `accepted` and `present` are what the CPU index holds;
    `evicted` left the index to make room; `skipped` were not cached; `missing` (pulls
    only) the source did not have.
    """

    incarnation: str
    refs: dict[CacheKey, ChunkRef] = field(default_factory=dict)
    accepted: list[CacheKey] = field(default_factory=list)
    present: list[CacheKey] = field(default_factory=list)
    evicted: list[CacheKey] = field(default_factory=list)
    skipped: list[CacheKey] = field(default_factory=list)
    missing: list[CacheKey] = field(default_factory=list)
    seq: int = 0  # this store's reply number (1, 2, ...): the manager notices a lost one


@dataclass(slots=True)
class PutResult:
    """What `put` did in the CPU tier (disk and remote writes finish in the background)."""

    stored: int = 0  # chunks newly cached in CPU
    present: int = 0  # chunks already cached, or being cached by a put in flight (the first wins)
    skipped: int = 0  # chunks not cached in CPU: no unpinned room within the timeout


@dataclass(slots=True)
class RetrieveResult:
    """The longest available prefix: `chunks[i]` holds the chunk of `spans[i]`.

    Read a chunk with `ray.get(chunk.ref)[chunk.index]`; fetch the distinct refs of a
    request with one `ray.get`. `tiers[i]` is where chunk i was found before it was
    served from CPU.
    """

    chunks: list[ChunkRef] = field(default_factory=list)
    hit_tokens: int = 0
    tiers: list[str] = field(default_factory=list)

    @property
    def hit_chunks(self) -> int:
        return len(self.chunks)

    def mask(self, n_chunks: int) -> list[bool]:
        """Hit mask over the request's chunks (a prefix of True)."""
        return [i < len(self.chunks) for i in range(n_chunks)]

    def wire(self, ids: bool = False) -> tuple[Any, ...]:
        """This result as one plain tuple (what `StorageManager.get` returns): Ray sends its
        lists, ints and strings with msgpack and pickles only the refs. Each distinct batch
        ref and meta appears once, the chunks as indexes into them: pickled per ChunkRef,
        a 512-chunk answer cost ~6 ms. `RetrieveResult.of` reads it back.

        With `ids`, each batch is named by its object id (`ref.binary()`, bytes) instead of
        its ref: for a reader that holds those objects already (a client's read cache), as
        a returned ref costs the caller ~0.1-0.3 ms to register with the ref's owner. That
        form holds no ref, so it goes as msgpack bytes: Ray pickles a returned tuple (its
        serializer sends only bytes, str, numbers, lists and dicts as msgpack), which cost
        both ends ~0.15 ms a call on caches a large copy had just flushed."""
        refs: dict[Any, int] = {}
        metas: dict[Any, int] = {}
        which, index, meta_of = [], [], []
        for c in self.chunks:
            which.append(refs.setdefault(c.ref, len(refs)))
            index.append(c.index)
            meta_of.append(metas.setdefault(c.meta, len(metas)))
        plain = [(m.dtype, m.shape, m.layout) for m in metas]
        if ids:
            named = [r.binary() for r in refs]
            return _pack(
                (RESULT_WIRE, named, which, index, plain, meta_of, self.hit_tokens, self.tiers)
            )
        return (RESULT_WIRE, list(refs), which, index, plain, meta_of, self.hit_tokens, self.tiers)

    @classmethod
    def of(cls, value: Any) -> RetrieveResult:
        """The result a `wire()` form holds (a `RetrieveResult` is returned as is)."""
        if isinstance(value, RetrieveResult):
            return value
        if isinstance(value, bytes | bytearray | memoryview):
            value = _unpack(value, "retrieve result")
        tag, refs, which, index, plain, meta_of, hit_tokens, tiers = value
        if tag != RESULT_WIRE:
            raise ValueError(f"not a RetrieveResult wire form: {tag!r}")
        metas = [_meta(dtype, tuple(shape), layout) for dtype, shape, layout in plain]
        chunks = [
            ChunkRef(refs[w], i, metas[m]) for w, i, m in zip(which, index, meta_of, strict=True)
        ]
        return cls(chunks, hit_tokens, list(tiers))

    def __reduce__(self) -> tuple[Any, ...]:
        return (RetrieveResult.of, (self.wire(),))


RESULT_WIRE = "raykv.retrieve/1"


@functools.lru_cache(maxsize=256)
def _meta(dtype: str, shape: tuple[int, ...], layout: str) -> PayloadMeta:
    """A `PayloadMeta` read off the wire, checked once per distinct value (a model's
    chunks have one or two): its checks cost more than the rest of a 1-chunk reply."""
    from raykv.payload import PayloadMeta

    return PayloadMeta(dtype, shape, layout)


class PackedKeys:
    """Keys of one identity in a compact wire form: the identity once and the chunk
    hashes. Pickles ~15x faster than a list of `CacheKey` (171 keys: 0.07 ms against
    1 ms), which a lookup pays on every actor hop; build it with `of`."""

    __slots__ = ("identity", "hashes")

    def __init__(self, identity: KeyIdentity, hashes: list[str]) -> None:
        self.identity = identity  # CacheKey.identity of every key
        self.hashes = hashes

    @classmethod
    def of(cls, keys: Sequence[CacheKey]) -> PackedKeys | list[CacheKey]:
        """Pack `keys`; returns them unchanged (a list) if they differ in identity."""
        if not keys:
            return list(keys)
        identity = keys[0].identity
        model, world, worker, dtype = identity
        for k in keys:  # tuple fields by index: this runs for every key
            if k[0] != model or k[1] != world or k[2] != worker or k[4] != dtype:
                return list(keys)
        return cls(identity, [k[3] for k in keys])

    def keys(self) -> list[CacheKey]:
        return CacheKey.many(self.identity, self.hashes)

    def __len__(self) -> int:
        return len(self.hashes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedKeys, (self.identity, self.hashes))

    def wire(self) -> bytes:
        """These keys as msgpack bytes (a tag, the identity, the hashes): what a lookup's
        remote probe sends, the cheapest argument for Ray (see `PackedSpans.wire`)."""
        return _pack((KEYS_WIRE, self.identity, self.hashes))


KEYS_WIRE = "raykv.keys/1"


def unpack_keys(keys: Sequence[CacheKey] | PackedKeys | bytes) -> list[CacheKey]:
    """The keys of a `PackedKeys`, of its `wire()` bytes (or a `PackedSpans`' `wire()`),
    or of a plain sequence (as a list). Malformed bytes are an `InvalidInputError`."""
    if isinstance(keys, PackedKeys):
        return keys.keys()
    if not isinstance(keys, bytes | bytearray | memoryview):
        return list(keys)

    try:
        value = _unpack(keys, "keys")
        spans = PackedSpans.from_wire(value)  # a lookup's spans serve as its keys too
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    if spans is not None:
        return spans.keys()
    if not (isinstance(value, list) and len(value) == 3 and value[0] == KEYS_WIRE):
        raise InvalidInputError("malformed keys wire form: need its tag, identity (4), hashes")
    try:
        identity, hashes = _checked_form("keys", value[1], value[2])
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    return CacheKey.many(identity, hashes)


_HEX = re.compile(r"[0-9a-f]*")
_NO_HASH = "0" * 32


def _checked_form(
    what: str, identity: Any, hashes: Any, ends: Any = None
) -> tuple[KeyIdentity, list[str]]:
    """The identity and hashes of a wire form, type-checked (any msgpack value may arrive:
    an int, None, a dict, an ext type); ValueError naming what is wrong. One C-speed
    pass over the joined hashes, so a 512-key request pays microseconds."""
    if not (isinstance(identity, tuple | list) and len(identity) == 4):
        raise ValueError(
            f"malformed {what} wire form: identity must be (model, world, worker, dtype)"
        )
    model, world, worker, dtype = identity
    if not (
        type(model) is str
        and type(dtype) is str
        and type(world) is int
        and type(worker) is int
        and 0 <= worker < world
    ):
        raise ValueError(f"malformed {what} wire form: bad identity {identity!r:.200}")
    try:  # what `make_key` asks of a key: a model name, a dtype name, a bounded length
        make_key(model, world, worker, _NO_HASH, dtype)
    except InvalidInputError as exc:
        raise ValueError(f"malformed {what} wire form: {exc}") from None
    if not isinstance(hashes, list | tuple) or not all(type(h) is str for h in hashes):
        raise ValueError(f"malformed {what} wire form: hashes must be a list of strings")
    joined = "".join(hashes)
    if (
        len(joined) != 32 * len(hashes)
        or not all(map((32).__eq__, map(len, hashes)))
        or not _HEX.fullmatch(joined)
    ):
        raise ValueError(f"malformed {what} wire form: each hash must be 32 lower-case hex digits")
    if ends is not None and not (
        isinstance(ends, list | tuple)
        and len(ends) == len(hashes)
        and all(type(e) is int for e in ends)
        and (not ends or min(ends) >= 0)
    ):
        raise ValueError(f"malformed {what} wire form: ends must be one int >= 0 per hash")
    return (model, world, worker, dtype), list(hashes)


def _pack(value: tuple) -> bytes:
    """A wire form's msgpack bytes (strings, ints, lists: never pickle)."""
    import msgpack

    return msgpack.packb(value)


def _unpack(data: bytes | bytearray | memoryview, what: str) -> Any:
    """What `_pack` made; ValueError naming `what` for bytes msgpack cannot read."""
    import msgpack

    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack's own errors: bytes that are no wire form
        raise ValueError(f"malformed {what} wire form: {exc}") from None


class PackedSpans(PackedKeys):
    """A request's spans in a compact wire form: `PackedKeys` plus the token ends. A
    512-chunk lookup spends most of its time (de)serialising CacheKeys otherwise; build
    it with `of`.
    """

    __slots__ = ("ends",)

    def __init__(self, identity: KeyIdentity, hashes: list[str], ends: list[int]) -> None:
        super().__init__(identity, hashes)
        self.ends = ends

    @classmethod
    def of(cls, spans: Sequence[ChunkSpan]) -> PackedSpans | list[ChunkSpan]:  # type: ignore[override]
        """Pack `spans`; returns them unchanged (a list) if their keys differ in identity."""
        if not spans:
            return list(spans)
        identity = spans[0].key.identity
        model, world, worker, dtype = identity
        keys = [s[2] for s in spans]  # tuple fields by index: this runs for every key
        for k in keys:
            if k[0] != model or k[1] != world or k[2] != worker or k[4] != dtype:
                return list(spans)
        return cls(identity, [k[3] for k in keys], [s[1] for s in spans])

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedSpans, (self.identity, self.hashes, self.ends))

    def wire(self) -> bytes:
        """These spans as msgpack bytes (a tag, the identity, the hashes, the ends): one
        bytes argument is the cheapest thing Ray sends, ~0.1 ms less per call than the
        same tuple of lists after a large copy flushed the caches, and never pickled.
        `from_wire` reads it back (and the tuple form)."""
        return _pack((SPANS_WIRE, self.identity, self.hashes, self.ends))

    @classmethod
    def from_wire(cls, value: Any) -> PackedSpans | None:
        """The spans of a `wire()` form (bytes, or the tuple inside); None if `value` is
        not one; ValueError if it is one, malformed."""
        if isinstance(value, bytes | bytearray | memoryview):
            value = _unpack(value, "spans")
        if not (isinstance(value, tuple | list) and len(value) == 4 and value[0] == SPANS_WIRE):
            return None
        _, identity, hashes, ends = value
        identity, hashes = _checked_form("spans", identity, hashes, ends)
        return cls(identity, hashes, list(ends))


SPANS_WIRE = "raykv.spans/1"


def split_batch(batch: Any, ref_type: type | None) -> tuple[list[Any], list[np.ndarray]]:
    """A put's batch as (refs, arrays): `[ObjectRef]` (or one bare ref) whose values are
    `list[np.ndarray]` gives (refs, []); arrays passed by value give ([], arrays).
    `ref_type` is `ray.ObjectRef`, or None where Ray is not loaded (no refs can exist)."""
    if ref_type is not None and isinstance(batch, ref_type):
        return [batch], []
    batch = list(batch)
    if ref_type is not None and batch and all(isinstance(b, ref_type) for b in batch):
        return batch, []
    return [], batch


def join_parts(parts: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The arrays of the resolved batch refs, in order."""
    return [array for part in parts for array in part]


class LowerTier(Protocol):
    """The batch interface of a disk or remote tier actor (called through `.remote`).

    Every method takes a whole request's keys. A miss, an unreachable server or a
    corrupt payload is reported as absence (None / False), never as an exception.
    """

    def put(
        self, keys: list[CacheKey], metas: list[PayloadMeta], batch: list[ray.ObjectRef]
    ) -> PutAck:
        """Write-all: store `ray.get(batch[0])[i]` under `keys[i]`; writes may finish later,
        but a key is visible (contains/get) only once its write is complete."""

    def get_batch(self, keys: list[CacheKey]) -> tuple[list[PayloadMeta | None], list[np.ndarray]]:
        """Called with `.options(num_returns=2)`: metas (None for a miss) and the arrays
        (an empty array for a miss), as two objects so the caller can keep the second."""

    def contains(self, keys: list[CacheKey]) -> list[bool]:
        """Which keys are held (complete)."""

    def remove(self, keys: list[CacheKey]) -> int:
        """Drop keys; returns how many were held."""

    def keys(self) -> list[CacheKey]:
        """Every key held, for index rebuilds and controller resyncs."""

    def clear(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """entries, used_bytes, capacity_bytes, hits, misses, evictions, errors, policy."""

    def incarnation(self) -> str:
        """An id that changes when the actor restarts, so callers know to resync."""


# ----- decoding a request's keys from any of their forms -----


def _unwire(items: Any) -> Any:
    """`PackedSpans` for a spans wire form (`PackedSpans.wire`), else `items` as given."""
    try:
        packed = PackedSpans.from_wire(items)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    return items if packed is None else packed


def split_spans(spans: Sequence[ChunkSpan] | PackedSpans) -> tuple[list[CacheKey], list[int]]:
    """(keys, token ends) of a request's spans (a list of `ChunkSpan`, `PackedSpans` or its
    wire form); a clear error for anything else."""
    spans = _unwire(spans)
    if isinstance(spans, PackedSpans):
        return spans.keys(), list(spans.ends)
    try:
        return [s.key for s in spans], [s.end for s in spans]
    except AttributeError:
        raise InvalidInputError(
            "expected a list of ChunkSpan (start, end, key), e.g. from KeyMaker.keys(tokens), "
            "or PackedSpans.of(spans)"
        ) from None


MAX_TAIL_RANKS = 1024  # a lookup's ranks (TP x PP): each candidate is one key per rank
MAX_TAIL_CANDIDATES = 1 << 16  # a 1M-token prompt in 16-token blocks


@dataclass(frozen=True, slots=True)
class TailCandidates:
    """The partial chunks a lookup's hit may end in (`save_unfull_chunk`: a prompt's
    partial last chunk, found by the next turn that extends it): for each, where it
    starts and ends and its chunk hash, which is the same on every rank (a rank's key is
    the hash with its `worker_id`). Within one start, longest first. The manager keys
    only the candidates starting where its whole-chunk hit ends (`at`): a lookup sends
    one per block past vLLM's own hit (224 for 8k tokens in 32-token blocks; 0.15 ms to
    build, against 0.6 ms for every rank's key of each), and the manager needs at most
    a chunk's worth."""

    model_name: str
    world_size: int
    kv_dtype: str
    starts: list[int]
    ends: list[int]
    hashes: list[str]

    def wire(self) -> tuple:
        """A plain tuple (no class to unpickle on the manager's side)."""
        return (
            self.model_name,
            self.world_size,
            self.kv_dtype,
            self.starts,
            self.ends,
            self.hashes,
        )

    @classmethod
    def from_wire(cls, wire: Any) -> TailCandidates:
        """`wire()`'s tuple back, checked; a clear error for anything else."""
        try:
            model, world, dtype, starts, ends, hashes = wire
            _checked_form("tails", (model, world, 0, dtype), hashes, ends)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"tails must be TailCandidates.wire()'s tuple: {exc}") from None
        if not isinstance(starts, list | tuple) or len(starts) != len(ends):
            raise InvalidInputError("tails: one start per candidate")
        if (
            world > MAX_TAIL_RANKS
            or len(starts) > MAX_TAIL_CANDIDATES
            or world * len(starts) > MAX_TAIL_CANDIDATES
        ):
            raise InvalidInputError(
                f"tails: at most {MAX_TAIL_CANDIDATES} keys (candidates x ranks) and "
                f"{MAX_TAIL_RANKS} ranks, got {len(starts)} candidates of {world} ranks"
            )
        for start, end in zip(starts, ends, strict=True):
            if type(start) is not int or not 0 <= start < end:
                raise InvalidInputError(f"tails: bad candidate span [{start!r}, {end!r})")
        return cls(model, world, dtype, list(starts), list(ends), list(hashes))

    def identity(self, rank: int) -> KeyIdentity:
        """The `CacheKey.identity` of `rank`'s keys of these candidates."""
        return (self.model_name, self.world_size, rank, self.kv_dtype)

    def at(self, start: int) -> list[tuple[list[CacheKey], list[int]]]:
        """The candidates starting at token `start`, in the order sent, as the keys of
        every rank in rank order and their ends (every rank's but the last's is `start`,
        as in a lookup's whole chunks: a chunk counts once every rank holds it)."""
        out = []
        last = self.world_size - 1
        for s, e, h in zip(self.starts, self.ends, self.hashes, strict=True):
            if s == start:
                keys = [
                    CacheKey(self.model_name, self.world_size, r, h, self.kv_dtype)
                    for r in range(self.world_size)
                ]
                out.append((keys, [start] * last + [e]))
        return out


def as_keys(items: Sequence[CacheKey | ChunkSpan] | PackedSpans) -> list[CacheKey]:
    """Keys of `items` (keys, spans, packed spans or their wire form)."""
    items = _unwire(items)
    if isinstance(items, PackedSpans):
        return items.keys()
    return [i.key if isinstance(i, ChunkSpan) else i for i in items]
