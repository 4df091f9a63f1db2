"""The demo app's HTTP answer says nothing about the cache unless built to: on a cache
that tenants share, hit tokens, tiers, replica, node and server TTFT tell one user
whether another user's prompt is cached."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from raykv.demo.serve_app import CACHE_DETAILS, KVIngress  # noqa: E402

FULL = {
    "tokens": [5, 6],
    "prompt_tokens": 4,
    "hit_tokens": 4096,
    "hit_tiers": {"cpu": 4096},
    "replica": "r1",
    "node": "n1",
    "ttft_s": 0.01,
}


class _Model:
    class generate:  # noqa: N801 - mimics a deployment handle's method
        @staticmethod
        def remote(tokens: list[int], n: int) -> Any:
            async def reply() -> dict[str, Any]:
                return dict(FULL)

            return reply()


class _Request:
    async def json(self) -> dict[str, Any]:
        return {"tokens": [1, 2, 3, 4], "max_new_tokens": 2}


def answer(**kwargs: Any) -> dict[str, Any]:
    return asyncio.run(KVIngress(_Model(), **kwargs)(_Request()))


def test_by_default_an_answer_carries_no_cache_details():
    out = answer()
    assert out == {"tokens": [5, 6], "prompt_tokens": 4}
    assert not set(CACHE_DETAILS) & set(out)


def test_cache_details_come_back_only_when_the_app_asks_for_them():
    assert answer(cache_details=True) == FULL


def _failing(exc: BaseException) -> Any:
    class Model:
        class generate:  # noqa: N801 - mimics a deployment handle's method
            @staticmethod
            def remote(tokens: list[int], n: int) -> Any:
                async def reply() -> dict[str, Any]:
                    raise exc

                return reply()

    return Model()


def test_bad_input_found_in_the_replica_is_a_400_with_its_message_alone():
    """A replica's InvalidInputError reaches the ingress as a RayTaskError whose text
    holds the remote traceback (pid, node address, file paths): the 400 says only the
    cause; another error there is the server's, not a 400."""
    from ray.exceptions import RayTaskError

    from raykv.errors import InvalidInputError

    bad = RayTaskError("generate", "Traceback ... /srv/x.py pid=7", InvalidInputError("too long"))
    reply = asyncio.run(KVIngress(_failing(bad.as_instanceof_cause()))(_Request()))
    assert reply.status_code == 400 and reply.body == b'{"error":"too long"}'
    bug = RayTaskError("generate", "Traceback ...", ValueError("a server bug"))
    with pytest.raises(RayTaskError):
        asyncio.run(KVIngress(_failing(bug.as_instanceof_cause()))(_Request()))


def test_a_demo_worker_runs_one_generate_at_a_time_whoever_calls():
    """A cancelled Serve request releases the replica's asyncio lock while its thread
    still generates: the worker itself must keep the next one waiting (both share the
    connector's staging rows)."""
    import threading
    import time

    from raykv.demo.gpu_worker import ModelWorker

    worker = object.__new__(ModelWorker)
    worker._serial = threading.Lock()
    running, overlaps = [], []

    def generate(tokens: Any, n: int, return_logits: bool = False) -> dict:
        running.append(1)
        overlaps.append(len(running) > 1)
        time.sleep(0.05)
        running.pop()
        return {}

    worker._generate = generate  # type: ignore[method-assign]
    threads = [threading.Thread(target=worker.generate, args=([1], 1)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [False] * 4
