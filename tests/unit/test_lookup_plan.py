"""One lookup plan (`raykv.tiers.lookup`) and one circuit breaker per remote
(`raykv.tiers.breaker`), without Ray."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from raykv_testing import chunk_key

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, make_key
from raykv.payload import PayloadMeta
from raykv.tiers import breaker as br
from raykv.tiers.breaker import Breaker, breaker_for
from raykv.tiers.index import PrefixIndex
from raykv.tiers.lookup import LookupPlan, Need
from raykv.wire import (
    TIER_CPU,
    TIER_DISK,
    TIER_REMOTE,
    ChunkRef,
    CPUAck,
    PeerTier,
    TailCandidates,
)

META = PayloadMeta("float16", (2, 1, 4, 8))
key = functools.partial(chunk_key, dtype="float16")
TIERS = [TIER_CPU, TIER_DISK, TIER_REMOTE]


def index(cpu=(), disk=(), remote=()) -> PrefixIndex:
    ix = PrefixIndex(list(TIERS), lease_secs=10.0)
    ix.reset_cpu("cpu-1", {}, 0)
    ix.apply_cpu(
        CPUAck(
            "cpu-1",
            {k: ChunkRef("o", i, META) for i, k in enumerate(cpu)},
            list(cpu),
            [],
            [],
            seq=1,
        )
    )
    ix.reset_lower(TIER_DISK, "disk-1", list(disk))
    ix.reset_lower(TIER_REMOTE, "remote-1", list(remote))
    return ix


KEYS = [key(i) for i in range(6)]
ENDS = [256 * (i + 1) for i in range(6)]


def test_a_plan_the_index_completes_needs_nothing_and_counts_per_tier() -> None:
    ix = index(cpu=KEYS[:2], disk=KEYS[2:6])
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS, peer=True)
    assert plan.need() is Need.NOTHING and plan.complete
    assert plan.segs == [(TIER_CPU, 0, 2), (TIER_DISK, 2, 6)]
    assert plan.cpu_prefix() == 2 and plan.hit_tokens == ENDS[-1]
    assert plan.sources() == [(TIER_CPU, 512), (TIER_DISK, 1536)]
    assert plan.tier_tokens() == [(TIER_CPU, 512), (TIER_DISK, 1024)]
    assert plan.finish(ix) == (1536, 0)
    assert ix.counts["lookups"] == 1 and ix.counts["hit_tokens"] == 1536


def test_a_short_plan_asks_the_peer_then_the_remote_then_finishes() -> None:
    ix = index(cpu=KEYS[:1])
    ix.enable_peers()  # the manager does so when its controller is on
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS, peer=True)
    assert plan.need() is Need.PEER and plan.missing == KEYS[1:]
    plan.give_peer((PeerTier("m2"), 2))
    assert plan.n == 3 and plan.need() is Need.REMOTE and plan.missing == KEYS[3:]
    held = plan.give_remote([True, True, False])
    assert held == KEYS[3:5] and plan.n == 5 and plan.need() is Need.NOTHING
    assert [(str(t), a, b) for t, a, b in plan.segs] == [
        (TIER_CPU, 0, 1),
        ("peer:m2", 1, 3),
        (TIER_REMOTE, 3, 5),
    ]
    assert plan.hit_tokens == ENDS[4] and plan.finish(ix) == (ENDS[4], ENDS[5] - ENDS[4])


def test_no_answer_is_a_miss_of_that_step_and_the_plan_moves_on() -> None:
    ix = index()
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS, peer=True)
    plan.give_peer(None)  # the controller could not be asked
    assert plan.need() is Need.REMOTE
    assert plan.give_remote(None, failed=True) == [] and plan.remote_failed
    assert plan.need() is Need.NOTHING and plan.n == 0 and plan.hit_tokens == 0


def test_remote_hits_extend_a_remote_run_the_index_knew_and_never_run_past_the_keys() -> None:
    ix = index(remote=KEYS[:2])
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS)
    assert plan.segs == [(TIER_REMOTE, 0, 2)] and plan.need() is Need.REMOTE
    plan.give_remote([True] * 10)  # a malformed, too long answer is clipped
    assert plan.segs == [(TIER_REMOTE, 0, 6)] and plan.complete
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS)
    plan.give_remote([1, True])  # only True counts (not a truthy non-bool)
    assert plan.n == 2


def test_the_remote_is_not_asked_when_down_left_out_or_not_wanted() -> None:
    ix = index()
    assert LookupPlan.start(ix, KEYS, ENDS, [TIER_CPU, TIER_DISK]).need() is Need.NOTHING
    assert LookupPlan.start(ix, KEYS, ENDS, TIERS, remote=False).need() is Need.NOTHING
    ix.mark_down(TIER_REMOTE)
    assert LookupPlan.start(ix, KEYS, ENDS, TIERS).need() is Need.NOTHING


def test_a_peer_answer_longer_than_the_missing_keys_is_clipped() -> None:
    plan = LookupPlan.start(index(cpu=KEYS[:4]), KEYS, ENDS, TIERS, peer=True, remote=False)
    plan.give_peer((PeerTier("m2"), 99))
    assert plan.n == 6 and plan.segs[-1][1:] == (4, 6)


# ----- a partial chunk after the whole ones (`with_tail`, save_unfull_chunk) -----

TAIL_LONG, TAIL_SHORT, TAIL_LATER = key(100), key(101), key(102)


def tails(*candidates: tuple[int, int, CacheKey], world: int = 1) -> TailCandidates:
    """Candidates (start, end, rank 0's key), as a lookup sends them."""
    starts, ends, keys = zip(*candidates, strict=True) if candidates else ((), (), ())
    hashes = [k.chunk_hash for k in keys]
    return TailCandidates("m", world, "float16", list(starts), list(ends), hashes)


# chunk 2's partial chunks longest first, then chunk 3's
TAILS = tails((512, 704, TAIL_LONG), (512, 576, TAIL_SHORT), (768, 800, TAIL_LATER))


def test_the_longest_partial_chunk_held_after_the_whole_chunks_extends_the_plan() -> None:
    ix = index(cpu=[*KEYS[:2], TAIL_SHORT], disk=[TAIL_LONG, TAIL_LATER])
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS, remote=False).with_tail(ix, TAILS, TIERS)
    assert plan.keys == [*KEYS[:2], TAIL_LONG] and plan.ends == [256, 512, 704]
    assert plan.segs == [(TIER_CPU, 0, 2), (TIER_DISK, 2, 3)] and plan.hit_tokens == 704
    assert plan.sources() == [(TIER_CPU, 512), (TIER_DISK, 704)]
    assert plan.finish(ix) == (704, 1536 - 704)  # the whole chunks after it still count
    shorter = index(cpu=[*KEYS[:2], TAIL_SHORT])
    plan = LookupPlan.start(shorter, KEYS, ENDS, TIERS, remote=False)
    assert plan.with_tail(shorter, TAILS, TIERS).hit_tokens == 576


def test_no_partial_chunk_that_starts_elsewhere_or_is_not_held_is_taken() -> None:
    ix = index(cpu=[*KEYS[:3], TAIL_LONG, TAIL_LATER])  # the hit ends at 768, not 512
    plan = LookupPlan.start(ix, KEYS, ENDS, TIERS, remote=False)
    chunk_2 = tails((512, 704, TAIL_LONG), (512, 576, TAIL_SHORT))
    assert plan.with_tail(ix, chunk_2, TIERS) is plan and plan.hit_tokens == 768
    assert plan.with_tail(ix, TAILS, TIERS).hit_tokens == 800
    none = index(cpu=KEYS[:2])
    plan = LookupPlan.start(none, KEYS, ENDS, TIERS, remote=False)
    assert (
        plan.with_tail(none, TAILS, TIERS) is plan and plan.with_tail(none, tails(), TIERS) is plan
    )


def test_a_partial_chunk_of_the_first_chunk_is_found_with_no_whole_chunk() -> None:
    ix = index(cpu=[TAIL_SHORT])
    plan = LookupPlan.start(ix, [], [], TIERS, remote=False)
    assert plan.with_tail(ix, tails((0, 96, TAIL_SHORT)), TIERS).hit_tokens == 96


def test_a_plan_with_a_peer_segment_is_not_extended() -> None:
    ix = index(cpu=[*KEYS[:1], TAIL_SHORT])
    plan = LookupPlan.start(ix, KEYS[:2], ENDS[:2], TIERS, peer=True, remote=False)
    plan.give_peer((PeerTier("m2"), 1))
    assert plan.with_tail(ix, TAILS, TIERS) is plan


def test_with_several_ranks_a_partial_chunk_needs_every_ranks_key() -> None:
    r0, r1 = ([make_key("m", 2, r, f"{i:032x}", "float16") for i in range(16)] for r in (0, 1))
    keys = [r0[0], r1[0], r0[1], r1[1]]  # two chunks, rank 0 then rank 1 (`rank_spans`)
    ends = [0, 256, 256, 512]
    candidates = tails((256, 448, r0[10]), (256, 320, r0[11]), world=2)
    ix = index(cpu=[r0[0], r1[0], r0[1], r0[10], r0[11], r1[11]])  # rank 1 lost chunk 1
    plan = LookupPlan.start(ix, keys, ends, TIERS, remote=False)
    assert plan.n == 3 and plan.hit_tokens == 256
    got = plan.with_tail(ix, candidates, TIERS)  # chunk 1's rank-0 key dropped; 448 lacks rank 1
    assert got.keys == [r0[0], r1[0], r0[11], r1[11]] and got.ends == [0, 256, 256, 320]
    assert got.hit_tokens == 320


@pytest.mark.parametrize("world", [1, 2])
def test_the_manager_and_the_scheduler_agree_on_which_hits_are_read_from_the_files(world):
    """The manager leaves a hit unpromoted (`direct_disk`) exactly when the scheduler,
    from the hit's sources alone, has its workers read the files (`direct_start`), from
    the same token: else a worker would read files the manager promoted (a read twice,
    or a recompute where a rank's chunk is in CPU only) or pins would wait for their
    lease. With several ranks a CPU run's end does not say whether it ended inside a
    chunk: only a hit wholly on disk is read from the files there."""
    from raykv.integrations.vllm_meta import direct_start

    ranks = [
        [make_key("m", world, r, f"{i:032x}", "float16") for i in range(3)] for r in range(world)
    ]
    keys = [ranks[r][i] for i in range(3) for r in range(world)]  # chunk by chunk, rank order
    ends = [256 * (i + 1) if r == world - 1 else 256 * i for i in range(3) for r in range(world)]
    direct = []
    for n in range(len(keys) + 1):  # the first n keys in CPU, the rest only on disk
        plan = LookupPlan.start(index(cpu=keys[:n], disk=keys[n:]), keys, ends, TIERS, remote=False)
        assert plan.hit_tokens == 768
        seg, start = plan.direct_disk(), direct_start(plan.sources(), world)
        assert (seg is None) == (start is None), (n, plan.segs)
        if seg is not None:
            assert start == (ends[seg[1] - 1] if seg[1] else 0)
            direct.append(n)
    assert direct == ([0, 1, 2] if world == 1 else [0])


def test_candidates_travel_as_a_plain_tuple_and_malformed_ones_are_refused() -> None:
    assert TailCandidates.from_wire(TAILS.wire()) == TAILS
    good = TAILS.wire()
    bad_forms = [
        None,
        7,
        good[:5],
        ("m", 0, "float16", *good[3:]),  # no ranks
        (*good[:3], [512], *good[4:]),  # one start for three candidates
        (*good[:3], [512, 600, 768], *good[4:]),  # a start past its end
        (*good[:3], ["0", 512, 768], *good[4:]),
        (*good[:5], ["zz"] * 3),
        ("m", 1 << 40, "float16", *good[3:]),  # a world that size would hang the manager
        (*good[:3], [0] * (1 << 17), [8] * (1 << 17), ["0" * 32] * (1 << 17)),
        # within each bound, not their product: 2^16 candidates x 1024 ranks made the
        # manager build 67M keys (~8.6 GB) for one lookup
        ("m", 1024, "float16", [0] * (1 << 16), [1] * (1 << 16), ["0" * 32] * (1 << 16)),
    ]
    for bad in bad_forms:
        with pytest.raises(InvalidInputError, match="tails"):
            TailCandidates.from_wire(bad)


# ----- the breaker -----


def test_the_breaker_opens_on_a_failure_lets_one_trial_through_and_closes_on_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(br, "BACKOFF_MIN_S", 0.05)
    b = Breaker("redis://x")
    trial = b.admit()
    assert trial is False and b.closed
    assert b.settle(trial, OSError("down")) is True  # opened: the caller logs once
    assert not b.closed and b.admit() is None and b.skipped == 1 and not b.ready()
    time.sleep(0.06)
    assert b.ready()
    trial = b.admit()
    assert trial is True and b.admit() is None  # half-open: one trial at a time
    assert b.settle(trial, TimeoutError()) is False  # still open: logged at debug
    assert b.backoff_s == pytest.approx(0.1)
    time.sleep(0.11)
    trial = b.admit()
    assert trial is True and b.settle(trial) is True and b.closed
    assert b.admit() is False and b.failures == 2


def test_a_cancelled_trial_lets_the_next_call_try() -> None:
    b = Breaker("ray://kv")
    b.settle(b.admit(), OSError())
    b._retry_at = 0.0  # the window is over
    trial = b.admit()
    assert trial is True
    b.cancel(trial)
    assert b.admit() is True


def test_the_back_off_doubles_up_to_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Breaker("r")
    seen = []
    for _ in range(8):
        b._retry_at = 0.0
        b.settle(b.admit(), OSError())
        seen.append(b.backoff_s)
    assert seen[0] == br.BACKOFF_MIN_S and seen[1] == 2 * br.BACKOFF_MIN_S
    assert seen[-1] == br.BACKOFF_MAX_S


def test_one_breaker_per_remote_per_scope_in_a_process() -> None:
    a = breaker_for("redis://h:1/0")
    assert breaker_for("redis://h:1/0") is a
    assert breaker_for("redis://h:2/0") is not a
    assert breaker_for("ray://kv", "ns1") is not breaker_for("ray://kv", "ns2")


def test_the_breaker_admits_one_trial_among_many_threads() -> None:
    b = Breaker("r")
    b.settle(b.admit(), OSError())
    b._retry_at = 0.0
    trials: list[bool | None] = []
    start = threading.Barrier(8)

    def call() -> None:
        start.wait()
        trials.append(b.admit())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert trials.count(True) == 1 and trials.count(None) == 7
