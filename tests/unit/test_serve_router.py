"""The cache-aware router's choice, without Serve: prefix summaries and replica ranks."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("ray.serve")

from raykv.keys import KeyMaker  # noqa: E402
from raykv.serve import PrefixSummary, chunk_ids, covered_prefix, rank_by_prefix  # noqa: E402

KEYS = KeyMaker(chunk_size=4)


def test_chunk_ids_are_chained_prefix_ids() -> None:
    a = chunk_ids(KEYS, list(range(12)))
    b = chunk_ids(KEYS, list(range(8)) + [99, 98, 97, 96])
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert chunk_ids(KEYS, [1, 2, 3]) == []  # no full chunk


def test_covered_prefix_stops_at_the_first_missing_chunk() -> None:
    ids = chunk_ids(KEYS, list(range(16)))
    assert covered_prefix(ids, {ids[0], ids[1], ids[3]}) == 2
    assert covered_prefix(ids, set()) == 0


def test_summary_is_bounded_lru() -> None:
    s = PrefixSummary(capacity=3)
    s.add([1, 2, 3])
    s.add([1])  # touch 1: 2 is now the oldest
    s.add([4])
    assert s.snapshot() == [3, 1, 4] and len(s) == 3
    assert s.covered([3, 1, 9]) == 2


def _summaries(tokens_by_replica: dict[str, list[list[int]]]) -> dict[str, PrefixSummary]:
    out = {}
    for rid, prompts in tokens_by_replica.items():
        out[rid] = PrefixSummary()
        for p in prompts:
            out[rid].add(chunk_ids(KEYS, p))
    return out


def test_longest_prefix_replica_ranks_first() -> None:
    shared = list(range(8))
    summaries = _summaries(
        {"r0": [shared + [50, 51, 52, 53]], "r1": [shared], "r2": [[7, 7, 7, 7]]}
    )
    request = chunk_ids(KEYS, shared + [50, 51, 52, 53, 60, 61, 62, 63])
    matches = {r: s.covered(request) for r, s in summaries.items()}
    assert matches == {"r0": 3, "r1": 2, "r2": 0}
    ranks = rank_by_prefix(request, ["r0", "r1", "r2"], matches, {}, rng=random.Random(0))
    assert ranks[0] == ["r0"]
    assert sorted(sum(ranks[1:], [])) == ["r1", "r2"]  # every replica stays reachable


def test_a_short_shared_prefix_alone_does_not_bind() -> None:
    # 2 of 5 chunks (a system prompt) is below the default ratio 0.5: plain pow-2.
    ranks = rank_by_prefix([1, 2, 3, 4, 5], ["a", "b"], {"a": 2}, {}, rng=random.Random(0))
    assert sorted(ranks[0]) == ["a", "b"]
    assert rank_by_prefix([1, 2, 3, 4, 5], ["a", "b"], {"a": 3}, {})[0] == ["a"]


def test_ties_share_the_first_rank() -> None:
    ranks = rank_by_prefix([1, 2], ["a", "b", "c"], {"a": 2, "b": 2}, {})
    assert sorted(ranks[0]) == ["a", "b"] and ranks[1] == ["c"]


def test_no_match_falls_back_to_power_of_two() -> None:
    ranks = rank_by_prefix([1, 2], ["a", "b", "c", "d"], {}, {}, rng=random.Random(1))
    assert len(ranks[0]) == 2 and len(ranks[1]) == 2
    assert sorted(ranks[0] + ranks[1]) == ["a", "b", "c", "d"]
    assert rank_by_prefix([], ["a"], {}, {}) == [["a"]]
    assert rank_by_prefix([1], [], {}, {}) == []


def test_overloaded_holder_is_skipped() -> None:
    matches = {"a": 5, "b": 0}
    busy = {"a": 10, "b": 1}
    ranks = rank_by_prefix([1] * 5, ["a", "b"], matches, busy, imbalance_threshold=4)
    assert sorted(ranks[0]) == ["a", "b"]  # plain pow-2 over both: Serve takes the shorter queue
    ok = rank_by_prefix([1] * 5, ["a", "b"], matches, {"a": 3, "b": 1}, imbalance_threshold=4)
    assert ok[0] == ["a"]
    unknown = rank_by_prefix([1] * 5, ["a", "b"], matches, {"a": None}, imbalance_threshold=0)
    assert unknown[0] == ["a"]


def test_tiebreak_keeps_the_best_among_equal_matches() -> None:
    matches = {"a": 4, "b": 4, "c": 1}
    ranks = rank_by_prefix([1] * 4, ["a", "b", "c"], matches, {}, tiebreak={"b": 2, "a": 1})
    assert ranks[0] == ["b"]
    # The tiebreak never promotes a shorter match, and load still filters first.
    busy = {"b": 9, "a": 0, "c": 0}
    ranks = rank_by_prefix([1] * 4, ["a", "b", "c"], matches, busy, tiebreak={"b": 4, "c": 9})
    assert ranks[0] == ["a"]


def test_request_tokens_reads_demo_calls_and_serve_llm_completion_requests() -> None:
    from types import SimpleNamespace

    from raykv.serve import request_tokens

    def pending(*args, **kwargs):
        return SimpleNamespace(args=args, kwargs=kwargs)

    assert request_tokens(pending([1, 2, 3], 4)) == [1, 2, 3]  # KVModelServer.generate
    assert request_tokens(pending(tokens=[5, 6])) == [5, 6]
    # Ray Serve LLM hands LLMServer an OpenAI completion request: its token-id prompt.
    assert request_tokens(pending(SimpleNamespace(prompt=[7, 8, 9], model="m"))) == [7, 8, 9]
    # A text prompt (no tokenizer here) or a batch of prompts routes by load alone.
    assert request_tokens(pending(SimpleNamespace(prompt="hello"))) is None
    assert request_tokens(pending(SimpleNamespace(prompt=[[1, 2], [3]]))) is None
    assert request_tokens(None) is None


def test_a_router_with_the_models_tokenizer_routes_text_prompts_by_their_tokens(tmp_path) -> None:
    from types import SimpleNamespace

    from raykv.demo.model import save_word_tokenizer, word_text
    from raykv.errors import ConfigError
    from raykv.serve import load_tokenizer, request_tokens

    save_word_tokenizer(tmp_path, 64)
    tokenizer = load_tokenizer(str(tmp_path))
    text = SimpleNamespace(args=(SimpleNamespace(prompt=word_text([3, 9, 27])),), kwargs={})
    assert request_tokens(text, tokenizer) == [3, 9, 27]  # as vLLM's endpoint encodes it
    assert request_tokens(text) is None  # without it: by load
    with pytest.raises(ConfigError, match="no-such-tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_a_router_whose_tokenizer_cannot_load_routes_by_load_and_says_so(tmp_path, caplog) -> None:
    """Inside Serve a router's set-up must not raise (Serve would never mark it ready and
    every request would wait): the error is logged and text prompts route by load."""
    from raykv.serve import router_tokenizer

    assert router_tokenizer(str(tmp_path / "no-such-tokenizer")) is None
    assert "no-such-tokenizer" in caplog.text and "routed by load" in caplog.text
    assert router_tokenizer(None) is None


def test_a_cache_aware_router_forgets_replicas_serve_no_longer_lists(monkeypatch) -> None:
    """Scaled down, redeployed or replaced replicas leave through `update_replicas` (Serve
    calls `on_replica_actor_died` only for a death it saw): their routed and reported
    summaries go, and a request routed to a replica already gone adds none back."""
    from types import SimpleNamespace

    from raykv import serve

    monkeypatch.setattr(serve.RequestRouter, "update_replicas", lambda self, replicas: None)
    router = object.__new__(serve.CacheAwareRouter)
    router._routed = {"a": PrefixSummary(8), "b": PrefixSummary(8)}
    router._routed_before = {"b": PrefixSummary(8)}
    router._reported = {"a": (1, frozenset()), "b": (2, frozenset())}
    router._pending, router._history_size = {}, 8
    router.update_replicas([SimpleNamespace(replica_id="a")])
    assert list(router._routed) == ["a"] and list(router._reported) == ["a"]
    assert router._routed_before == {}
    monkeypatch.setattr(serve.CacheAwareRouter, "curr_replicas", {"a": object()})
    request = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="r1"))
    router._pending = {"r1": ([11, 12], {})}
    router.on_request_routed(request, "b", None)
    assert "b" not in router._routed


def test_an_events_router_given_array_tokens_routes_them_and_never_raises(monkeypatch) -> None:
    """A handle call whose tokens are a numpy array: `tokens or []` raised (an array has no
    truth value), and the request was dropped by Serve's routing loop."""
    from collections import OrderedDict
    from types import SimpleNamespace

    import numpy as np

    from raykv import serve

    monkeypatch.setattr(serve.EventsRouter, "curr_replicas", {"a": object()})
    router = object.__new__(serve.EventsRouter)
    router._tokens, router._tokenizer = OrderedDict(), None
    router.index = SimpleNamespace(request_ids=lambda tokens: [len(tokens)])
    pending = SimpleNamespace(
        args=(np.arange(64),), kwargs={}, metadata=SimpleNamespace(internal_request_id="r")
    )
    assert router._request_ids(pending) == [64]
    router._routed = {}
    router.on_request_routed(pending, "a", None)  # its blocks count for their replica
    assert "a" in router._routed
    router.index = SimpleNamespace(request_ids=lambda tokens: 1 / 0)
    router._tokens.clear()
    assert router._request_ids(pending) == []


def test_what_a_router_routed_counts_for_two_stats_periods_then_the_stats_decide() -> None:
    """A router credits a replica with what it routed there (its stats do not list it
    yet) until the replica's reported list has changed twice; then only the replica's
    own stats say what it holds. New stats objects with the same list (Serve sends every
    replica's whenever one reports) age nothing; a replica that reports none keeps it."""
    from types import SimpleNamespace

    from raykv import serve

    router = object.__new__(serve.CacheAwareRouter)
    router._use_summaries, router._history_size = True, 8
    router._routed, router._routed_before, router._reported = {}, {}, {}
    ids = [1, 2, 3]
    replica = SimpleNamespace(replica_id="a", routing_stats={serve.STATS_KEY: [9]})
    silent = SimpleNamespace(replica_id="b", routing_stats=None)
    for r in (replica, silent):
        router.match(r, ids)
        router._routed[r.replica_id] = PrefixSummary(8)
        router._routed[r.replica_id].add(ids)
    assert router.match(replica, ids) == 3 and router.match(silent, ids) == 3
    for _ in range(5):  # Serve hands out new stats objects whenever any replica reports
        replica.routing_stats = {serve.STATS_KEY: [9]}
        assert router.match(replica, ids) == 3
    replica.routing_stats = {serve.STATS_KEY: [9, 10]}  # its list changed: still credited
    assert router.match(replica, ids) == 3
    replica.routing_stats = {serve.STATS_KEY: [1]}  # and changed again: its stats decide
    assert router.match(replica, ids) == 1
    assert router.match(silent, ids) == 3


def test_a_text_prompt_is_encoded_once_however_often_serve_asks() -> None:
    """Serve calls choose_replicas again while every replica is full: the router's work
    per request (encoding its text, asking the controller) is done once."""
    import asyncio
    from collections import OrderedDict
    from types import SimpleNamespace

    from raykv import serve

    encoded = []

    def tokenizer(text: str) -> dict:
        encoded.append(text)
        return {"input_ids": list(range(64))}

    router = object.__new__(serve.CacheAwareRouter)
    router._tokenizer, router._pending, router._namespace = tokenizer, OrderedDict(), None
    router._keys = KeyMaker(chunk_size=16)
    pending = SimpleNamespace(
        args=(SimpleNamespace(prompt="hello"),),
        kwargs={},
        metadata=SimpleNamespace(internal_request_id="r1"),
    )

    async def ask_three_times() -> list:
        return [await router._request_state(pending) for _ in range(3)]

    states = asyncio.run(ask_three_times())
    assert encoded == ["hello"] and len(states[0][0]) == 4 and states[0] == states[2]


def test_an_events_router_forgets_what_it_routed_to_replicas_gone_or_never_listed(
    monkeypatch,
) -> None:
    """Replicas that never advertise events (plain LLMServer) left their routed blocks
    behind for good, one set per replica id ever seen."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from raykv import serve

    monkeypatch.setattr(serve.RequestRouter, "update_replicas", lambda self, replicas: None)
    router = object.__new__(serve.EventsRouter)
    router._tokens, router._tokenizer = OrderedDict(), None
    router.index = SimpleNamespace(request_ids=lambda tokens: [len(tokens)], forget=lambda r: 0)
    router._endpoints, router._subscriber = {}, None
    router._routed = {"a": serve.RecentBlocks(), "b": serve.RecentBlocks()}
    router.update_replicas([SimpleNamespace(replica_id="a", routing_stats=None)])
    assert list(router._routed) == ["a"]
    monkeypatch.setattr(serve.EventsRouter, "curr_replicas", {"a": object()})
    router._tokens["r"] = list(range(8))
    pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="r"))
    router.on_request_routed(pending, "gone", None)
    assert "gone" not in router._routed and "r" not in router._tokens


@pytest.mark.parametrize(
    "reported, held",
    [
        ("array", {0, 1, 2, 3, 4}),  # uint64 ids: `or` on an array raised
        ([[1, 2], [3]], set()),  # unhashable items: ignored, never raised
        (None, set()),
    ],
)
def test_a_replicas_reported_prefix_ids_in_any_form_never_raise(reported, held) -> None:
    """A raise in choose_replicas ends Serve's routing task with the request taken off
    its queue: the request would hang."""
    from types import SimpleNamespace

    import numpy as np

    from raykv import serve

    if reported == "array":
        reported = np.arange(5, dtype=np.uint64)
    router = object.__new__(serve.CacheAwareRouter)
    router._use_summaries, router._history_size = True, 8
    router._routed, router._routed_before, router._reported = {}, {}, {}
    replica = SimpleNamespace(replica_id="a", routing_stats={serve.STATS_KEY: reported})
    assert router.match(replica, [0, 1, 2]) == (3 if held else 0)
    assert router._summary(replica) == held


@pytest.mark.parametrize(
    "router, options",
    [
        ("cache_aware", {"history_size": 0}),
        ("cache_aware", {"min_match_ratio": 1.5}),
        ("cache_aware", {"controller_timeout_s": 0}),
        ("cache_aware", {"chunk_size": "256"}),
        ("events", {"max_blocks": 0}),
        ("events", {"imbalance_threshold": -1}),
        ("events", {"min_match_blocks": True}),
    ],
)
def test_router_options_out_of_bounds_fail_at_deployment(router, options) -> None:
    """Such a value raised in the router itself: in `initialize_state` (every request
    then waits for a router that never starts) or on each routed request."""
    from raykv import RayKVConfig, serve
    from raykv.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=next(iter(options))):
        serve.router_config(router, RayKVConfig(), options=options)
    with pytest.raises(InvalidInputError, match="stats_period_s"):
        serve.router_config("pow2", RayKVConfig(), stats_period_s=0)
    serve.router_config(router, RayKVConfig(), options={"min_match_ratio": 0.25})


def test_a_routers_tokenizer_loads_off_serves_router_loop(monkeypatch) -> None:
    """`initialize_state` runs on Serve's router loop: a tokenizer download held every
    deployment's routing in that process. Meanwhile text prompts route by load."""
    import time
    from types import SimpleNamespace

    from raykv import serve

    class SlowLoading(serve.TokenizerLoading):
        def _load(self, name_or_path: str) -> None:  # the Hub download, 1 s
            time.sleep(1.0)
            self._tokenizer = lambda text: {"input_ids": [len(text)]}
            self.ready.set()

    monkeypatch.setattr(serve, "TokenizerLoading", SlowLoading)
    router = object.__new__(serve.EventsRouter)
    t0 = time.monotonic()
    router.initialize_state(tokenizer="/no-such-dir/tokenizer")
    assert time.monotonic() - t0 < 0.5
    loading = router._tokenizer
    text = SimpleNamespace(args=(SimpleNamespace(prompt="hello"),), kwargs={})
    assert serve.request_tokens(text, loading) is None  # by load meanwhile
    assert loading.ready.wait(60)
    if isinstance(loading, SlowLoading):  # (in the full suite the patch may not reach it)
        assert serve.request_tokens(text, loading) == [5]
