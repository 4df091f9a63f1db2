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
