"""The demo Serve app: the demo Llama model behind HTTP, N replicas sharing raykv.

    app = raykv.demo.serve_app.build_app(replicas=2, router="cache_aware")
    serve.run(app)            # POST / {"tokens": [...], "max_new_tokens": n}

Two deployments: `KVIngress` (HTTP, parses and validates the JSON) calls `KVModelServer`
(the replicas: a `ModelWorker` each, i.e. the demo Llama model plus a raykv client)
through a `DeploymentHandle` that routes with `raykv.serve.router_config`. Not the
library: an example of wiring raykv into Serve, used by the tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Sequence
from typing import Any, Literal

import ray
from ray import serve
from ray.exceptions import RayTaskError

from raykv.config import RayKVConfig
from raykv.errors import InvalidInputError
from raykv.serve import (
    DEFAULT_SUMMARY_SIZE,
    STATS_KEY,
    PrefixSummary,
    RouterName,
    chunk_ids,
    router_config,
)

logger = logging.getLogger(__name__)

CacheScope = Literal["shared", "replica"]
MAX_NEW_TOKENS_LIMIT = 1024
# Longest prompt the ingress accepts (a replica also bounds prompt + new tokens by its
# model's context); token ids must fit int32, as raykv keys hash them.
MAX_PROMPT_TOKENS = 32768
MAX_TOKEN_ID = 2**31 - 1

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


def _check_request(
    tokens: Any,
    max_new_tokens: Any,
    *,
    vocab_size: int | None = None,
    context: int | None = None,
) -> tuple[list[int], int]:
    """The request's (tokens, max_new_tokens), or `InvalidInputError` saying what is wrong.

    At most `MAX_PROMPT_TOKENS` tokens, each an int in [0, 2**31) (and < `vocab_size` when
    given); with `context` (the model's), prompt plus new tokens must fit in it.
    """
    if not isinstance(tokens, list) or not tokens:
        raise InvalidInputError('"tokens" must be a non-empty list of ints')
    if len(tokens) > MAX_PROMPT_TOKENS:
        raise InvalidInputError(
            f'"tokens" holds {len(tokens)} tokens; at most {MAX_PROMPT_TOKENS} are accepted'
        )
    bound = MAX_TOKEN_ID + 1 if vocab_size is None else min(vocab_size, MAX_TOKEN_ID + 1)
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < bound:
            what = "vocab_size" if vocab_size is not None and bound == vocab_size else "2**31"
            raise InvalidInputError(
                f'"tokens"[{i}] is {t!r:.40}; token ids must be ints in [0, {what}={bound})'
            )
    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT
    ):
        raise InvalidInputError(f'"max_new_tokens" must be an int in [1, {MAX_NEW_TOKENS_LIMIT}]')
    if context is not None and len(tokens) + max_new_tokens > context:
        raise InvalidInputError(
            f"{len(tokens)} prompt tokens + {max_new_tokens} new tokens exceed the model's "
            f"context of {context} tokens"
        )
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
        from raykv.demo.gpu_worker import ModelWorker

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
        context = getattr(self.worker.model.config, "max_position_embeddings", None)
        tokens, max_new_tokens = _check_request(
            tokens, max_new_tokens, vocab_size=self.vocab_size, context=context
        )
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
            from raykv.actors.factory import shutdown_namespace

            self.worker.kv.close()
            shutdown_namespace(self.config.namespace)

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: a replica-scoped cache (detached
        actors) must not outlive it."""
        try:
            self.shutdown_cache()
        except Exception as exc:  # the cluster may be going away too
            logger.warning("raykv demo: stopping this replica's cache failed: %r", exc)


# What a response says about the cache (and the server's own timing). On a cache shared
# by tenants these fields tell one user whether another user's prompt is cached: only an
# app built with `cache_details=True` (a demo, a benchmark) returns them.
CACHE_DETAILS = ("hit_tokens", "hit_tiers", "replica", "node", "ttft_s")


class KVIngress:
    """HTTP ingress: `POST /` with `{"tokens": [...], "max_new_tokens": n}`; the answer
    is `{"tokens", "prompt_tokens"}`, plus `CACHE_DETAILS` with `cache_details`."""

    def __init__(self, model: Any, cache_details: bool = False) -> None:
        self._model = model
        self._details = cache_details

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise InvalidInputError("the body must be a JSON object")
            tokens, n = _check_request(body.get("tokens"), body.get("max_new_tokens", 16))
            out = await self._model.generate.remote(tokens, n)
            if not self._details:
                out = {k: v for k, v in out.items() if k not in CACHE_DETAILS}
            return out
        except RayTaskError as exc:  # raised in the replica: only bad input is the caller's
            if isinstance(exc.cause, InvalidInputError):
                return JSONResponse({"error": str(exc.cause)}, status_code=400)
            raise  # a server fault: a 500, never its traceback in a 400's body
        except (ValueError, InvalidInputError) as exc:  # bad JSON or bad fields
            return JSONResponse({"error": str(exc)}, status_code=400)


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
    cache_details: bool = False,
) -> serve.Application:
    """The Serve application: `KVIngress` over `replicas` x `KVModelServer` routed by `router`.

    `config` holds `RayKVConfig` overrides (defaults < file < env < these); `model`
    holds demo-model overrides (e.g. `TINY_MODEL`). With ``enable_controller: true``
    each replica uses its node's StorageManager and the router asks the KVController
    which node holds a prompt's prefix (not with ``cache_scope="replica"``, where each
    replica has a cache of its own and its summary already says what it holds).
    `max_replicas_per_node=1` spreads the replicas over the nodes of a cluster.
    `cache_details` adds each request's hit tokens, tiers, replica, node and TTFT to
    the HTTP answer: a side channel on a cache that tenants share, so off by default.
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
        ),
        cache_details,
    )


DEMO_ARGS: dict[str, tuple[str, str]] = {  # demo_app argument -> (environment variable, default)
    "model": ("SERVE_DEMO_MODEL", "tiny"),
    "replicas": ("SERVE_DEMO_REPLICAS", "2"),
    "router": ("SERVE_DEMO_ROUTER", "cache_aware"),
    "chunk_size": ("SERVE_DEMO_CHUNK_SIZE", "64"),
    "cache_scope": ("SERVE_DEMO_CACHE_SCOPE", "shared"),
    "cache_details": ("SERVE_DEMO_CACHE_DETAILS", "false"),
}


def demo_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder for examples/serve_app.py (import_path
    `raykv.demo.serve_app:demo_app`).

    `args` (a Serve config's ``args:``) may set model (tiny|demo), replicas, router,
    chunk_size, cache_scope and cache_details (true|false, see `build_app`); what it
    leaves out comes from the ``SERVE_DEMO_*`` variables, then the defaults. The cache
    itself is configured as usual (RAYKV_* variables, RAYKV_CONFIG_FILE).
    """
    if not isinstance(args, dict):
        raise InvalidInputError(f"demo_app args must be a mapping, got {type(args).__name__}")
    unknown = sorted(set(args) - set(DEMO_ARGS))
    if unknown:
        raise InvalidInputError(f"unknown demo_app args {unknown}; known: {sorted(DEMO_ARGS)}")
    opts = {
        k: str(args.get(k, os.environ.get(env, default))) for k, (env, default) in DEMO_ARGS.items()
    }
    if opts["cache_details"].lower() not in ("true", "false"):
        raise InvalidInputError(
            f"cache_details must be true or false, got {opts['cache_details']!r}"
        )
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
        cache_details=opts["cache_details"].lower() == "true",
    )


def app_from_env() -> serve.Application:
    """`demo_app` configured by the ``SERVE_DEMO_*`` variables only."""
    return demo_app({})


def demo_client(argv: Sequence[str] | None = None) -> None:
    """``python examples/serve_app.py --query N``: two requests sharing an N-token prefix."""
    import argparse
    import json
    import sys
    import urllib.error
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
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # the server's own message, not a traceback
            sys.exit(f"request {turn}: HTTP {exc.code}: {exc.read().decode(errors='replace')}")
        except urllib.error.URLError as exc:
            sys.exit(f"cannot reach {args.url} ({exc.reason}): is `serve run` up?")
        if "hit_tokens" not in out:  # cache details are off: the tokens only
            print(f"request {turn}: tokens={out['tokens']} (cache_details off)")
            continue
        print(
            f"request {turn}: replica={out['replica']} hit_tokens={out['hit_tokens']} "
            f"ttft_s={out['ttft_s']:.4f} tokens={out['tokens']}"
        )


__all__ = [
    "TINY_MODEL",
    "KVIngress",
    "KVModelServer",
    "app_from_env",
    "build_app",
    "demo_app",
    "demo_client",
]
