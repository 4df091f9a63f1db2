"""The manager's prefix index (`raykv.tiers.index.PrefixIndex`), without Ray."""

from __future__ import annotations

import functools

import msgpack
import pytest
from raykv_testing import chunk_key

from raykv.errors import InvalidInputError
from raykv.keys import CacheKey, ChunkSpan, leading
from raykv.payload import PayloadMeta
from raykv.tiers.index import PrefixIndex
from raykv.wire import (
    TIER_CPU,
    TIER_DISK,
    TIER_REMOTE,
    ChunkRef,
    CPUAck,
    PackedSpans,
    PutAck,
    split_spans,
)

META = PayloadMeta("float16", (2, 1, 4, 8))


key = functools.partial(chunk_key, dtype="float16")


def ref(i: int) -> ChunkRef:
    return ChunkRef(f"obj{i}", 0, META)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def index(tiers=(TIER_CPU, TIER_DISK, TIER_REMOTE), **kw) -> PrefixIndex:
    ix = PrefixIndex(list(tiers), lease_secs=kw.pop("lease_secs", 10.0), **kw)
    if TIER_CPU in tiers:
        ix.reset_cpu("cpu-1", {}, 0)
    for t in tiers:
        if t != TIER_CPU:
            ix.reset_lower(t, f"{t}-1", [])
    return ix


def ack(keys, seq: int, evicted=(), inc: str = "cpu-1") -> CPUAck:
    return CPUAck(
        inc, {k: ref(i) for i, k in enumerate(keys)}, list(keys), [], list(evicted), seq=seq
    )


def test_leading_counts_the_run_a_container_or_predicate_accepts():
    assert leading([1, 2, 3, 9, 4], 0, {1, 2, 3, 4}) == 3
    assert leading([1, 2, 3], 1, lambda k: k > 1) == 3
    assert leading([], 0, set()) == 0


def test_plan_walks_tiers_in_order_and_a_miss_ends_the_prefix():
    ix = index()
    keys = [key(i) for i in range(6)]
    ix.apply_cpu(ack(keys[:2], 1))
    ix.apply_lower(TIER_DISK, PutAck(accepted=keys[2:4], incarnation="disk-1"))
    ix.found_remote([keys[5]])
    segs, n = ix.plan(keys, ix.order)
    assert segs == [(TIER_CPU, 0, 2), (TIER_DISK, 2, 4)] and n == 4


def test_spans_and_packed_spans_split_alike_and_junk_is_a_clear_error():
    spans = [ChunkSpan(i * 4, i * 4 + 4, key(i)) for i in range(3)]
    assert split_spans(spans) == split_spans(PackedSpans.of(spans))
    with pytest.raises(InvalidInputError, match="ChunkSpan"):
        split_spans([1, 2])


def test_packed_keys_round_trip_through_pickle_and_mixed_identities_stay_a_list():
    import pickle

    from raykv.keys import CacheKey
    from raykv.wire import PackedKeys, unpack_keys

    keys = [key(i) for i in range(5)]
    packed = PackedKeys.of(keys)
    assert isinstance(packed, PackedKeys) and len(packed) == 5
    assert unpack_keys(pickle.loads(pickle.dumps(packed))) == keys
    other = CacheKey("another-model", 1, 0, keys[0].chunk_hash, keys[0].kv_dtype)
    assert PackedKeys.of([*keys, other]) == [*keys, other]  # not packable: kept as is
    assert unpack_keys(PackedKeys.of([])) == [] and unpack_keys(keys) == keys
    spans = [ChunkSpan(i * 4, i * 4 + 4, k) for i, k in enumerate(keys)]
    assert unpack_keys(PackedSpans.of(spans)) == keys  # packed spans are packed keys
    assert unpack_keys(packed.wire()) == keys  # the msgpack bytes a remote probe sends
    for bad in (b"\xc1", msgpack.packb(["raykv.keys/1", ["m", 1], []]), msgpack.packb(1)):
        with pytest.raises(InvalidInputError, match="malformed keys wire form"):
            unpack_keys(bad)


def test_retrieve_result_wire_holds_each_batch_ref_and_meta_once_and_round_trips():
    import pickle

    from raykv.wire import RESULT_WIRE, RetrieveResult

    full, tail = PayloadMeta("float16", (2, 1, 4, 8)), PayloadMeta("float16", (2, 1, 2, 8))
    chunks = [ChunkRef("batch-a", i, PayloadMeta("float16", (2, 1, 4, 8))) for i in range(3)]
    chunks += [ChunkRef("batch-b", 0, full), ChunkRef("batch-b", 1, tail)]
    result = RetrieveResult(chunks, 18, [TIER_CPU] * 3 + [TIER_DISK] * 2)
    wire = result.wire()
    tag, refs, which, index, metas, meta_of, hit_tokens, tiers = wire
    assert tag == RESULT_WIRE and refs == ["batch-a", "batch-b"] and which == [0, 0, 0, 1, 1]
    assert metas == [("float16", (2, 1, 4, 8), "KV_2LTD"), ("float16", (2, 1, 2, 8), "KV_2LTD")]
    assert meta_of == [0, 0, 0, 0, 1] and index == [0, 1, 2, 0, 1] and hit_tokens == 18
    for again in (RetrieveResult.of(wire), pickle.loads(pickle.dumps(result))):
        assert again == result and again.hit_chunks == 5 and again.tiers == result.tiers
    assert RetrieveResult.of(result) is result
    assert RetrieveResult.of(RetrieveResult().wire()) == RetrieveResult()
    with pytest.raises(ValueError, match="not a RetrieveResult"):
        RetrieveResult.of(("other", [], [], [], [], [], 0, []))


def test_retrieve_result_by_ids_is_msgpack_bytes_naming_each_batch_by_object_id():
    # The ids form holds no ref: plain bytes (Ray sends them without pickling the reply).
    from raykv.wire import RetrieveResult

    class Ref:
        def __init__(self, oid: bytes) -> None:
            self.oid = oid

        def binary(self) -> bytes:
            return self.oid

    a, b = Ref(b"\x01" * 28), Ref(b"\x02" * 28)
    meta = PayloadMeta("float16", (2, 1, 4, 8))
    chunks = [ChunkRef(a, 0, meta), ChunkRef(a, 1, meta), ChunkRef(b, 0, meta)]
    wire = RetrieveResult(chunks, 12, [TIER_CPU] * 3).wire(ids=True)
    assert isinstance(wire, bytes)
    again = RetrieveResult.of(wire)
    assert [(c.ref, c.index, c.meta) for c in again.chunks] == [
        (a.oid, 0, meta),
        (a.oid, 1, meta),
        (b.oid, 0, meta),
    ]
    assert again.hit_tokens == 12 and again.tiers == [TIER_CPU] * 3
    with pytest.raises(ValueError, match="malformed retrieve result"):
        RetrieveResult.of(b"\xc1")


def test_spans_wire_tuple_splits_like_the_spans_and_a_malformed_one_is_a_clear_error():
    from raykv.wire import SPANS_WIRE, as_keys

    spans = [ChunkSpan(i * 4, i * 4 + 4, key(i)) for i in range(3)]
    wire = PackedSpans.of(spans).wire()
    assert isinstance(wire, bytes) and split_spans(wire) == split_spans(spans)
    assert as_keys(wire) == [s.key for s in spans]
    inner = (SPANS_WIRE, spans[0].key.identity, [s.key.chunk_hash for s in spans], [4, 8, 12])
    assert split_spans(inner) == split_spans(spans)  # the tuple inside the bytes
    assert split_spans(list(inner)) == split_spans(spans)  # a list after a msgpack hop
    with pytest.raises(InvalidInputError, match="malformed spans wire form"):
        split_spans((SPANS_WIRE, ("m", 1, 0), ["a"], [4]))
    with pytest.raises(InvalidInputError, match="malformed spans wire form"):
        split_spans((SPANS_WIRE, ("m", 1, 0, "float16"), ["a", "b"], [4]))
    with pytest.raises(InvalidInputError, match="malformed spans wire form"):
        split_spans(b"\xc1 not msgpack")
    with pytest.raises(InvalidInputError, match="expected a list of ChunkSpan"):
        split_spans(msgpack.packb(["something", "else"]))


def test_cpu_ack_of_another_incarnation_drops_the_cpu_index():
    ix = index()
    ix.apply_cpu(ack([key(0)], 1))
    assert not ix.apply_cpu(ack([key(1)], 1, inc="cpu-2"))
    assert ix.cpu == {}


def test_cpu_ack_older_than_the_snapshot_is_ignored():
    # The snapshot at seq 5 already reflects ack 4; applying it again would re-add a
    # chunk evicted since (the manager would keep its batch alive beyond the budget).
    ix = index()
    ix.reset_cpu("cpu-1", {key(1): ref(1)}, 5)
    assert not ix.apply_cpu(ack([key(0)], 4))
    assert key(0) not in ix.cpu and ix.counts["stale_acks"] == 1
    assert ix.apply_cpu(ack([key(2)], 6))


def test_a_lost_cpu_ack_is_reported_as_lagging_on_the_next_check():
    # Defect 2: a pull that timed out on the manager's side never had its ack (with the
    # keys the CPU store evicted for it) applied; the index noticed nothing.
    ix = index()
    ix.apply_cpu(ack([key(0)], 1))
    # ack 2 is lost; ack 3 arrives
    ix.apply_cpu(ack([key(3)], 3))
    assert ix.cpu_lagging("cpu-1", 3) is False  # first sight: ack 2 may be in flight
    assert ix.cpu_lagging("cpu-1", 3) is True  # still missing a check later: resync
    ix.reset_cpu("cpu-1", {}, 3)
    assert ix.cpu_lagging("cpu-1", 3) is False
    assert ix.cpu_lagging("cpu-1", 3) is False


def test_acks_in_flight_at_a_check_are_not_lagging_once_they_arrive():
    ix = index()
    assert ix.cpu_lagging("cpu-1", 2) is False  # acks 1, 2 sent, not yet here
    ix.apply_cpu(ack([key(1)], 2))
    ix.apply_cpu(ack([key(0)], 1))  # out of order is fine
    assert ix.cpu_lagging("cpu-1", 4) is False  # 3, 4 are new since the last check
    ix.apply_cpu(ack([key(2)], 3))
    ix.apply_cpu(ack([key(3)], 4))
    assert ix.cpu_lagging("cpu-1", 4) is False


def test_an_older_cpu_ack_applied_late_does_not_undo_a_newer_ones_changes():
    """Replies of concurrent CPU calls arrive in any order: a key a newer reply evicted
    (or admitted) keeps that state; else the index lists a chunk the store dropped, and
    its reference keeps the object alive outside the tier's budget."""
    ix = index()
    ix.apply_cpu(ack([key(0), key(1)], 1))
    ix.apply_cpu(ack([key(2)], 3, evicted=[key(0)]))  # ack 3 evicted key 0
    ix.apply_cpu(ack([key(0), key(1)], 2))  # ack 2 named key 0 present: too late
    assert key(0) not in ix.cpu and key(1) in ix.cpu and key(2) in ix.cpu
    ix.apply_cpu(ack([key(5)], 5))  # ack 5 re-admitted key 5 ...
    ix.apply_cpu(ack([key(6)], 4, evicted=[key(5)]))  # ... after ack 4 evicted it
    assert key(5) in ix.cpu and key(6) in ix.cpu
    assert ix.cpu_lagging("cpu-1", 5) is False and ix.cpu_lagging("cpu-1", 5) is False


def test_a_key_a_newer_ack_names_without_a_ref_still_takes_an_older_eviction():
    """A put leaves keys another put is writing to it: its ack names them present, with
    no ref. That sets nothing here, so an older ack's eviction of such a key applies."""
    ix = index()
    ix.apply_cpu(ack([key(0)], 1))
    newer = CPUAck("cpu-1", {}, [], [key(0)], [], seq=3)  # present, no ref
    ix.apply_cpu(newer)
    ix.apply_cpu(ack([], 2, evicted=[key(0)]))
    assert key(0) not in ix.cpu


def test_after_a_drop_any_snapshot_rebuilds_the_cpu_index():
    """An ack of another incarnation drops the index; acks newer than the resync's
    snapshot often arrive before it: it must still be applied, not taken for stale."""
    ix = index()
    for seq in (1, 2, 3):
        ix.apply_cpu(ack([key(seq)], seq))
    ix.drop(TIER_CPU)
    ix.reset_cpu("cpu-1", {key(1): ref(1), key(2): ref(2)}, 2)
    assert key(1) in ix.cpu and key(2) in ix.cpu


def test_a_snapshot_older_than_the_applied_acks_changes_nothing():
    """Two resyncs overlapped: the older snapshot, applied last, moved the index back."""
    ix = index()
    for seq in (1, 2, 3):
        ix.apply_cpu(ack([key(seq)], seq))
    ix.reset_cpu("cpu-1", {key(1): ref(1)}, 1)  # taken at ack 1, arriving late
    assert all(key(s) in ix.cpu for s in (1, 2, 3))
    assert ix.cpu_lagging("cpu-1", 3) is False and ix.cpu_lagging("cpu-1", 3) is False


def test_a_resync_keeps_the_acks_applied_while_its_snapshot_was_awaited():
    ix = index()
    ix.apply_cpu(ack([key(0)], 1))
    ix.begin_cpu_resync()
    ix.apply_cpu(ack([key(3)], 3, evicted=[key(0)]))  # newer than the snapshot below
    ix.reset_cpu("cpu-1", {key(0): ref(0)}, 2)  # taken at ack 2, before ack 3
    ix.end_cpu_resync()
    assert key(0) not in ix.cpu and key(3) in ix.cpu
    assert ix.cpu_lagging("cpu-1", 3) is False and ix.cpu_lagging("cpu-1", 3) is False
    ix.apply_cpu(ack([key(4)], 4))
    assert key(4) in ix.cpu and ix._cpu_log is None


def test_another_cpu_incarnation_is_lagging_at_once():
    ix = index()
    assert ix.cpu_lagging("cpu-2", 0) is True


def test_a_tier_marked_down_serves_nothing_until_resynced():
    # Defect 5: a dead CPU store's chunks must not be planned; disk keeps serving.
    ix = index()
    keys = [key(i) for i in range(4)]
    ix.apply_cpu(ack(keys[:2], 1))
    ix.apply_lower(TIER_DISK, PutAck(accepted=keys, incarnation="disk-1"))
    ix.mark_down(TIER_CPU)
    assert not ix.up(TIER_CPU)
    assert ix.plan(keys, ix.order) == ([(TIER_DISK, 0, 4)], 4)
    ix.reset_cpu("cpu-2", {}, 0)
    assert ix.up(TIER_CPU) and ix.incarnations[TIER_CPU] == "cpu-2"


def test_a_lower_put_ack_from_a_past_incarnation_is_ignored():
    # Defect 11: a disk put acked by the tier before it restarted (its pending writes
    # lost) must not re-add keys after the index was rebuilt from the new tier.
    ix = index()
    ix.reset_lower(TIER_DISK, "disk-2", [key(9)])
    assert not ix.apply_lower(TIER_DISK, PutAck(accepted=[key(0)], incarnation="disk-1"))
    assert key(0) not in ix.lower[TIER_DISK]
    assert ix.apply_lower(TIER_DISK, PutAck(accepted=[key(1)], incarnation="disk-2"))
    assert key(1) in ix.lower[TIER_DISK]


def test_pull_misses_correct_stale_positives():
    ix = index()
    ix.apply_lower(TIER_DISK, PutAck(accepted=[key(0), key(1)], incarnation="disk-1"))
    pull = CPUAck("cpu-1", {key(0): ref(0)}, missing=[key(1)])
    ix.apply_pull(TIER_DISK, pull)
    assert key(1) not in ix.lower[TIER_DISK] and ix.counts["stale_positives"] == 1


def test_remote_index_is_bounded():
    ix = index(remote_index_max_keys=3)
    ix.found_remote([key(i) for i in range(5)])
    assert len(ix.lower[TIER_REMOTE]) == 3 and key(0) not in ix.lower[TIER_REMOTE]


def test_the_remote_index_gives_back_the_keys_it_was_given():
    ix = index(remote_index_max_keys=10)
    odd = CacheKey("m", 1, 0, "not-hex", "float16")  # kept as it is
    other = CacheKey("n%40x", 2, 1, "ab" * 16, "bfloat16")
    keys = [key(1), key(2), other, odd]
    ix.found_remote(keys)
    remote = ix.lower[TIER_REMOTE]
    assert list(remote) == keys and all(type(k) is CacheKey for k in remote)
    assert key(3) not in remote and CacheKey("zz", 1, 0, "00" * 16, "float16") not in remote
    assert remote.intersection([key(2), key(3), odd]) == {key(2), odd}
    remote.difference_update([key(1), odd, key(9)])
    assert list(remote) == [key(2), other]
    ix.found_remote([key(2)])  # re-confirmed: now the newest
    assert list(remote)[-1] == key(2)


def test_the_remote_index_holds_a_million_keys_in_well_under_the_memory_of_the_keys():
    import os
    import pickle
    import tracemalloc

    ident = ("Qwen/Qwen2.5-0.5B-Instruct#" + "layout-fingerprint" * 6, 1, 0, "float32")
    # keys as they arrive in acks: unpickled in small batches, each with fresh strings
    batches = [
        pickle.dumps(CacheKey.many(ident, [os.urandom(16).hex() for _ in range(2)]))
        for _ in range(10_000)
    ]
    ix = index(remote_index_max_keys=1 << 20)
    tracemalloc.start()
    try:
        for b in batches:
            ix.found_remote(pickle.loads(b))
        per_key = tracemalloc.get_traced_memory()[0] / len(ix.lower[TIER_REMOTE])
    finally:
        tracemalloc.stop()
    assert per_key < 200, f"{per_key:.0f} bytes per remote key"  # whole keys: ~390


def test_pins_are_per_lookup_and_leases_expire():
    clock = Clock()
    ix = index(clock=clock, lease_secs=5.0)
    keys = [key(i) for i in range(3)]
    ix.apply_cpu(ack(keys, 1))
    a, b = ix.record("a", [4, 8, 12]), ix.record("b", [4, 8])
    assert ix.pin(a, keys) == 3 and ix.pin(b, keys[:2]) == 2
    assert ix.record("a", []) is a  # a repeated lookup reuses its record
    clock.now += 6
    assert sorted(ix.expired()) == ["a", "b"]
    assert ix.close("a") is a and a.closed and ix.pin(a, keys) == 0
    assert ix.close("a") is None


def test_collect_prefers_a_lookups_held_refs_over_the_index():
    ix = index()
    keys = [key(i) for i in range(3)]
    ix.apply_cpu(ack(keys[:1], 1))
    held = {keys[1]: ref(7)}
    result = ix.collect(keys, held)
    assert [c.ref for c in result.chunks] == ["obj0", "obj7"]


def test_count_lookup_and_stats():
    ix = index()
    keys = [key(i) for i in range(4)]
    ix.apply_cpu(ack(keys[:2], 1))
    segs, n = ix.plan(keys, ix.order)
    assert ix.count_lookup(segs, [4, 8, 12, 16], n) == (8, 8)
    stats = ix.stats()
    assert stats["hit_rate"] == 0.5 and stats["lookups"] == 1 and stats["down_tiers"] == []


def test_unknown_tiers_are_refused():
    with pytest.raises(InvalidInputError, match="unknown tier"):
        PrefixIndex(["cpu", "tape"], lease_secs=1.0)
    with pytest.raises(InvalidInputError, match="search_range"):
        index().tiers_for(["tape"])


def test_a_stale_disk_entry_or_a_dropped_tier_reaches_the_event_log():
    """The connector's CPU view lists what the log says: a disk file found missing by a
    pull, or a tier whose index was dropped, must leave it (else every request with that
    prefix gets a view hit, a failed load and a recompute)."""
    from raykv.tiers.cpulog import CPULog

    log = CPULog()
    ix = index(reporter=log)
    cursor, _ = log.since_tiers(None, key(0).identity, [TIER_CPU, TIER_DISK])
    ix.apply_lower(TIER_DISK, PutAck(accepted=[key(0), key(1)], incarnation="disk-1"))
    ix.apply_pull(TIER_DISK, CPUAck("cpu-1", {}, missing=[key(1)]))
    cursor, events = log.since_tiers(cursor, key(0).identity, [TIER_CPU, TIER_DISK])
    assert events == [
        (True, TIER_DISK, key(0).chunk_hash),
        (True, TIER_DISK, key(1).chunk_hash),
        (False, TIER_DISK, key(1).chunk_hash),
    ]
    ix.drop(TIER_DISK)  # a resync that failed
    assert log.since_tiers(cursor, key(0).identity, [TIER_CPU, TIER_DISK])[1] is None
