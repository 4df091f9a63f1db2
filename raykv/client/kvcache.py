"""The client API a serving app calls: `kv = raykv.connect(); kv.store(...); kv.retrieve(...)`.

Every method makes ONE actor round trip to the `StorageManager` per request (plus,
for a retrieve, one batched `ray.get` of the request's distinct batch objects, which
is zero-copy on the manager's node; with `client_remote_probe`, a lookup also asks the
`ray://` server in the same instant, see `raykv.client.probe`). Keys are computed here,
in the caller's process, from the tokens. The KV's checks and copies are the client's
`KVLayout` (`raykv.client.layout`).

Faults cost cache hits, never exceptions: an unreachable or restarting manager, a
timed-out lookup or a chunk whose owner died all read as misses (logged). Bad input
(tokens that are not 1-D ints, KV of the wrong shape or dtype, a malformed mask)
raises `raykv.errors.InvalidInputError` naming what was expected.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from raykv import metrics
from raykv.client.attach import attach_ray
from raykv.client.layout import KVLayout, KVSource, KVTarget
from raykv.client.pins import PinBook
from raykv.client.probe import ServerProbe
from raykv.client.readcache import ReadCache, object_id
from raykv.client.reads import BY_ID, BY_REF, CHECKED, check_spans, chunks_within, get_call, is_true
from raykv.client.staging import Stager, copy_buffers
from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError, RayKVError, check_timeout
from raykv.keys import CacheKey, ChunkSpan, KeyMaker, as_token_array, leading
from raykv.payload import PayloadMeta
from raykv.wire import TIER_CPU, TIER_DISK, PackedSpans, RetrieveResult, TailCandidates

logger = logging.getLogger(__name__)

# How long `connect` waits for newly created actors to come up.
_CONNECT_TIMEOUT_SECS = 120.0
# Slack on top of the manager's own bound for a put that may wait for room.
_PUT_SLACK_SECS = 30.0
# A wait or fetch without a timeout waits this many lookup time-outs for the manager.
_UNBOUNDED_WAITS = 10


class KVCache:
    """A handle on the cluster's raykv cache for one model (see `connect`)."""

    def __init__(self, config: RayKVConfig, manager: Any) -> None:
        self.config = config
        self._manager = manager
        self._keys = KeyMaker.from_config(config)
        self._layout = KVLayout(config)  # checks and copies of this model's KV
        self._pins = PinBook()  # the pinned lookups this client named itself
        self._closed = False
        # Background stores (config.store_staging_size > 0): one copy into a staging ring,
        # then a worker thread does the ray.put and the manager call.
        staging = config.store_staging_bytes
        self._stager = Stager(staging, name=f"raykv-stager-{config.namespace}") if staging else None
        # Batches read lately, kept mapped (config.read_cache_size > 0): a repeat read of
        # the same object skips its ray.get. The manager is still asked every time.
        held = config.read_cache_bytes
        self._reads = ReadCache(held) if held else None
        # Lookups that ask a ray:// server themselves, beside the manager (config
        # client_remote_probe): one round trip instead of two when the server extends
        # the prefix.
        url = config.remote_url or ""
        probe = config.client_remote_probe and url.startswith("ray://")
        self._probe = ServerProbe(url[len("ray://") :], config.namespace) if probe else None

    # ----- keys and validation -----

    def spans(self, tokens: Any, mask: Any = None) -> list[ChunkSpan]:
        """The chunks of `tokens` this cache stores and looks up (masked chunks left out)."""
        return self._keys.keys(tokens, mask)

    def hashed_spans(
        self, hashes: Sequence[int | bytes | str], offsets: Sequence[int]
    ) -> list[ChunkSpan]:
        """The chunks of an engine's own chained chunk hashes (vLLM's block hashes at chunk
        ends, which fold in what the engine keys on beyond token ids: LoRA adapter,
        multimodal inputs, `cache_salt`); `offsets[i]` is where chunk i ends."""
        return self._keys.keys_from_hashes(hashes, offsets)

    def _packed(self, spans: list[ChunkSpan]) -> Any:
        """`spans` as the manager's calls take them: the msgpack bytes of `PackedSpans`
        when their keys share one identity."""
        packed = PackedSpans.of(spans)
        return packed.wire() if isinstance(packed, PackedSpans) else packed

    def _stage(
        self,
        keyed: Callable[[], tuple[list[ChunkSpan], list[CacheKey] | None]],
        metas: list[PayloadMeta],
        nbytes: int,
        fill: Any,
        priority: int | None,
    ) -> bool:
        """Hand one store to the background worker; False if the staging ring is full.
        `keyed()` gives the spans and the prefix keys (run on the worker)."""

        def send(region: np.ndarray, done: Any) -> None:
            views, off = [], 0
            for meta in metas:
                views.append(region[off : off + meta.nbytes])
                off += meta.nbytes
            spans, prefix = keyed()
            self._put(spans, views, metas, priority, prefix, on_put=done)

        if self._stager.stage(nbytes, fill, send):  # type: ignore[union-attr]
            return True
        logger.debug("raykv staging ring full: store of %d chunks dropped", len(metas))
        metrics.inc("raykv_skipped_stores", len(metas), tier=TIER_CPU)
        return False

    def _settle(self, timeout: float | None = None) -> None:
        """Let this client's staged stores reach the manager first (read your own writes)."""
        if self._stager is not None and self._stager.pending:
            if not self._stager.drain(self._lookup_timeout * 4 if timeout is None else timeout):
                logger.warning("raykv: staged stores still in flight; this call may miss them")

    # ----- manager calls: a fault is a miss -----

    def _call(self, method: str, *args: Any, timeout: float | None, default: Any) -> Any:
        """One manager call: its reply, or `default` for a fault (logged); bad input raises."""
        return self._reply(method, self._send(method, *args), timeout, default)

    def _send(self, method: str, *args: Any) -> ray.ObjectRef | None:
        """Submit a manager call; None (logged) if it cannot be sent: a miss."""
        if self._closed:
            raise InvalidInputError("this KVCache is closed")
        if not ray.is_initialized():  # Ray shut down under us: never start a new one here
            logger.warning("raykv %s: Ray is not initialized; treated as a miss", method)
            return None
        try:
            return getattr(self._manager, method).remote(*args)
        except RayError as exc:
            logger.warning("raykv %s failed (%s): treated as a miss", method, type(exc).__name__)
            return None

    def _reply(
        self, method: str, ref: ray.ObjectRef | None, timeout: float | None, default: Any
    ) -> Any:
        """The reply to a `_send`, as `_call` gives it."""
        if ref is None:
            return default
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            logger.warning("raykv %s timed out after %.1fs: treated as a miss", method, timeout)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RayKVError):
                raise cause from None  # bad input: the caller must hear about it
            logger.error("raykv %s failed in the manager: treated as a miss\n%s", method, exc)
        except RayError as exc:  # actor dead or restarting, object lost: a fault, not a bug
            logger.warning("raykv %s failed (%s): treated as a miss", method, type(exc).__name__)
        return default

    @property
    def _lookup_timeout(self) -> float:
        return self.config.lookup_timeout_ms / 1000.0

    def _outer(self, timeout: float | None) -> float:
        """How long this client waits for a manager call given `timeout`: that and a
        lookup time-out; without one, `_UNBOUNDED_WAITS` lookup time-outs (a prefetch's
        pulls are bounded in the manager: a manager that does not answer is a miss)."""
        if timeout is None:
            return self._lookup_timeout * _UNBOUNDED_WAITS
        return timeout + self._lookup_timeout

    # ----- public API -----

    def store(
        self,
        tokens: Any,
        kv: KVSource,
        mask: Any = None,
        priority: int | None = None,
    ) -> int:
        """Store the KV of `tokens`' chunks in every tier; returns the tokens now held in CPU.

        `kv` is the prompt's KV as one `KV_2LTD` tensor `[2, L, num_tokens, hidden]`, a
        list of per-chunk `KV_2LTD` tensors, or a `KVTarget` (read through its connector).
        `mask` (all False, then all True) skips leading tokens already stored. With
        `config.priority_limit` set, a request whose `priority` exceeds it is not stored.

        With `config.store_staging_size > 0` the store runs in the background: the call
        copies the KV once into a staging ring and returns the tokens it accepted (0 when
        the ring is full: the store is dropped and counted, the caller never waits). Other
        clients see the chunks once the CPU tier has them; this client's own lookups,
        retrieves, stats and flushes first wait for its staged stores.
        """
        given, tokens = tokens, as_token_array(tokens)  # once: the key maker takes it as is
        n_tokens = len(tokens)
        limit = self.config.priority_limit
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise InvalidInputError(f"priority must be an int or None, got {priority!r}")
        # The chunks to store, without their keys yet: a staged store hashes on its worker.
        chunks = self._keys.bounds(n_tokens, self._keys.skipped(mask, n_tokens))
        if not chunks or (limit is not None and priority is not None and priority > limit):
            return 0
        self._layout.check_source(kv, chunks, n_tokens)
        metas = [self._layout.meta(span) for span in chunks]
        if self._stager is not None:
            nbytes = sum(m.nbytes for m in metas)
            if nbytes <= self._stager.ring.capacity:
                fill = lambda region, at: self._layout.fill(region, at, kv, chunks, metas)  # noqa: E731
                # The caller may reuse its array once this returns (a converted one is new).
                owned = tokens.copy() if tokens is given else tokens
                keyed = lambda: self._keyed(owned, chunks)  # noqa: E731
                staged = self._stage(keyed, metas, nbytes, fill, priority)
                return sum(s.end - s.start for s in chunks) if staged else 0
            logger.warning(
                "raykv store of %d bytes exceeds store_staging_size (%d bytes): stored in the "
                "caller's thread",
                nbytes,
                self._stager.ring.capacity,
            )
        spans, prefix = self._keyed(tokens, chunks)
        held = self._put(spans, self._layout.payloads(kv, spans), metas, priority, prefix)
        return sum(s.end - s.start for s in spans[:held])

    def _keyed(
        self, tokens: np.ndarray, chunks: list[ChunkSpan]
    ) -> tuple[list[ChunkSpan], list[CacheKey]]:
        """`chunks` (the last chunks of `tokens`, from `KeyMaker.bounds`) with their keys,
        and the keys of the chunks before them (a mask skipped those): the tiers keep
        those at least as recent as the new chunks, so eviction stays prefix-closed."""
        every = self._keys.keys_of(tokens)
        k = len(every) - len(chunks)
        spans = every[k:]
        if [s[:2] for s in spans] != [c[:2] for c in chunks]:  # never stored under wrong keys
            raise RuntimeError(f"chunk bounds {chunks[:2]}... disagree with the keys' {spans[:2]}")
        return spans, [s.key for s in every[:k]]

    def lookup(self, tokens: Any, pin: bool = False, lookup_id: str | None = None) -> int:
        """How many prefix tokens of `tokens` the cache holds, across all tiers.

        With `pin=True` the CPU part stays cached until the `retrieve` of the same
        tokens (or `unpin`), so it cannot be evicted in between. A `lookup_id` chosen by
        the caller is the caller's to pass to `retrieve`/`get_chunks` or `unpin`; without
        one, the next retrieve of these tokens (or `close`) releases the pins.
        """
        spans = self.spans(tokens)
        if not spans:
            return 0
        self._settle()
        owned = lookup_id is not None
        if pin and lookup_id is None:
            lookup_id = uuid.uuid4().hex
        hit = self._lookup(spans, pin, lookup_id)
        if pin and hit and not owned:  # a caller-named lookup is the caller's to release
            self._open_pin(lookup_id, self._last_hit_key(spans, hit))
        return hit

    def _lookup(self, spans: list[ChunkSpan], pin: bool, lookup_id: str | None) -> int:
        """Hit tokens of `spans`: the manager's answer, or with a server probe the
        manager's local answer extended by what the `ray://` server holds after it."""
        t0 = time.monotonic()
        packed = self._packed(spans)
        probe = self._probe
        # Only the arguments that differ from the defaults: Ray serializes each one.
        if probe is None or not isinstance(packed, bytes) or not probe.ready():
            args = (packed, True, None, lookup_id) if pin else (packed,)
            reply = self._call("lookup", *args, timeout=self._lookup_timeout, default=None)
            return int(self._unless_fault(reply, lookup_id if pin else None, 0))
        args = (packed, True, lookup_id) if pin else (packed,)
        local = self._send("lookup_local", *args)  # the manager's answer is the longer way
        sent = probe.send(packed)
        try:
            reply = self._reply("lookup_local", local, self._lookup_timeout, None)
            hit = int(self._unless_fault(reply, lookup_id if pin else None, 0))
        except BaseException:  # its trial would stay open: this process's probe for good
            probe.drop(sent)
            raise
        if hit >= spans[-1].end:
            probe.drop(sent)
            return hit  # the server's answer is not needed
        start = chunks_within(spans, hit, self.config.chunk_size)  # chunks held locally
        left = self._lookup_timeout - (time.monotonic() - t0)
        # A probe that could not be sent costs the server's hits of this lookup (and backs
        # off: the next ones ask the manager).
        found = None if sent is None else probe.answer(sent, len(spans), left)
        more = leading(found, start, is_true) - start if found is not None else 0
        # The manager indexes the server's chunks and counts the lookup; nobody waits.
        note = self._manager.note_remote
        probe.notes.submit(lambda: note.remote(packed, start, more, found is None))  # type: ignore[union-attr]
        return spans[start + more - 1].end if more else hit

    @staticmethod
    def _last_hit_key(spans: list[ChunkSpan], hit: int) -> CacheKey:
        return spans[max(i for i, s in enumerate(spans) if s.end <= hit)].key

    def _open_pin(self, lookup_id: str, key: CacheKey) -> None:
        """Remember a pinned lookup until its retrieve, `unpin` or `close` (`PinBook`);
        past the book's limit the oldest is released."""
        for oldest in self._pins.open(lookup_id, key):
            self.unpin(oldest, wait=False)

    def prefetch(self, tokens: Any) -> str:
        """Start loading `tokens`' cached prefix into CPU; returns at once with a lookup id."""
        return self.prefetch_spans(self.spans(tokens))

    def prefetch_spans(self, spans: list[ChunkSpan], lookup_id: str | None = None) -> str:
        """`prefetch` of chunks keyed already (`spans`, `hashed_spans`), under `lookup_id`
        if given: its `wait` says how many prefix tokens are pinned in CPU, its
        `get_chunks` (or `unpin`) releases them."""
        check_spans(spans)
        self._settle()
        lookup_id = lookup_id or uuid.uuid4().hex
        if spans and not self._closed:
            try:
                self._manager.prefetch.remote(lookup_id, self._packed(spans))
            except RayError as exc:
                logger.warning("raykv prefetch failed (%s): treated as a miss", exc)
        return lookup_id

    def wait(self, lookup_id: str, timeout: float | None = None) -> int:
        """Prefix tokens of a prefetch ready in CPU, waiting at most `timeout` seconds
        (None: until the prefetch ends, at most 10 lookup time-outs). A fault is 0 and
        releases the prefetch's pins."""
        check_timeout(timeout)
        reply = self._call("wait", lookup_id, timeout, timeout=self._outer(timeout), default=None)
        return int(self._unless_fault(reply, lookup_id, 0))

    def wait_sources(
        self, lookup_id: str, timeout: float | None = None
    ) -> tuple[int, list[tuple[str, int]]]:
        """`wait`, and where the prefix was found before its promotion into CPU:
        `[(tier kind, prefix tokens up to the end of that tier's run), ...]` in prefix
        order (kinds: "cpu", "disk", "remote", "peer"). A fault answers `(0, [])`."""
        check_timeout(timeout)
        outer = self._outer(timeout)
        reply = self._call("wait", lookup_id, timeout, True, timeout=outer, default=None)
        n, sources = self._unless_fault(reply, lookup_id, (0, []))
        return int(n), [(str(k), int(end)) for k, end in sources]

    def fetch_spans(
        self,
        spans: list[ChunkSpan],
        lookup_id: str,
        timeout: float | None = None,
        tails: TailCandidates | None = None,
        direct: bool = False,
    ) -> tuple[int, list[tuple[str, int]]]:
        """`prefetch_spans` then `wait_sources`, in one manager round trip: prefix tokens
        pinned in CPU under `lookup_id` (0: nothing pinned, nothing to release; nor for a
        `direct` hit found on disk alone) and where they were found. A fault answers
        `(0, [])`. `tails`: candidate partial chunks, of which the first held right after
        the whole chunks found extends the prefix (`save_unfull_chunk`). With `direct` (a caller
        that reads the disk tier's files itself, `raykv.client.direct`), a prefix whose
        chunks below CPU are all on disk is answered without promoting them: its sources
        then end in one disk run, whose chunks are counted but not pinned."""
        check_timeout(timeout)
        check_spans(spans)
        if not spans and (tails is None or not tails.starts):
            return 0, []
        self._settle(timeout)
        outer = self._outer(timeout)
        args: tuple = (lookup_id, self._packed(spans), timeout)
        if (tails is not None and tails.starts) or direct:
            args += (None, tails.wire() if tails is not None and tails.starts else None)
        if direct:
            args += (True,)
        reply = self._call("fetch", *args, timeout=outer, default=None)
        n, sources = self._unless_fault(reply, lookup_id, (0, []))
        return int(n), [(str(k), int(end)) for k, end in sources]

    def _unless_fault(self, reply: Any, lookup_id: str | None, miss: Any) -> Any:
        """`reply`, or `miss` for a fault (None): the manager may still pin `lookup_id`
        (a call that timed out); an unpin ends it, even one that arrives first."""
        if reply is None and lookup_id is not None:
            self.unpin(lookup_id, wait=False)
        return miss if reply is None else reply

    def note_engine(self, model_name: str, layout: str) -> dict[str, str]:
        """Tell the manager an engine keyed as `model_name` uses this namespace; the other
        key names of the same model recorded there, with their layouts ({} on a fault)."""
        reply = self._call(
            "note_engine", model_name, layout, timeout=self._lookup_timeout * 4, default={}
        )
        return dict(reply)

    def cpu_events(
        self,
        cursor: tuple[str, int, int] | None,
        identity: tuple[str, int, int, str],
        tiers: Sequence[str] | None = None,
    ) -> tuple[tuple[str, int, int], list | None] | None:
        """What entered (True) and left (False) the CPU tier since `cursor`, as the chunk
        hashes of keys of `identity` (`CacheKey.identity`), and the cursor to pass next;
        None for the events when the manager cannot say (`raykv.tiers.cpulog`). With
        `tiers` (CPU and disk), those tiers' events as (admitted, tier, chunk hash).
        None on a fault. The vLLM connector's KV events and CPU view poll it."""
        args = (cursor, identity) if tiers is None else (cursor, identity, tuple(tiers))
        return self._call("cpu_events", *args, timeout=self._lookup_timeout * 4, default=None)

    def cpu_keys(
        self, identity: tuple[str, int, int, str], tier: str = TIER_CPU
    ) -> list[str] | None:
        """The chunk hashes of keys of `identity` that `tier` (CPU or disk) holds now (to
        start a copy that `cpu_events` keeps current, from a cursor taken before it);
        None on a fault."""
        args = (identity,) if tier == TIER_CPU else (identity, tier)
        return self._call("cpu_keys", *args, timeout=self._lookup_timeout * 4, default=None)

    def disk_location(self) -> tuple[str, str, str] | None:
        """(node id, directory, secret tag) of the manager's disk tier, whose files a
        client on that node may read itself (`raykv.client.direct`); None without a disk
        tier, or on a fault (logged)."""
        wait = self._lookup_timeout * 4
        handles = self._call("tier_handles", timeout=wait, default=None) or {}
        disk = handles.get(TIER_DISK)
        if disk is None:
            return None
        try:
            node, directory, tag = ray.get(disk.location.remote(), timeout=wait)
        except (RayError, AttributeError) as exc:  # AttributeError: an older tier actor
            logger.warning("raykv: cannot ask the disk tier where it is: %r", exc)
            return None
        return str(node), str(directory), str(tag)

    def read_directly(self, spans: list[ChunkSpan], bad: Sequence[CacheKey] = ()) -> None:
        """Tell the manager (not waited for) that this client read `spans`' chunks from the
        disk tier's files itself, unasked (`raykv.client.direct`: it promotes them), and
        found the files of `bad` gone or corrupt (the disk tier drops them)."""
        self._send("read_directly", [span.key for span in spans], list(bad))

    def unpin(self, lookup_id: str, wait: bool = True) -> None:
        """Release the pins of a lookup or prefetch without retrieving.

        With `wait=False` the request is sent and not waited for (a scheduler's hot path).
        """
        self._pins.forget(lookup_id)
        if wait:
            self._call("unpin", lookup_id, timeout=self._lookup_timeout, default=None)
            return
        if self._closed:
            raise InvalidInputError("this KVCache is closed")
        if not ray.is_initialized():
            return
        try:
            self._manager.unpin.remote(lookup_id)
        except RayError as exc:
            logger.warning("raykv unpin failed (%s); the pin lease ends it", type(exc).__name__)

    def retrieve(
        self,
        tokens: Any,
        destination: torch.Tensor | KVTarget,
        mask: Any = None,
        lookup_id: str | None = None,
        return_tiers: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, dict[str, int]]:
        """Write the KV of the longest cached prefix into `destination`; returns the hit mask.

        `destination` is a `KV_2LTD` tensor `[2, L, >= num_tokens, hidden]` or a
        `KVTarget`. The mask (bool, one per token) is True where KV was written: a
        prefix of the tokens not skipped by `mask`. Pass the id of a `prefetch` (or a
        pinned `lookup`) to use what it loaded and release its pins. With
        `return_tiers`, also returns the hit tokens per tier they were found in.
        """
        tokens = as_token_array(tokens)  # once: the key maker takes it as it is
        hit = np.zeros(len(tokens), dtype=bool)
        self._layout.check_destination(destination, len(hit))
        chunks, tiers = self._fetch(tokens, mask, lookup_id)
        if chunks:
            self._layout.write(destination, chunks)
            hit[chunks[0][0].start : chunks[-1][0].end] = True
        if not return_tiers:
            return hit
        per_tier: dict[str, int] = {}
        for (span, _), tier in zip(chunks, tiers, strict=False):
            per_tier[tier] = per_tier.get(tier, 0) + span.end - span.start
        return hit, per_tier

    def _fetch(
        self, tokens: Any, mask: Any, lookup_id: str | None
    ) -> tuple[list[tuple[ChunkSpan, torch.Tensor]], list[str]]:
        """The cached prefix of `tokens` as `KV_2LTD` tensors, and the tier each came from."""
        spans = self._keys.keys_of(tokens)
        if mask is not None:
            if lookup_id is None:  # the pin may be on a masked-out chunk
                lookup_id = self._pins.take(spans)
            skip = self._keys.skipped(mask, len(tokens))
            spans = [s for s in spans if s.start >= skip]
        chunks, tiers, places = self._get_chunks(spans, lookup_id)
        out = self._layout.materialise(chunks, places, self._reads.memo if self._reads else None)
        return out, tiers[: len(out)]

    def get_chunks(
        self, spans: list[ChunkSpan], lookup_id: str | None = None, timeout: float | None = None
    ) -> tuple[list[tuple[ChunkSpan, np.ndarray, PayloadMeta]], list[str]]:
        """The raw payloads of the longest cached prefix of `spans`, and their tiers.

        One manager call for the chunk refs and one `ray.get` of their batches (none for
        batches held in the read cache, `read_cache_size`). Each
        payload is a read-only flat `uint8` array with its `PayloadMeta`, in whatever
        layout it was stored (`put_chunks`). Releases the pins of `lookup_id` (or of
        this client's own pinned lookup of the same prefix). A fault is a shorter prefix;
        so is a read that `timeout` seconds (if given) do not cover, and it is not retried.
        """
        check_spans(spans)
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks, tiers, _ = self._get_chunks(spans, lookup_id, deadline)
        return chunks, tiers

    def _get_chunks(
        self, spans: list[ChunkSpan], lookup_id: str | None, deadline: float | None = None
    ) -> tuple[list[tuple[ChunkSpan, np.ndarray, PayloadMeta]], list[str], list[Any] | None]:
        """`get_chunks`, and where each payload lies in the read cache (object id, index
        in its batch), None without one. `deadline` (monotonic) bounds the whole read."""
        if not spans:
            if lookup_id is not None:
                self.unpin(lookup_id, wait=False)
            return [], [], None
        self._settle(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if lookup_id is None:
            lookup_id = self._pins.take(spans)
        else:
            self._pins.forget(lookup_id)
        packed = self._packed(spans)
        reads = self._reads
        keys = [s.key for s in spans] if reads is not None else []
        attempt = BY_ID if reads is not None and reads.covers(keys) else BY_REF
        while attempt is not None:
            method, args = get_call(attempt, packed, lookup_id)
            reply = self._call(method, *args, timeout=self._left(deadline), default=None)
            result = None if reply is None else RetrieveResult.of(reply)
            if result is None or not result.chunks:
                return [], [], None
            lookup_id = None  # that get released the pins
            refs = list({c.ref: None for c in result.chunks})
            got, attempt = self._read_attempt(attempt, refs, self._left(deadline))
            if got is None:
                continue
            values = dict(zip(refs, got, strict=True))
            pairs = list(zip(spans, result.chunks, strict=False))
            places = None
            if reads is not None:
                reads.note(keys[: len(pairs)], [c.ref for _, c in pairs])
                oids = {ref: object_id(ref) for ref in refs}  # one per batch, not per chunk
                places = [(oids[c.ref], c.index) for _, c in pairs]
            chunks = [(span, values[c.ref][c.index], c.meta) for span, c in pairs]
            return chunks, list(result.tiers), places
        return [], [], None

    def _left(self, deadline: float | None) -> float:
        """Seconds a read's next call may wait (at least 1 ms: a ready one is answered)."""
        default = self._lookup_timeout * 4
        return default if deadline is None else min(default, max(1e-3, deadline - time.monotonic()))

    def _read_attempt(
        self, attempt: str, refs: list[Any], timeout: float | None = None
    ) -> tuple[list[Any] | None, str | None]:
        """The values of `refs` for this attempt, or (None, the next attempt to make)."""
        if attempt == BY_ID:
            got = self._reads.held(refs)  # type: ignore[union-attr]
            return (got, attempt) if got is not None else (None, BY_REF)
        try:
            return self._read(refs, timeout), attempt
        except GetTimeoutError:  # a slow object store, not a restarted CPU store
            logger.warning("raykv chunk read timed out after %.3fs: a miss", timeout or 0.0)
            return None, None
        except RayError as exc:
            # The CPUStore restarted since the manager indexed these refs: ask again, with
            # the manager checking which chunks the CPU store still holds.
            logger.warning("raykv chunk read failed (%s); retrying once", type(exc).__name__)
            return None, (CHECKED if attempt == BY_REF else None)

    def _read(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list[Any]:
        """The values of the batch objects `refs` (from the read cache where held)."""
        timeout = self._lookup_timeout * 4 if timeout is None else timeout
        if self._reads is None:
            return ray.get(refs, timeout=timeout)
        return self._reads.read(refs, lambda missing: ray.get(missing, timeout=timeout))

    def put_chunks(
        self,
        spans: list[ChunkSpan],
        buffers: list[np.ndarray],
        metas: list[PayloadMeta],
        prefix: list[CacheKey] | None = None,
    ) -> int:
        """Store raw payloads, one per span, in every tier; returns how many CPU now holds.

        For engines that keep their own layout (e.g. whole vLLM pages, `PAGES`): the
        payloads are flat `uint8` arrays, stored as they are, in one `ray.put` and one
        manager call. The first put of a key wins.
        """
        check_spans(spans)
        if not (len(spans) == len(buffers) == len(metas)):
            raise InvalidInputError(
                f"got {len(spans)} spans, {len(buffers)} buffers and {len(metas)} metas; "
                "need one buffer and one meta per span"
            )
        for j, (buf, meta) in enumerate(zip(buffers, metas, strict=True)):
            if not isinstance(meta, PayloadMeta) or meta.dtype != self.config.kv_dtype:
                raise InvalidInputError(
                    f"payload {j}: meta {meta!r} must be a PayloadMeta of dtype "
                    f"{self.config.kv_dtype} (config kv_dtype)"
                )
            flat = isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1
            if not flat or buf.nbytes != meta.nbytes:
                raise InvalidInputError(
                    f"payload {j} must be a flat uint8 numpy array of {meta.nbytes} bytes"
                )
        if not spans:
            return 0
        nbytes = sum(m.nbytes for m in metas)
        if self._stager is not None and nbytes <= self._stager.ring.capacity:
            fill = lambda region, _at: copy_buffers(region, buffers)  # noqa: E731
            keyed = lambda: (spans, prefix)  # noqa: E731
            return len(spans) if self._stage(keyed, metas, nbytes, fill, None) else 0
        return self._put(spans, list(buffers), metas, None, prefix)

    def _put(
        self,
        spans: list[ChunkSpan],
        arrays: list[np.ndarray],
        metas: list[PayloadMeta],
        priority: int | None = None,
        prefix: list[CacheKey] | None = None,
        on_put: Any = None,
    ) -> int:
        """One `ray.put` of the request's payloads, one manager call; chunks CPU now holds.

        The input was checked before: any failure from here on is a fault (object store
        full, Ray going away, ...), which costs the chunks (0 stored), never an exception.
        `on_put` (if given) is called once the payloads are copied out of `arrays`.
        """
        if not ray.is_initialized():  # Ray shut down under us: never start a new one here
            return 0
        try:
            try:
                batch = [ray.put(arrays)]
            finally:
                if on_put is not None:
                    on_put()
        except Exception as exc:  # the chunks are not cached; the caller's request goes on
            logger.warning(
                "raykv put of %d chunks failed (%s: %s): not cached",
                len(arrays),
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, RayError),  # a non-Ray error may be a bug: trace it
            )
            metrics.inc("raykv_tier_errors", 1, tier=TIER_CPU, kind="client_put")
            metrics.inc("raykv_skipped_stores", len(arrays), tier=TIER_CPU)
            return 0
        timeout = self.config.blocking_timeout_secs + _PUT_SLACK_SECS
        packed = self._packed(spans)
        args = (packed, metas, batch)
        if priority is not None or prefix:  # only what differs from the defaults
            args += (priority, prefix or None)
        result = self._call("put", *args, timeout=timeout, default=None)
        # New, or already cached (the first put wins).
        return 0 if result is None else result.stored + result.present

    # ----- layer by layer -----

    def _require_layerwise(self) -> None:
        if not self.config.use_layerwise:
            raise InvalidInputError("layerwise transfer is off: set use_layerwise: true")

    def store_layerwise(self, tokens: Any, source: KVTarget, mask: Any = None) -> Iterator[int]:
        """Layer-by-layer store: yields layer i before copying it out of `source`.

        Run layer i's compute in the loop body; the chunks are stored (one manager
        call) when the loop ends.
        """
        self._require_layerwise()
        spans = self.spans(tokens, mask)
        self._layout.check_destination(source, 0)
        payloads, steps = source.connector.to_payloads_layerwise(
            source.buffers, spans, source.slot_mapping
        )
        yield from steps
        if spans:
            self.store(tokens, list(payloads), mask)

    def retrieve_layerwise(
        self, tokens: Any, destination: KVTarget, mask: Any = None, lookup_id: str | None = None
    ) -> Iterator[int]:
        """Layer-by-layer load: yields layer i once its KV is in `destination`.

        The chunks are fetched first (one manager call, one `ray.get`); then layer
        i+1's copy is in flight while the loop body runs layer i's compute. The hit
        mask is the generator's return value (`StopIteration.value`).
        """
        self._require_layerwise()
        tokens = as_token_array(tokens)  # once: the key maker takes it as it is
        hit = np.zeros(len(tokens), dtype=bool)
        self._layout.check_destination(destination, len(hit))
        chunks, _ = self._fetch(tokens, mask, lookup_id)
        if chunks:
            yield from destination.connector.from_payloads_layerwise(
                [t for _, t in chunks],
                destination.buffers,
                [s.start for s, _ in chunks],
                destination.slot_mapping,
            )
            hit[chunks[0][0].start : chunks[-1][0].end] = True
        return hit

    # ----- admin -----

    def stats(self) -> dict[str, Any]:
        """Per-tier entries, bytes, hits and evictions (see `StorageManager.stats`)."""
        self._settle()
        stats = self._call("stats", timeout=30.0, default={})
        if stats and (self._stager, self._reads, self._probe) != (None, None, None):
            client = stats["client"] = {}
            if self._stager is not None:
                client.update(self._stager.stats())
            if self._reads is not None:
                client.update(self._reads.stats())
            if self._probe is not None:
                client.update(self._probe.stats())
        return stats

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until background writes to the disk and remote tiers have landed."""
        t0 = time.monotonic()
        if self._stager is not None and not self._stager.drain(timeout):
            return False
        if self._probe is not None and not self._probe.notes.drain(timeout):
            return False
        left = max(0.0, timeout - (time.monotonic() - t0))
        return bool(self._call("flush", left, timeout=left + 5.0, default=False))

    def clear(self) -> None:
        """Empty every tier of this namespace."""
        self._settle()
        if self._reads is not None:
            self._reads.clear()
        self._call("clear", timeout=60.0, default=None)

    def close(self) -> None:
        """Release this client's pins; the shared cache itself keeps running."""
        if self._closed:
            return
        if self._stager is not None:
            self._stager.close(self._lookup_timeout * 4)
        if self._reads is not None:
            self._reads.clear()
        if self._probe is not None:
            self._probe.notes.close(self._lookup_timeout)
        for lookup_id in self._pins:  # sent, not waited for: one per pin
            self.unpin(lookup_id, wait=False)
        self._pins.clear()
        self._closed = True

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(config: RayKVConfig | None = None, **overrides: Any) -> KVCache:
    """Attach to (or create) the raykv actors of the current Ray cluster and namespace.

    `config` defaults to `RayKVConfig.load()` (defaults < YAML file < `RAYKV_*` env);
    keyword `overrides` win over all of them. If Ray is not up in this process, attaches to
    `ray_address` (else `$RAY_ADDRESS`) and raises `ConfigError` when neither is set.
    With `enable_controller: true` the client attaches to the manager of the node it
    runs on (one cache instance per node, peers of each other through the controller);
    otherwise to the namespace's one cluster-wide manager.
    """
    from raykv.actors.storage_manager import get_or_create_manager

    if config is None:
        config = RayKVConfig.load(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    if config.local_disk:  # the disk actor would refuse it too, but only in its own log
        from raykv.tiers.chunkfiles import check_owner

        check_owner(config.local_disk)
    attach_ray(config.ray_address)
    node_id = ray.get_runtime_context().get_node_id() if config.enable_controller else None
    kv = KVCache(config, get_or_create_manager(config, node_id))
    # Wait for the actors to be up (seconds on first use), so the first request is not slow.
    kv._call("incarnations", timeout=_CONNECT_TIMEOUT_SECS, default=None)
    return kv
