"""Ray Serve integration: the demo model behind HTTP, N replicas sharing raykv, cache-aware routing.

    app = raykv.serve.build_app(replicas=2, router="cache_aware")
    serve.run(app)            # POST / {"tokens": [...], "max_new_tokens": n}

Two deployments: `KVIngress` (HTTP, parses and validates the JSON) calls `KVModelServer`
(the replicas: a `ModelWorker` each, i.e. the demo Llama model plus a raykv client)
through a `DeploymentHandle`, and that handle routes with a custom Ray Serve request
router (`request_router_config`). Routers:

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
    recently, and the router remembers what it routed itself since the last stats
    update, so the turns of a conversation stick at once. Among replicas with the same
    prefix, the one that served it itself wins (its replica-local state is warm).

  A preferred replica much busier than the least loaded one (`imbalance_threshold`),
  or no match at all, falls back to power-of-two choices on queue length.
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
import os
import random
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

import ray

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


def request_tokens(pending: PendingRequest | None) -> Any:
    """The prompt tokens of a request: a `KVModelServer.generate` call (first arg or
    `tokens=`), or a Ray Serve LLM (`LLMServer`) OpenAI completion request whose `prompt`
    is token ids. None (route by load) for a text prompt: the router has no tokenizer."""
    if pending is None:
        return None
    arg = pending.args[0] if pending.args else pending.kwargs.get("tokens")
    prompt = getattr(arg, "prompt", None)
    if prompt is None:
        return arg
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


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
    ) -> None:
        """Called by Serve with `request_router_kwargs`: the cache's key fields (so the
        router's chunk keys equal the replicas'), its namespace, and the routing knobs."""
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
        # What this router sent each replica since it started (immediate, before stats).
        self._routed: dict[Any, PrefixSummary] = {}
        # Reported summaries as sets, cached by the identity of the reported list.
        self._reported: dict[Any, tuple[int, frozenset[int]]] = {}
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
        """The request's chunk ids and {node: prefix chunks}, computed once per request."""
        tokens = request_tokens(pending)
        if tokens is None:
            return [], {}
        rid = pending.metadata.internal_request_id  # type: ignore[union-attr]
        cached = self._pending.get(rid)
        if cached is None:
            try:
                spans = self._keys.keys(tokens)
            except Exception:  # a malformed request is the replica's to reject, not ours
                spans = []
            ids = [int(span.key.chunk_hash[:16], 16) for span in spans]
            cached = (ids, await self.node_matches([span.key for span in spans]))
            self._pending[rid] = cached
            while len(self._pending) > 1024:
                self._pending.popitem(last=False)
        return cached

    def _summary(self, replica: RunningReplica) -> frozenset[int]:
        reported = (replica.routing_stats or {}).get(STATS_KEY) or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] != id(reported):
            cached = (id(reported), frozenset(reported))
            self._reported[replica.replica_id] = cached
        return cached[1]

    def match(self, replica: RunningReplica, ids: Sequence[int]) -> int:
        """Leading chunks of the request the replica served itself (reported or routed here)."""
        if not self._use_summaries:
            return 0
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
        if state and state[0]:
            self._routed.setdefault(replica_id, PrefixSummary(self._history_size)).add(state[0])

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
        self.node_id = ray.get_runtime_context().get_node_id()
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
        """Generate with raykv; returns tokens, hit_tokens, ttft_s, replica, node and details."""
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
            "node": self.node_id,
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
    use_controller: bool | None = None,
    options: dict[str, Any] | None = None,
) -> RequestRouterConfig:
    """The `request_router_config` of the model deployment for `router`.

    `use_controller` (default: `config.enable_controller`) lets `CacheAwareRouter` ask
    the KVController of `config.namespace`; `options` are further `initialize_state`
    keyword arguments (e.g. ``controller_timeout_s``, ``use_summaries``).
    """
    if router == "pow2":
        return RequestRouterConfig(request_routing_stats_period_s=stats_period_s)
    if router == "random":
        return RequestRouterConfig(request_router_class=RandomRouter)
    if router == "cache_aware":
        known = set(inspect.signature(CacheAwareRouter.initialize_state).parameters) - {"self"}
        unknown = sorted(set(options or {}) - known)
        if unknown:
            raise InvalidInputError(f"unknown router options {unknown}; known: {sorted(known)}")
        return RequestRouterConfig(
            request_router_class=CacheAwareRouter,
            request_router_kwargs={
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
    max_replicas_per_node: int | None = None,
    router_options: dict[str, Any] | None = None,
) -> serve.Application:
    """The Serve application: `KVIngress` over `replicas` x `KVModelServer` routed by `router`.

    `config` holds `RayKVConfig` overrides (defaults < file < env < these); `model`
    holds demo-model overrides (e.g. `TINY_MODEL`). With ``enable_controller: true``
    each replica uses its node's StorageManager and the router asks the KVController
    which node holds a prompt's prefix (not with ``cache_scope="replica"``, where each
    replica has a cache of its own and its summary already says what it holds).
    `max_replicas_per_node=1` spreads the replicas over the nodes of a cluster.
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidInputError(f"replicas must be an int >= 1, got {replicas!r}")
    cfg = RayKVConfig.load(**(config or {}))
    server = serve.deployment(KVModelServer).options(
        name=f"KVModelServer{name_suffix}",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus},
        request_router_config=router_config(
            router,
            cfg,
            stats_period_s=stats_period_s,
            use_controller=cfg.enable_controller and cache_scope == "shared",
            options=router_options,
        ),
        **(
            {}
            if max_replicas_per_node is None
            else {"max_replicas_per_node": max_replicas_per_node}
        ),
    )
    ingress = serve.deployment(KVIngress).options(
        name=f"KVIngress{name_suffix}", ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(
        server.bind(
            config, model, num_threads=num_threads, cache_scope=cache_scope, summary_size=4096
        )
    )


DEMO_ARGS: dict[str, tuple[str, str]] = {  # demo_app argument -> (environment variable, default)
    "model": ("SERVE_DEMO_MODEL", "tiny"),
    "replicas": ("SERVE_DEMO_REPLICAS", "2"),
    "router": ("SERVE_DEMO_ROUTER", "cache_aware"),
    "chunk_size": ("SERVE_DEMO_CHUNK_SIZE", "64"),
    "cache_scope": ("SERVE_DEMO_CACHE_SCOPE", "shared"),
}


def demo_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder for examples/serve_app.py (``import_path: raykv.serve:demo_app``).

    `args` (a Serve config's ``args:``) may set model (tiny|demo), replicas, router,
    chunk_size and cache_scope; what it leaves out comes from the ``SERVE_DEMO_*``
    variables, then the defaults. The cache itself is configured as usual (RAYKV_*
    variables, RAYKV_CONFIG_FILE).
    """
    if not isinstance(args, dict):
        raise InvalidInputError(f"demo_app args must be a mapping, got {type(args).__name__}")
    unknown = sorted(set(args) - set(DEMO_ARGS))
    if unknown:
        raise InvalidInputError(f"unknown demo_app args {unknown}; known: {sorted(DEMO_ARGS)}")
    opts = {
        k: str(args.get(k, os.environ.get(env, default))) for k, (env, default) in DEMO_ARGS.items()
    }
    if opts["model"] not in ("tiny", "demo"):
        raise InvalidInputError(f"model must be 'tiny' or 'demo', got {opts['model']!r}")
    try:
        replicas, chunk_size = int(opts["replicas"]), int(opts["chunk_size"])
    except ValueError as exc:
        raise InvalidInputError(f"replicas and chunk_size must be ints: {exc}") from None
    return build_app(
        replicas=replicas,
        router=opts["router"],  # type: ignore[arg-type]
        config={"chunk_size": chunk_size, "kv_dtype": "float32"},
        model=TINY_MODEL if opts["model"] == "tiny" else {},
        cache_scope=opts["cache_scope"],  # type: ignore[arg-type]
    )


def app_from_env() -> serve.Application:
    """`demo_app` configured by the ``SERVE_DEMO_*`` variables only."""
    return demo_app({})


def demo_client(argv: Sequence[str] | None = None) -> None:
    """``python examples/serve_app.py --query N``: two requests sharing an N-token prefix."""
    import argparse
    import json
    import urllib.request

    parser = argparse.ArgumentParser(description="Query the raykv Serve demo over HTTP.")
    parser.add_argument("--query", type=int, metavar="PREFIX_LEN", default=4096)
    parser.add_argument("--url", default="http://127.0.0.1:8000/")
    args = parser.parse_args(argv)
    vocab = 1024 if os.environ.get("SERVE_DEMO_MODEL", "tiny") == "tiny" else 32000
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(args.query)]
    for turn in range(2):
        body = {"tokens": prefix + [rng.randrange(vocab) for _ in range(16)], "max_new_tokens": 4}
        req = urllib.request.Request(args.url, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        print(
            f"request {turn}: replica={out['replica']} hit_tokens={out['hit_tokens']} "
            f"ttft_s={out['ttft_s']:.4f} tokens={out['tokens']}"
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
    "demo_app",
    "demo_client",
    "chunk_ids",
    "covered_prefix",
    "rank_by_prefix",
    "router_config",
]
