"""Ray Serve on the session Ray: two replicas of the tiny demo model sharing raykv,
routed by `CacheAwareRouter`, queried over HTTP on 127.0.0.1.

A request whose 4k-token prefix one replica served before goes back to that replica
and reports the prefix as a raykv hit; a fresh router (a new handle, which has not
routed anything) finds the same replica from the replicas' reported routing stats."""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("transformers")

from raykv_testing import free_port  # noqa: E402

from raykv.actors.factory import shutdown_namespace  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

CHUNK, PREFIX, SUFFIX = 64, 4096, 40
APP = "raykv-serve-test"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    from ray import serve

    from raykv.demo.serve_app import TINY_MODEL, build_app

    namespace = f"serve-{uuid.uuid4().hex[:8]}"
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app(
            replicas=2,
            router="cache_aware",
            config={
                "namespace": namespace,
                "chunk_size": CHUNK,
                "kv_dtype": "float32",
                "max_local_cpu_size": 0.05,
            },
            model=TINY_MODEL,
            num_cpus=0.5,
            stats_period_s=0.5,
            cache_details=True,  # these tests read each answer's hit tokens and replica
        )
        serve.run(app, name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}/", namespace
    finally:
        serve.shutdown()
        shutdown_namespace(namespace)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _prompt(rng: random.Random, prefix: list[int]) -> list[int]:
    return prefix + [rng.randrange(1024) for _ in range(SUFFIX)]


def test_same_prefix_goes_to_the_replica_holding_it(served: tuple[str, str]) -> None:
    url, _ = served
    rng = random.Random(0)
    prefixes = [[rng.randrange(1024) for _ in range(PREFIX)] for _ in range(3)]
    first = [_post(url, {"tokens": _prompt(rng, p), "max_new_tokens": 4}) for p in prefixes]
    for out in first:
        assert out["hit_tokens"] == 0 and len(out["tokens"]) == 4 and out["ttft_s"] > 0
    for p, before in zip(prefixes, first, strict=True):
        out = _post(url, {"tokens": _prompt(rng, p), "max_new_tokens": 4})
        assert out["replica"] == before["replica"]
        assert out["hit_tokens"] == PREFIX


def test_a_new_router_uses_the_reported_routing_stats(served: tuple[str, str]) -> None:
    from ray import serve

    url, _ = served
    rng = random.Random(1)
    prefixes = [[rng.randrange(1024) for _ in range(PREFIX)] for _ in range(4)]
    before = [_post(url, {"tokens": _prompt(rng, p), "max_new_tokens": 2}) for p in prefixes]
    time.sleep(3.0)  # stats every 0.5 s, then broadcast to handles
    # This process's handle has routed none of these prefixes: only the replicas'
    # reported summaries can send each one back (by chance: 1 in 16).
    handle = serve.get_deployment_handle("KVModelServer", app_name=APP)
    for p, b in zip(prefixes, before, strict=True):
        out = handle.generate.remote(_prompt(rng, p), 2).result(timeout_s=60)
        assert out["replica"] == b["replica"] and out["hit_tokens"] == PREFIX


def test_bad_requests_get_400(served: tuple[str, str]) -> None:
    url, _ = served
    for body in ({"tokens": []}, {"tokens": [1, "x"]}, {"tokens": [1], "max_new_tokens": 0}):
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(url, body)
        assert err.value.code == 400


def test_oversized_prompts_and_token_ids_get_400_naming_the_problem(
    served: tuple[str, str],
) -> None:
    from raykv.demo.serve_app import MAX_PROMPT_TOKENS

    url, _ = served
    cases = [
        ({"tokens": [1] * (MAX_PROMPT_TOKENS + 1)}, f"at most {MAX_PROMPT_TOKENS}"),
        ({"tokens": [1, 2**31]}, "2**31"),
        ({"tokens": [1, 1024]}, "vocab_size=1024"),  # checked by the replica (tiny model)
    ]
    for body, match in cases:
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(url, body)
        assert err.value.code == 400
        assert match in json.loads(err.value.read())["error"]
