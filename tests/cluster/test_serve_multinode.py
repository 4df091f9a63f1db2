"""Ray Serve on a 3-node cluster: two replicas of the tiny demo model on two different
nodes, each with its node's StorageManager (``enable_controller: true``), routed by
`CacheAwareRouter` asking the KVController which node holds a prompt's prefix.

The replicas' own prefix summaries are switched off (``use_summaries=False``), so
only the controller can send a request back to the node that holds its 4096-token
prefix: by chance that would happen 1 time in 2 per prefix, and the test checks
several prefixes on both nodes, two requests in flight at a time. The second request
of each prefix must report the whole prefix as a hit from its node's own CPU tier
(not a peer fetch)."""

from __future__ import annotations

import itertools
import json
import random
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("transformers")

from raykv_testing import free_port  # noqa: E402

from raykv.actors.controller import wait_listed  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402
from raykv.config import RayKVConfig  # noqa: E402
from raykv.keys import KeyMaker  # noqa: E402

CHUNK, PREFIX, SUFFIX, VOCAB = 64, 4096, 40, 1024
APP = "raykv-serve-multinode"


@pytest.fixture(scope="module")
def served(cluster) -> Iterator[tuple[str, RayKVConfig]]:
    from ray import serve

    from raykv.demo.serve_app import TINY_MODEL, build_app

    config = {
        "namespace": f"serve-mn-{uuid.uuid4().hex[:8]}",
        "chunk_size": CHUNK,
        "kv_dtype": "float32",
        "max_local_cpu_size": 0.02,
        "enable_controller": True,
    }
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        app = build_app(
            replicas=2,
            router="cache_aware",
            config=config,
            model=TINY_MODEL,
            num_cpus=0.5,
            num_threads=1,
            max_replicas_per_node=1,
            router_options={"use_summaries": False, "controller_timeout_s": 5.0},
            cache_details=True,  # the test reads each answer's hit tokens, replica, node
        )
        serve.run(app, name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}/", RayKVConfig.load(**config)
    finally:
        serve.shutdown()
        shutdown_namespace(config["namespace"])


def _post(url: str, tokens: list[int]) -> dict[str, Any]:
    body = json.dumps({"tokens": tokens, "max_new_tokens": 2}).encode()
    req = urllib.request.Request(url, data=body, method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_second_request_goes_to_the_node_holding_the_4k_prefix(
    served: tuple[str, RayKVConfig],
) -> None:
    url, cfg = served
    rng = random.Random(7)
    firsts: list[tuple[list[int], dict[str, Any]]] = []
    # New prefixes until both replicas served some (first requests go by pow-2).
    while len(firsts) < 24 and (len(firsts) < 4 or len({f["replica"] for _, f in firsts}) < 2):
        prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
        out = _post(url, prefix + [rng.randrange(VOCAB) for _ in range(SUFFIX)])
        assert out["hit_tokens"] == 0
        firsts.append((prefix, out))
    assert len({f["replica"] for _, f in firsts}) == 2, "pow-2 never used the second replica"
    assert len({f["node"] for _, f in firsts}) == 2  # max_replicas_per_node=1
    for prefix, first in firsts:
        keys = [s.key for s in KeyMaker.from_config(cfg).keys(prefix)]
        assert wait_listed(cfg.namespace, keys, first["node"]), "never listed by the controller"
    # Two at a time, alternating replicas where possible: a router that handed one
    # request's choice to another (Serve's FIFO matching) would cross them over.
    by_replica: dict[str, list[tuple[list[int], dict[str, Any]]]] = {}
    for item in firsts:
        by_replica.setdefault(item[1]["replica"], []).append(item)
    order = [x for pair in itertools.zip_longest(*by_replica.values()) for x in pair if x]
    prompts = [p + [rng.randrange(VOCAB) for _ in range(SUFFIX)] for p, _ in order]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda t: _post(url, t), prompts))
    for (_, first), out in zip(order, outs, strict=True):
        assert (out["replica"], out["node"]) == (first["replica"], first["node"])
        assert out["hit_tokens"] == PREFIX
        assert out["hit_tiers"] == {"cpu": PREFIX}  # its node's own CPU tier, no peer fetch
