"""Ray Serve integration: the demo model behind HTTP, N replicas sharing raykv, cache-aware routing.

    app = raykv.serve.build_app(replicas=2, router="cache_aware")
    serve.run(app)            # POST / {"tokens": [...], "max_new_tokens": n}

Two deployments: `KVIngress` (HTTP, parses and validates the JSON) calls `KVModelServer`
(the replicas: a `ModelWorker` each, i.e. the demo Llama model plus a raykv client)
through a `DeploymentHandle`, and that handle routes with a custom Ray Serve request
router (`request_router_config`). Routers:

* ``cache_aware`` (`CacheAwareRouter`): each replica reports, through Serve's routing
  stats (`record_routing_stats`), a bounded summary of the prompts it served recently:
  the 64-bit prefixes of their chained chunk hashes. The router hashes the request's
  tokens with the same `KeyMaker` and prefers the replica whose summary covers the
  longest run of leading chunks (at least half of them); it also remembers what it
  routed itself since the last stats update, so the turns of a conversation stick at
  once. A
  preferred replica much busier than the least loaded one (`imbalance_threshold`), or
  no match at all, falls back to power-of-two choices on queue length.
* ``pow2``: Serve's default (`PowerOfTwoChoicesRequestRouter`).
* ``random`` (`RandomRouter`): a uniformly random replica (a baseline).

Because chained hashes name the whole prefix, "leading chunks in the summary" is the
longest prefix that replica computed recently, which is what its replica-local state
(GPU prefix cache, or its own raykv namespace with ``cache_scope="replica"``) holds.

Needs the optional extra: ``pip install "raykv[serve]"``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

try:
    from ray import serve
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
from raykv.errors import InvalidInputError
from raykv.keys import KeyMaker

logger = logging.getLogger(__name__)

RouterName = Literal["cache_aware", "pow2", "random"]
CacheScope = Literal["shared", "replica"]
STATS_KEY = "raykv_prefixes"  # routing-stats field: the replica's recent chunk-hash ids
DEFAULT_SUMMARY_SIZE = 4096  # chunk ids per replica summary (8 bytes each on the wire)
MAX_NEW_TOKENS_LIMIT = 1024

# A small model of the demo architecture for tests and a 2-core box (~0.3M parameters).
TINY_MODEL: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}


# ----- prefix summaries and the routing choice (pure, testable without Serve) -----


def chunk_ids(keys: KeyMaker, tokens: Any) -> list[int]:
    """The 64-bit ids (first 16 hex digits of the chained hash) of `tokens`' full chunks."""
    return [int(span.key.chunk_hash[:16], 16) for span in keys.keys(tokens)]


def covered_prefix(ids: Sequence[int], summary: set[int] | frozenset[int]) -> int:
    """How many leading chunk ids of a request are in `summary` (chained: a prefix match)."""
    n = 0
    for cid in ids:
        if cid not in summary:
            break
        n += 1
    return n


class PrefixSummary:
    """A bounded LRU set of chunk ids: what one replica (or one router) saw recently."""

    def __init__(self, capacity: int = DEFAULT_SUMMARY_SIZE) -> None:
        if capacity < 1:
            raise InvalidInputError(f"summary capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[int, None] = OrderedDict()

    def add(self, ids: Iterable[int]) -> None:
        """Record a request's chunk ids (most recent last; the oldest fall out)."""
        for cid in ids:
            self._ids[cid] = None
            self._ids.move_to_end(cid)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def covered(self, ids: Sequence[int]) -> int:
        """Leading chunk ids of `ids` held here."""
        n = 0
        for cid in ids:
            if cid not in self._ids:
                break
            n += 1
        return n

    def snapshot(self) -> list[int]:
        """The ids, oldest first (JSON- and pickle-friendly)."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def rank_by_prefix(
    request_ids: Sequence[int],
    replicas: Sequence[Hashable],
    matches: Mapping[Hashable, int],
    queue_lens: Mapping[Hashable, int | None],
    *,
    imbalance_threshold: int = 4,
    min_match_chunks: int = 1,
    min_match_ratio: float = 0.5,
    rng: random.Random | None = None,
) -> list[list[Hashable]]:
    """Ranks of replica ids for one request (Serve tries rank 0 first, lowest queue within).

    `matches[r]` is how many leading chunks of the request replica r holds. The replicas
    with the longest match (>= `min_match_chunks` and >= `min_match_ratio` of the
    request's chunks, so that a shared system prompt alone does not pile every new
    conversation onto one replica) form rank 0, unless all of them are
    more than `imbalance_threshold` requests busier than the least loaded replica (an
    unknown queue length counts as 0). The fallback is power-of-two choices: two random
    replicas (Serve takes the shorter queue), then the rest.
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
        if top:
            ranks.append(top)
    rest = [r for r in replicas if not ranks or r not in ranks[0]]
    rng.shuffle(rest)
    if rest:
        ranks.append(rest[:2])
    if len(rest) > 2:
        ranks.append(rest[2:])
    return ranks


def request_tokens(pending: PendingRequest | None) -> Any:
    """The prompt tokens of a `KVModelServer.generate` call (first arg or `tokens=`)."""
    if pending is None:
        return None
    if pending.args:
        return pending.args[0]
    return pending.kwargs.get("tokens")


# ----- routers -----


class CacheAwareRouter(FIFOMixin, RequestRouter):
    """Longest-cached-prefix routing with a power-of-two fallback (see the module docstring)."""

    def initialize_state(
        self,
        chunk_size: int = 256,
        hash_seed: str | int = "raykv-v1",
        imbalance_threshold: int = 4,
        min_match_chunks: int = 1,
        min_match_ratio: float = 0.5,
        history_size: int = DEFAULT_SUMMARY_SIZE,
        **_: Any,
    ) -> None:
        """Called by Serve with `request_router_kwargs` (the cache's chunking and seed)."""
        self._keys = KeyMaker(chunk_size=chunk_size, hash_seed=hash_seed)
        self._imbalance = imbalance_threshold
        self._min_match = min_match_chunks
        self._min_ratio = min_match_ratio
        self._history_size = history_size
        # What this router sent each replica since it started (immediate, before stats).
        self._routed: dict[Any, PrefixSummary] = {}
        # Reported summaries as sets, cached by the identity of the reported list.
        self._reported: dict[Any, tuple[int, frozenset[int]]] = {}
        self._pending_ids: OrderedDict[str, list[int]] = OrderedDict()

    def _request_ids(self, pending: PendingRequest | None) -> list[int]:
        tokens = request_tokens(pending)
        if tokens is None:
            return []
        rid = pending.metadata.internal_request_id  # type: ignore[union-attr]
        if rid in self._pending_ids:
            return self._pending_ids[rid]
        try:
            ids = chunk_ids(self._keys, tokens)
        except Exception:  # a malformed request is the replica's to reject, not ours
            ids = []
        self._pending_ids[rid] = ids
        while len(self._pending_ids) > 1024:
            self._pending_ids.popitem(last=False)
        return ids

    def _summary(self, replica: RunningReplica) -> frozenset[int]:
        reported = (replica.routing_stats or {}).get(STATS_KEY) or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] != id(reported):
            cached = (id(reported), frozenset(reported))
            self._reported[replica.replica_id] = cached
        return cached[1]

    def match(self, replica: RunningReplica, ids: Sequence[int]) -> int:
        """Leading chunks of the request the replica holds (reported or routed here)."""
        routed = self._routed.get(replica.replica_id)
        local = routed.covered(ids) if routed is not None else 0
        return max(local, covered_prefix(ids, self._summary(replica)))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id: r for r in candidate_replicas}
        ids = self._request_ids(pending_request)
        matches = {rid: self.match(r, ids) for rid, r in by_id.items()} if ids else {}
        queue = {rid: self.replica_queue_len_cache.get(rid) for rid in by_id}
        ranks = rank_by_prefix(
            ids,
            list(by_id),
            matches,
            queue,
            imbalance_threshold=self._imbalance,
            min_match_chunks=self._min_match,
            min_match_ratio=self._min_ratio,
        )
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any):
        ids = self._pending_ids.pop(pending_request.metadata.internal_request_id, None)
        if ids:
            self._routed.setdefault(replica_id, PrefixSummary(self._history_size)).add(ids)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._routed.pop(replica_id, None)
        self._reported.pop(replica_id, None)


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


# ----- deployments -----


def _check_request(tokens: Any, max_new_tokens: Any) -> tuple[list[int], int]:
    if not isinstance(tokens, list) or not tokens:
        raise InvalidInputError('"tokens" must be a non-empty list of ints')
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise InvalidInputError('"tokens" must hold ints >= 0')
    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT
    ):
        raise InvalidInputError(f'"max_new_tokens" must be an int in [1, {MAX_NEW_TOKENS_LIMIT}]')
    return tokens, max_new_tokens


class KVModelServer:
    """One replica: the demo model + a raykv client; reports its recent prefixes to routers."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        num_threads: int | None = None,
        cache_scope: CacheScope = "shared",
        summary_size: int = DEFAULT_SUMMARY_SIZE,
    ) -> None:
        from raykv.actors.gpu_worker import ModelWorker

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        cfg = RayKVConfig.load(**(config or {}))
        if cache_scope == "replica":  # a replica-local cache: its own namespace of actors
            cfg = cfg.replace(namespace=f"{cfg.namespace}-{self.replica_id}")
        elif cache_scope != "shared":
            raise InvalidInputError(f"cache_scope must be 'shared' or 'replica', got {cache_scope}")
        self.config = cfg
        self.worker = ModelWorker(cfg, seed, num_threads=num_threads, **(model or {}))
        vocab = self.worker.model.config.vocab_size
        self.vocab_size = int(vocab)
        self.summary = PrefixSummary(summary_size)
        self._lock = asyncio.Lock()  # one generate at a time: CPU prefill uses every core

    async def generate(self, tokens: list[int], max_new_tokens: int = 16) -> dict[str, Any]:
        """Generate with raykv; returns tokens, hit_tokens, ttft_s, replica and details."""
        tokens, max_new_tokens = _check_request(tokens, max_new_tokens)
        if max(tokens) >= self.vocab_size:
            raise InvalidInputError(f"token ids must be < vocab_size {self.vocab_size}")
        async with self._lock:
            out = await asyncio.to_thread(self.worker.generate, tokens, max_new_tokens)
        self.summary.add(chunk_ids(self.worker.kv._keys, tokens))
        return {
            "tokens": out["tokens"],
            "hit_tokens": int(out["hit_tokens"]),
            "ttft_s": float(out["ttft_s"]),
            "replica": self.replica_id,
            "hit_tiers": dict(out["hit_tiers"]),
            "prompt_tokens": int(out["prompt_tokens"]),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every `request_routing_stats_period_s`; read by `CacheAwareRouter`."""
        return {STATS_KEY: self.summary.snapshot()}

    def shutdown_cache(self) -> None:
        """Stop this replica's raykv actors when `cache_scope="replica"` (else a no-op)."""
        if self.config.namespace.endswith(self.replica_id):
            from raykv.actors.storage_manager import shutdown_manager

            self.worker.kv.close()
            shutdown_manager(self.config.namespace)


class KVIngress:
    """HTTP ingress: `POST /` with `{"tokens": [...], "max_new_tokens": n}`."""

    def __init__(self, model: Any) -> None:
        self._model = model

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise InvalidInputError("the body must be a JSON object")
            tokens, n = _check_request(body.get("tokens"), body.get("max_new_tokens", 16))
            return await self._model.generate.remote(tokens, n)
        except (ValueError, InvalidInputError) as exc:  # bad JSON or bad fields
            return JSONResponse({"error": str(exc)}, status_code=400)


def router_config(
    router: RouterName,
    config: RayKVConfig,
    *,
    stats_period_s: float = 1.0,
    imbalance_threshold: int = 4,
) -> RequestRouterConfig:
    """The `request_router_config` of the model deployment for `router`."""
    if router == "pow2":
        return RequestRouterConfig(request_routing_stats_period_s=stats_period_s)
    if router == "random":
        return RequestRouterConfig(request_router_class=RandomRouter)
    if router == "cache_aware":
        return RequestRouterConfig(
            request_router_class=CacheAwareRouter,
            request_router_kwargs={
                "chunk_size": config.chunk_size,
                "hash_seed": config.hash_seed,
                "imbalance_threshold": imbalance_threshold,
            },
            request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=max(stats_period_s, 5.0),
        )
    raise InvalidInputError(f"router must be cache_aware, pow2 or random, got {router!r}")


def build_app(
    *,
    replicas: int = 2,
    router: RouterName = "cache_aware",
    config: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    cache_scope: CacheScope = "shared",
    num_cpus: float = 0.5,
    num_threads: int | None = None,
    max_ongoing_requests: int = 4,
    stats_period_s: float = 1.0,
    name_suffix: str = "",
) -> serve.Application:
    """The Serve application: `KVIngress` over `replicas` x `KVModelServer` routed by `router`.

    `config` holds `RayKVConfig` overrides (defaults < file < env < these); `model`
    holds demo-model overrides (e.g. `TINY_MODEL`).
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidInputError(f"replicas must be an int >= 1, got {replicas!r}")
    cfg = RayKVConfig.load(**(config or {}))
    server = serve.deployment(KVModelServer).options(
        name=f"KVModelServer{name_suffix}",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus},
        request_router_config=router_config(router, cfg, stats_period_s=stats_period_s),
    )
    ingress = serve.deployment(KVIngress).options(
        name=f"KVIngress{name_suffix}", ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(
        server.bind(
            config, model, num_threads=num_threads, cache_scope=cache_scope, summary_size=4096
        )
    )


def app_from_env() -> serve.Application:
    """`build_app` configured by ``SERVE_DEMO_*`` variables (see examples/serve_app.py)."""
    model = TINY_MODEL if os.environ.get("SERVE_DEMO_MODEL", "tiny") == "tiny" else {}
    config = {"chunk_size": int(os.environ.get("SERVE_DEMO_CHUNK_SIZE", "64"))}
    config.setdefault("kv_dtype", "float32")
    return build_app(
        replicas=int(os.environ.get("SERVE_DEMO_REPLICAS", "2")),
        router=os.environ.get("SERVE_DEMO_ROUTER", "cache_aware"),  # type: ignore[arg-type]
        config=config,
        model=model,
        cache_scope=os.environ.get("SERVE_DEMO_CACHE_SCOPE", "shared"),  # type: ignore[arg-type]
    )


__all__ = [
    "TINY_MODEL",
    "CacheAwareRouter",
    "KVIngress",
    "KVModelServer",
    "PrefixSummary",
    "RandomRouter",
    "app_from_env",
    "build_app",
    "chunk_ids",
    "covered_prefix",
    "rank_by_prefix",
    "router_config",
]
