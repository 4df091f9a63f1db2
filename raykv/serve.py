"""Ray Serve integration: cache-aware request routing for replicas that share raykv.

    from raykv.serve import router_config
    deployment.options(request_router_config=router_config("cache_aware", config))

Used by any Serve deployment whose replicas run a raykv client (a vLLM engine with
`RayKVConfig` through `raykv.integrations.vllm`, or the demo app in `raykv.demo.serve_app`).
Routers:
* ``cache_aware`` (`CacheAwareRouter`): the router hashes the request's tokens with the
  cache's `KeyMaker` and prefers the replica that holds the longest run of its leading
  chunks (at least half of them), from two sources:

  - the cluster's `KVController` (when the cache runs with ``enable_controller: true``):
    one `best_instances` call per request says which nodes' CPU/disk tiers hold how
    long a prefix; every replica on such a node counts as holding it (its node's
    StorageManager loads it locally instead of from a peer, the remote tier, or
    recomputing). A slow or missing controller costs only this signal
    (`controller_timeout_s`, then the summaries alone decide);
  - per-replica summaries: each replica reports, through Serve's routing stats
    (`record_routing_stats`), the 64-bit ids of the chained chunk hashes it served
    recently, and the router remembers what it routed itself over the last two stats
    updates (so the turns of a conversation stick at once, and what a replica's stats no
    longer list stops counting soon after). Among replicas with the same
    prefix, the one that served it itself wins (its replica-local state is warm).

  A preferred replica much busier than the least loaded one (`imbalance_threshold`),
  or no match at all, falls back to power-of-two choices on queue length.

  With vLLM engines (Ray Serve LLM) neither source applies: the connector keys chunks
  from vLLM's own block hashes under a layout-fingerprinted model name, which the
  router's `KeyMaker` cannot reproduce, and `LLMServer` reports no summaries. There
  `cache_aware` routes by what it routed itself, and load; ``events`` is the router
  that sees which blocks each engine and raykv hold.
* ``pow2``: Serve's default (`PowerOfTwoChoicesRequestRouter`).
* ``random`` (`RandomRouter`): a uniformly random replica (a baseline).

Because chained hashes name the whole prefix, "leading chunks in the summary" is the
longest prefix that replica computed recently, which is what its replica-local state
(GPU prefix cache, or its own raykv namespace with ``cache_scope="replica"``) holds.

Needs the optional extra: ``pip install "raykv[serve]"``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

import ray

try:
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import (
        FIFOMixin,
        PendingRequest,
        RequestRouter,
        RunningReplica,
    )
except ImportError as exc:  # an install hint, not a traceback
    raise ImportError('raykv.serve needs Ray Serve: pip install "raykv[serve]"') from exc

from raykv.config import RayKVConfig
from raykv.errors import ConfigError, InvalidInputError
from raykv.keys import KeyMaker, leading
from raykv.tiers.budget import BoundedKeySet

logger = logging.getLogger(__name__)

RouterName = Literal["cache_aware", "events", "prefix_affinity", "pow2", "random"]
STATS_KEY = "raykv_prefixes"  # routing-stats field: the replica's recent chunk-hash ids
EVENTS_STATS_KEY = "raykv_kv_events"  # routing-stats field: the engine's KV-event endpoint
DEFAULT_SUMMARY_SIZE = 4096  # chunk ids per replica summary (8 bytes each on the wire)


# ----- prefix summaries and the routing choice (pure, testable without Serve) -----


def chunk_ids(keys: KeyMaker, tokens: Any) -> list[int]:
    """The 64-bit ids (first 16 hex digits of the chained hash) of `tokens`' full chunks."""
    return [int(span.key.chunk_hash[:16], 16) for span in keys.keys(tokens)]


def covered_prefix(ids: Sequence[int], summary: set[int] | frozenset[int]) -> int:
    """How many leading chunk ids of a request are in `summary` (chained: a prefix match)."""
    return leading(ids, 0, summary)


_NO_STATS: tuple[int, ...] = ()  # a replica's summary when its stats list none


class PrefixSummary(BoundedKeySet):
    """A bounded LRU set of chunk ids: what one replica (or one router) saw recently."""

    __slots__ = ()

    def __init__(self, capacity: int = DEFAULT_SUMMARY_SIZE) -> None:
        super().__init__(capacity)

    @property
    def capacity(self) -> int:
        return self.max_keys

    def add(self, ids: Iterable[int]) -> None:
        """Record a request's chunk ids (most recent last; the oldest fall out)."""
        self.update(ids)

    def covered(self, ids: Sequence[int]) -> int:
        """Leading chunk ids of `ids` held here."""
        return leading(ids, 0, self)

    def snapshot(self) -> list[int]:
        """The ids, oldest first (JSON- and pickle-friendly)."""
        return list(self)


def rank_by_prefix(
    request_ids: Sequence[int],
    replicas: Sequence[Hashable],
    matches: Mapping[Hashable, int],
    queue_lens: Mapping[Hashable, int | None],
    *,
    imbalance_threshold: int = 4,
    min_match_chunks: int = 1,
    min_match_ratio: float = 0.5,
    tiebreak: Mapping[Hashable, int] | None = None,
    rng: random.Random | None = None,
) -> list[list[Hashable]]:
    """Ranks of replica ids for one request (Serve tries rank 0 first, lowest queue within).

    `matches[r]` is how many leading chunks of the request replica r holds. The replicas
    with the longest match (>= `min_match_chunks` and >= `min_match_ratio` of the
    request's chunks, so that a shared system prompt alone does not pile every new
    conversation onto one replica) form rank 0, unless all of them are
    more than `imbalance_threshold` requests busier than the least loaded replica (an
    unknown queue length counts as 0); among those, the ones with the highest
    `tiebreak` (e.g. the prefix the replica served itself) are kept. The fallback is
    power-of-two choices: two random replicas (Serve takes the shorter queue), then the rest.
    """
    if not replicas:
        return []
    rng = rng or random
    ranks: list[list[Hashable]] = []
    best = max((matches.get(r, 0) for r in replicas), default=0)
    if request_ids and best >= max(min_match_chunks, min_match_ratio * len(request_ids)):
        load = {r: queue_lens.get(r) or 0 for r in replicas}
        least = min(load.values())
        top = [r for r in replicas if matches.get(r, 0) == best]
        top = [r for r in top if load[r] - least <= imbalance_threshold]
        if top and tiebreak:
            high = max(tiebreak.get(r, 0) for r in top)
            top = [r for r in top if tiebreak.get(r, 0) == high]
        if top:
            ranks.append(top)
    rest = [r for r in replicas if not ranks or r not in ranks[0]]
    rng.shuffle(rest)
    if rest:
        ranks.append(rest[:2])
    if len(rest) > 2:
        ranks.append(rest[2:])
    return ranks


def rank_by_blocks(
    index: Any,
    request_ids: Sequence[int],
    replicas: Sequence[Hashable],
    queue_lens: Mapping[Hashable, int | None],
    *,
    raykv_events: bool = True,
    imbalance_threshold: int = 4,
    min_match_blocks: int = 1,
    min_match_ratio: float = 0.5,
    routed: Mapping[Hashable, Any] | None = None,
) -> list[list[Hashable]]:
    """`rank_by_prefix` over the blocks a `raykv.events_index.BlockIndex` says each replica
    can serve: its own engine's, or raykv's (every replica's) when `raykv_events`; ties
    go to the replica whose own engine holds more. `routed[r]` (a `RecentBlocks`) adds
    the blocks just sent to replica r, before its engine's events report them."""
    own, shared = index.matches(request_ids, replicas) if request_ids else ({}, 0)
    if routed and request_ids:
        own = {
            r: max(own.get(r, 0), routed[r].covered(request_ids) if r in routed else 0)
            for r in replicas
        }
    if not raykv_events:
        shared = 0
    return rank_by_prefix(
        request_ids,
        replicas,
        {r: max(own.get(r, 0), shared) for r in replicas},
        queue_lens,
        imbalance_threshold=imbalance_threshold,
        min_match_chunks=min_match_blocks,
        min_match_ratio=min_match_ratio,
        tiebreak=own,
    )


def request_tokens(pending: PendingRequest | None, tokenizer: Any = None) -> Any:
    """The prompt tokens of a request: a `KVModelServer.generate` call (first arg or
    `tokens=`), or a Ray Serve LLM (`LLMServer`) OpenAI completion request whose `prompt`
    is token ids, or text when the router has the model's `tokenizer` (a Hugging Face
    tokenizer, encoding as vLLM's completions endpoint does). None: route by load."""
    if pending is None:
        return None
    arg = pending.args[0] if pending.args else pending.kwargs.get("tokens")
    prompt = getattr(arg, "prompt", None)
    if prompt is None:
        return arg
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, str) and prompt and tokenizer is not None:
        try:
            return list(tokenizer(prompt)["input_ids"])
        except Exception:  # a prompt the tokenizer refuses is the replica's to reject
            return None
    return None


def load_tokenizer(name_or_path: str) -> Any:
    """The Hugging Face tokenizer a router encodes text prompts with (the model's own)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:
        raise ConfigError(f"router tokenizer {name_or_path!r} could not be loaded: {exc}") from exc


def router_tokenizer(name_or_path: str | None) -> Any:
    """`load_tokenizer` for a router being set up inside Serve: one that cannot be loaded
    is logged and text prompts route by load (raising there left Serve's router never
    initialized, and every request to the deployment waiting for it)."""
    if not name_or_path:
        return None
    try:
        return load_tokenizer(name_or_path)
    except ConfigError as exc:
        logger.error("%s; text prompts are routed by load", exc)
        return None


class TokenizerLoading:
    """A router's tokenizer, loaded on a thread: `initialize_state` runs on Serve's router
    loop, which a Hub download or a slow disk would hold (every deployment's routing in
    that process waiting). Until it is loaded, text prompts are routed by load."""

    def __init__(self, name_or_path: str) -> None:
        self._tokenizer: Any = None
        self.ready = threading.Event()
        threading.Thread(
            target=self._load, args=(name_or_path,), name="raykv-router-tokenizer", daemon=True
        ).start()

    def _load(self, name_or_path: str) -> None:
        try:
            self._tokenizer = router_tokenizer(name_or_path)  # logs a failure
        finally:
            self.ready.set()

    def __call__(self, text: str) -> Any:
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise LookupError("the router's tokenizer is not loaded (yet)")
        return tokenizer(text)


def _tokenizer_for(name_or_path: str | None) -> TokenizerLoading | None:
    return TokenizerLoading(name_or_path) if name_or_path else None


# ----- routers -----


class CacheAwareRouter(RequestRouter):
    """Longest-cached-prefix routing with a power-of-two fallback (see the module docstring).

    Not FIFO: Serve's `FIFOMixin` hands a chosen replica to the OLDEST pending request,
    so under concurrency one request's prefix choice would serve another; without it a
    choice goes to the request it was made for (matched by internal request id).
    """

    def initialize_state(
        self,
        chunk_size: int = 256,
        hash_seed: str | int = "raykv-v1",
        model_name: str = "default",
        world_size: int = 1,
        worker_id: int = 0,
        kv_dtype: str = "bfloat16",
        save_unfull_chunk: bool = False,
        imbalance_threshold: int = 4,
        min_match_chunks: int = 1,
        min_match_ratio: float = 0.5,
        history_size: int = DEFAULT_SUMMARY_SIZE,
        namespace: str | None = None,
        use_controller: bool = False,
        controller_timeout_s: float = 0.1,
        use_summaries: bool = True,
        tokenizer: str | None = None,
    ) -> None:
        """Called by Serve with `request_router_kwargs`: the cache's key fields (so the
        router's chunk keys equal the replicas'), its namespace, and the routing knobs.
        `tokenizer` (the model's, a name or path) lets it route text prompts by prefix."""
        self._tokenizer = _tokenizer_for(tokenizer)
        self._keys = KeyMaker(
            model_name=model_name,
            world_size=world_size,
            worker_id=worker_id,
            kv_dtype=kv_dtype,
            chunk_size=chunk_size,
            hash_seed=hash_seed,
            save_unfull_chunk=save_unfull_chunk,
        )
        self._imbalance = imbalance_threshold
        self._min_match = min_match_chunks
        self._min_ratio = min_match_ratio
        self._history_size = history_size
        self._use_summaries = use_summaries
        self._namespace = namespace if use_controller else None
        self._controller_timeout = controller_timeout_s
        self._controller: Any = None
        self._controller_retry_at = 0.0
        self._controller_warned = False
        # What this router sent each replica since its last stats update (immediate,
        # before its stats list it), and in the period before that.
        self._routed: dict[Any, PrefixSummary] = {}
        self._routed_before: dict[Any, PrefixSummary] = {}
        # Reported summaries as sets, cached with the reported list they were made from.
        self._reported: dict[Any, tuple[Any, frozenset[int]]] = {}
        # Per pending request: its chunk ids and the controller's {node: prefix chunks}
        # (asked once per request, even when Serve calls choose_replicas again).
        self._pending: OrderedDict[str, tuple[list[int], dict[str, int]]] = OrderedDict()

    async def node_matches(self, keys: list[Any]) -> dict[str, int]:
        """{node id: leading chunks of `keys` its tiers hold}, from the KVController.

        One actor call per request. A missing controller, an error, or a lookup or reply
        slower than `controller_timeout_s` gives {} (the summaries still route) and a
        5 s pause before the controller is asked again, so a stuck controller delays
        only the requests already waiting on it, never the ones after.
        """
        if not (self._namespace and keys) or time.monotonic() < self._controller_retry_at:
            return {}
        from raykv.actors.base import CONTROLLER_NAME

        try:
            if self._controller is None:
                self._controller = await asyncio.wait_for(
                    asyncio.to_thread(ray.get_actor, CONTROLLER_NAME, namespace=self._namespace),
                    self._controller_timeout,
                )
            ref = self._controller.best_instances.remote(keys)
            found = await asyncio.wait_for(ref, self._controller_timeout)
            return {str(node): int(n) for node, n in found}
        except Exception as exc:  # missing, dead, restarting, slow or incompatible
            if not isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                self._controller = None  # dead or restarting: look it up again later
            if not self._controller_warned:
                self._controller_warned = True
                logger.warning("routing without the KVController for now: %r", exc)
            self._controller_retry_at = time.monotonic() + 5.0
            return {}

    async def _request_state(
        self, pending: PendingRequest | None
    ) -> tuple[list[int], dict[str, int]]:
        """The request's chunk ids and {node: prefix chunks}, computed once per request
        (Serve asks again while replicas are full: a text prompt is not encoded again)."""
        if pending is None:
            return [], {}
        rid = pending.metadata.internal_request_id
        cached = self._pending.get(rid)
        if cached is None:
            tokens = request_tokens(pending, self._tokenizer)
            try:
                spans = self._keys.keys(tokens) if tokens is not None else []
            except Exception:  # a malformed request is the replica's to reject, not ours
                spans = []
            ids = [int(span.key.chunk_hash[:16], 16) for span in spans]
            cached = (ids, await self.node_matches([span.key for span in spans]))
            self._pending[rid] = cached
            while len(self._pending) > 1024:
                self._pending.popitem(last=False)
        return cached

    def _summary(self, replica: RunningReplica) -> frozenset[int]:
        reported = (replica.routing_stats or {}).get(STATS_KEY)
        if reported is None:
            reported = _NO_STATS
        rid = replica.replica_id
        cached = self._reported.get(rid)
        if cached is not None and cached[0] is reported:
            return cached[1]
        try:  # ids as a list, or an array of uint64 (hashing equal to the ints)
            held = frozenset(reported)
        except TypeError:  # a replica's malformed report costs its hits, never a request
            logger.warning("replica %s reported unusable prefix ids; ignored", rid)
            held = frozenset()
        # A routed generation ages only when the replica's list itself changed: Serve hands
        # every replica new stats objects whenever any replica reports.
        if cached is None or held != cached[1]:
            if rid in self._routed:
                self._routed_before[rid] = self._routed.pop(rid)
            else:
                self._routed_before.pop(rid, None)
        self._reported[rid] = (reported, held)
        return held

    def match(self, replica: RunningReplica, ids: Sequence[int]) -> int:
        """Leading chunks of the request the replica served itself (reported or routed here)."""
        if not self._use_summaries:
            return 0
        best = covered_prefix(ids, self._summary(replica))  # ages the routed first
        for routed in (self._routed, self._routed_before):
            summary = routed.get(replica.replica_id)
            if summary is not None:
                best = max(best, summary.covered(ids))
        return best

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id: r for r in candidate_replicas}
        ids, nodes = await self._request_state(pending_request)
        own = {rid: self.match(r, ids) for rid, r in by_id.items()} if ids else {}
        matches = {rid: max(own.get(rid, 0), nodes.get(r.node_id, 0)) for rid, r in by_id.items()}
        queue = {rid: self.replica_queue_len_cache.get(rid) for rid in by_id}
        ranks = rank_by_prefix(
            ids,
            list(by_id),
            matches,
            queue,
            imbalance_threshold=self._imbalance,
            min_match_chunks=self._min_match,
            min_match_ratio=self._min_ratio,
            tiebreak=own,
        )
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any):
        state = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if state and state[0] and replica_id in self.curr_replicas:  # not one just gone
            self._routed.setdefault(replica_id, PrefixSummary(self._history_size)).add(state[0])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set (scaled, redeployed, replaced): what this router kept
        for replicas no longer in it goes (Serve calls `on_replica_actor_died` only for
        a death it saw)."""
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for kept in (self._routed, self._routed_before, self._reported):
            for replica_id in [r for r in kept if r not in live]:
                del kept[replica_id]

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        for kept in (self._routed, self._routed_before, self._reported):
            kept.pop(replica_id, None)


class RecentBlocks:
    """Block ids a router just sent to one replica, each for `ttl_s` (long enough for its
    engine to compute them and publish its events), at most `capacity` of them."""

    __slots__ = ("_until", "capacity", "ttl_s")

    def __init__(self, ttl_s: float = 10.0, capacity: int = 65536) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._until: OrderedDict[int, float] = OrderedDict()

    def add(self, ids: Iterable[int], now: float | None = None) -> None:
        until = (time.monotonic() if now is None else now) + self.ttl_s
        for i in ids:
            self._until[i] = until
            self._until.move_to_end(i)
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)

    def covered(self, ids: Sequence[int], now: float | None = None) -> int:
        """Leading ids of `ids` sent within the last `ttl_s`."""
        now = time.monotonic() if now is None else now
        return leading(ids, 0, lambda i: self._until.get(i, 0.0) > now)


def events_endpoints(advertised: Any) -> tuple[str, str | None] | None:
    """(PUB endpoint, replay endpoint or None) from a replica's routing-stats field."""
    if isinstance(advertised, str) and advertised:
        return advertised, None
    if isinstance(advertised, dict) and isinstance(advertised.get("endpoint"), str):
        replay = advertised.get("replay")
        return advertised["endpoint"], replay if isinstance(replay, str) else None
    return None


class EventsRouter(RequestRouter):
    """Longest-cached-prefix routing from the engines' own KV events (vLLM's and raykv's).

    What a KV-aware router such as Ray Serve LLM's `KVAwareRouter` does, without its
    `ai-dynamo` dependency: each replica (`raykv.integrations.serve_llm.EventsServer`)
    advertises its engine's KV-event endpoint in its routing stats; this router
    subscribes to each (`raykv.events_index.EventSubscriber`), keeps which blocks every
    engine's pool holds and which raykv's CPU tier holds, and ranks replicas by the
    leading blocks of the request each could serve without computing them: its own
    pool's, or raykv's (any replica can load those) when `raykv_events` is true. Ties go
    to the replica whose own pool holds more (no load at all), counting for a few seconds
    the blocks of requests it just sent there (`RecentBlocks`: a burst of one new prefix
    stays together before the engine's events report it); a preferred replica much
    busier than the least loaded one, or no match, falls back to power-of-two choices
    (`rank_by_prefix`). `tokenizer` (the model's) lets it route text prompts.
    """

    def initialize_state(
        self,
        tokenizer: str | None = None,
        raykv_events: bool = True,
        imbalance_threshold: int = 4,
        min_match_blocks: int = 1,
        min_match_ratio: float = 0.5,
        max_blocks: int = 1 << 20,
    ) -> None:
        from raykv.events_index import BlockIndex

        self._tokenizer = _tokenizer_for(tokenizer)
        self._raykv_events = raykv_events
        self._imbalance = imbalance_threshold
        self._min_match = min_match_blocks
        self._min_ratio = min_match_ratio
        self.index = BlockIndex(max_blocks)
        self._subscriber: Any = None
        self._endpoints: dict[Any, tuple[str, str | None]] = {}
        self._tokens: OrderedDict[str, Any] = OrderedDict()  # per pending request
        self._routed: dict[Any, RecentBlocks] = {}  # what was just sent to each replica

    def _watch(self, replicas: Sequence[RunningReplica], *, every: bool = False) -> None:
        """Subscribe to the endpoints the replicas advertise (new or changed ones); with
        `every`, `replicas` are all the live ones: forget the others'."""
        endpoints = {} if every else dict(self._endpoints)
        for replica in replicas:
            endpoint = events_endpoints((replica.routing_stats or {}).get(EVENTS_STATS_KEY))
            if endpoint is not None:
                endpoints[replica.replica_id] = endpoint
            elif replica.replica_id in self._endpoints:
                endpoints[replica.replica_id] = self._endpoints[replica.replica_id]
        if endpoints != self._endpoints:
            for gone in set(self._endpoints) - set(endpoints):
                self.index.forget(gone)
                self._routed.pop(gone, None)
            self._endpoints = endpoints
            if self._subscriber is None:
                from raykv.events_index import EventSubscriber

                self._subscriber = EventSubscriber(self.index)
                # the subscriber's thread stops with this router
                weakref.finalize(self, self._subscriber.close)
            self._subscriber.watch(endpoints)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "index"):  # after initialize_state (Serve calls it first)
            self._watch(replicas, every=True)  # replicas scaled down or replaced
            live = {r.replica_id for r in replicas}
            for gone in [rid for rid in self._routed if rid not in live]:
                del self._routed[gone]  # also those that never advertised events

    def _request_ids(self, pending: PendingRequest | None) -> list[int]:
        if pending is None:
            return []
        rid = pending.metadata.internal_request_id
        try:  # a malformed request is the replica's to reject, not ours
            tokens = self._tokens.get(rid)
            if tokens is None:
                tokens = request_tokens(pending, self._tokenizer)
                tokens = [] if tokens is None else tokens  # (an array has no truth value)
                self._tokens[rid] = tokens
                while len(self._tokens) > 1024:
                    self._tokens.popitem(last=False)
            return self.index.request_ids(tokens)
        except Exception:
            return []

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        self._watch(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranks = rank_by_blocks(
            self.index,
            self._request_ids(pending_request),
            list(by_id),
            {rid: self.replica_queue_len_cache.get(rid) for rid in by_id},
            raykv_events=self._raykv_events,
            imbalance_threshold=self._imbalance,
            min_match_blocks=self._min_match,
            min_match_ratio=self._min_ratio,
            routed={rid: self._routed[rid] for rid in by_id if rid in self._routed},
        )
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any):
        """Remember the request's blocks on its replica until its engine's events say."""
        tokens = self._tokens.pop(pending_request.metadata.internal_request_id, None)
        if replica_id not in self.curr_replicas:  # one just gone: nothing would forget it
            return
        try:
            ids = self.index.request_ids(tokens) if tokens is not None and len(tokens) else []
        except Exception:
            ids = []
        if ids:
            self._routed.setdefault(replica_id, RecentBlocks()).add(ids)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._endpoints.pop(replica_id, None)
        self._routed.pop(replica_id, None)
        if self._subscriber is not None:
            self._subscriber.watch(self._endpoints)
        self.index.forget(replica_id)


class RandomRouter(FIFOMixin, RequestRouter):
    """A uniformly random replica (then the others, if it is full): a routing baseline."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        order = list(candidate_replicas)
        random.shuffle(order)
        return [[r] for r in order]


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _integer_from(low: int) -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low  # noqa: E731
    return ok, f"an integer >= {low}"


_POSITIVE = (lambda v: _number(v) and v > 0), "> 0"
# The routers' numeric options, each with its check and its rule: a bad value fails
# here, at deployment, not in the router's first request.
_OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "chunk_size": _integer_from(1),
    "world_size": _integer_from(1),
    "worker_id": _integer_from(0),
    "imbalance_threshold": _integer_from(0),
    "min_match_chunks": _integer_from(0),
    "min_match_blocks": _integer_from(0),
    "history_size": _integer_from(1),
    "max_blocks": _integer_from(1),
    "min_match_ratio": ((lambda v: _number(v) and 0 <= v <= 1), "in [0, 1]"),
    "controller_timeout_s": _POSITIVE,
    "stats_period_s": _POSITIVE,
}


def _check_options(router: type, options: Mapping[str, Any]) -> None:
    """Known option names for `router`, numbers within their bounds."""
    known = set(inspect.signature(router.initialize_state).parameters) - {"self"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidInputError(f"unknown router options {unknown}; known: {sorted(known)}")
    _check_values(options)


def _check_values(options: Mapping[str, Any]) -> None:
    for name, value in options.items():
        ok, rule = _OPTION_RULES.get(name, (None, ""))
        if ok is not None and not ok(value):
            raise InvalidInputError(f"router option {name}={value!r} is invalid; allowed: {rule}")


def router_config(
    router: RouterName,
    config: RayKVConfig,
    *,
    stats_period_s: float = 1.0,
    imbalance_threshold: int = 4,
    use_controller: bool | None = None,
    options: dict[str, Any] | None = None,
) -> RequestRouterConfig:
    """The `request_router_config` of the model deployment for `router`.

    `use_controller` (default: `config.enable_controller`) lets `CacheAwareRouter` ask
    the KVController of `config.namespace`; `options` are further `initialize_state`
    keyword arguments (e.g. ``controller_timeout_s``, ``use_summaries``).
    """
    _check_values({"stats_period_s": stats_period_s, "imbalance_threshold": imbalance_threshold})
    if router == "pow2":
        return RequestRouterConfig(request_routing_stats_period_s=stats_period_s)
    if router == "random":
        return RequestRouterConfig(request_router_class=RandomRouter)
    if router == "prefix_affinity":  # Ray Serve LLM's own (text prompts only)
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        return RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter,
            request_router_kwargs=dict(options or {}),
            request_routing_stats_period_s=stats_period_s,
        )
    if router == "cache_aware":
        kwargs = {
            "chunk_size": config.chunk_size,
            "hash_seed": config.hash_seed,
            "model_name": config.model_name,
            "world_size": config.world_size,
            "worker_id": config.worker_id,
            "kv_dtype": config.kv_dtype,
            "save_unfull_chunk": config.save_unfull_chunk,
            "imbalance_threshold": imbalance_threshold,
            "namespace": config.namespace,
            "use_controller": (
                config.enable_controller if use_controller is None else use_controller
            ),
            **(options or {}),
        }
        _check_options(CacheAwareRouter, kwargs)
        return RequestRouterConfig(
            request_router_class=CacheAwareRouter,
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=max(stats_period_s, 5.0),
        )
    if router == "events":  # replicas must run `raykv.integrations.serve_llm.EventsServer`
        kwargs = {"imbalance_threshold": imbalance_threshold, **(options or {})}
        _check_options(EventsRouter, kwargs)
        return RequestRouterConfig(
            request_router_class=EventsRouter,
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=max(stats_period_s, 5.0),
        )
    raise InvalidInputError(
        f"router must be cache_aware, events, prefix_affinity, pow2 or random, got {router!r}"
    )


__all__ = [
    "EVENTS_STATS_KEY",
    "CacheAwareRouter",
    "EventsRouter",
    "PrefixSummary",
    "RandomRouter",
    "RecentBlocks",
    "chunk_ids",
    "covered_prefix",
    "load_tokenizer",
    "rank_by_blocks",
    "rank_by_prefix",
    "request_tokens",
    "router_config",
]
