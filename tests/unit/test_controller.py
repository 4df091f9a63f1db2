"""KVController's registry and the managers' reporter, without Ray."""

from __future__ import annotations

from raykv.actors.controller import ControllerReporter, ControllerState
from raykv.keys import CacheKey


def keys(n: int, tag: str = "h") -> list[CacheKey]:
    return [CacheKey("m", 1, 0, f"{tag}{i}", "bfloat16") for i in range(n)]


def feed(state: ControllerState, rep: ControllerReporter) -> bool:
    """Deliver every pending batch (resync first if asked); True if a resync was asked."""
    asked = False
    while rep.pending or rep.needs_resync:
        if rep.needs_resync:
            return True
        b = rep.take()
        asked |= state.report(rep.instance, b.seq, b.admitted, b.evicted)
    return asked


def test_best_instances_sorts_by_longest_prefix_in_tokens():
    s = ControllerState()
    k = keys(4)
    s.resync("a", 1, {"cpu": k[:3]})
    s.resync("b", 1, {"cpu": k[:1], "disk": k[1:4]})
    s.resync("c", 1, {"cpu": k[1:4]})  # no first chunk: useless
    ends = [256, 512, 768, 1024]
    assert s.best_instances(k, ends) == [("b", 1024), ("a", 768)]
    assert s.best_instances(k, ends, tiers=("cpu",)) == [("a", 768), ("b", 256)]
    assert s.best_instances(k, exclude=["b"]) == [("a", 3)]
    assert s.best_instances(keys(2, "x")) == []


def test_a_miss_in_the_middle_ends_the_prefix():
    s = ControllerState()
    k = keys(4)
    s.resync("a", 1, {"cpu": [k[0], k[1], k[3]]})
    assert s.best_instances(k) == [("a", 2)]


def test_reports_apply_admits_and_evicts_in_order():
    s, rep = ControllerState(), ControllerReporter("a")
    k = keys(3)
    s.resync("a", rep.start_resync(), {"cpu": []})
    rep.admitted("cpu", k)
    rep.evicted("cpu", [k[2]])
    rep.evicted("cpu", [k[1]])
    rep.admitted("cpu", [k[1]])  # evicted then re-admitted in one batch: admitted
    assert not feed(s, rep)
    assert s.best_instances(k) == [("a", 2)]
    assert s.stats()["instances"] == {"a": {"cpu": 2}}


def test_a_lost_batch_asks_for_a_resync_that_repairs_the_registry():
    s, rep = ControllerState(), ControllerReporter("a")
    k = keys(3)
    s.resync("a", rep.start_resync(), {"cpu": []})
    rep.admitted("cpu", k[:2])
    rep.take()  # lost on the way
    rep.admitted("cpu", k[2:])
    assert feed(s, rep)  # the gap is noticed
    assert s.best_instances(k) == []  # k[2] alone is no prefix
    s.resync("a", rep.start_resync(), {"cpu": k})
    assert s.best_instances(k) == [("a", 3)]


def test_a_restarted_controller_asks_every_instance_to_resync():
    rep = ControllerReporter("a")
    s = ControllerState()
    s.resync("a", rep.start_resync(), {"cpu": keys(2)})
    fresh = ControllerState()  # restart: state lost
    heartbeat = rep.take()
    assert fresh.report("a", heartbeat.seq, heartbeat.admitted, heartbeat.evicted)
    fresh.resync("a", rep.start_resync(), {"cpu": keys(2)}, {"manager": "mgr-a"})
    assert fresh.best_instances(keys(2)) == [("a", 2)]
    assert fresh.info("a") == {"manager": "mgr-a"}


def test_forget_drops_an_instance_everywhere():
    s = ControllerState()
    s.resync("a", 1, {"cpu": keys(2), "disk": keys(2)})
    s.resync("b", 1, {"cpu": keys(1)})
    s.forget("a")
    assert s.best_instances(keys(2)) == [("b", 1)]
    assert s.instances() == ["b"]
    assert s.stats()["keys"] == 1


def test_reporter_batches_are_bounded_and_overflow_turns_into_a_resync():
    rep = ControllerReporter("a", max_batch=10, max_pending=25)
    rep.start_resync()
    rep.admitted("cpu", keys(15))
    assert rep.full()
    first = rep.take()
    assert len(first.admitted["cpu"]) == 10 and rep.pending == 5
    rep.admitted("cpu", keys(30, "y"))  # beyond max_pending
    assert rep.needs_resync and rep.pending == 0
    rep.admitted("cpu", keys(3, "z"))  # covered by the coming snapshot: not buffered
    assert rep.pending == 0


def test_reporter_sequence_numbers_follow_each_other():
    rep = ControllerReporter("a")
    s = ControllerState()
    s.resync("a", rep.start_resync(), {})
    for _ in range(3):
        b = rep.take()  # heartbeats
        assert not s.report("a", b.seq, b.admitted, b.evicted)


def test_an_instance_silent_for_a_few_resync_periods_is_forgotten():
    """A node removed by autoscaling stops reporting: its chunks must not be offered for
    the controller's life. Instances that keep sending heartbeats stay."""
    now = [0.0]
    s = ControllerState(silent_secs=90.0, clock=lambda: now[0])
    s.resync("gone", 0, {"cpu": keys(3)}, {"manager": "m-gone"})
    s.resync("alive", 0, {"cpu": keys(2, "x")})
    for t in range(1, 100):  # "alive" heartbeats every second, "gone" is silent
        now[0] = float(t)
        s.report("alive", t, {}, {})
    assert "gone" not in s.instances() and s.best_instances(keys(3)) == []
    assert s.info("gone") == {}
    assert s.instances() == ["alive"] and s.best_instances(keys(2, "x"))[0][0] == "alive"
    assert s.report("gone", 1, {}, {})  # if it comes back, it is asked to resync


def test_drop_unlists_the_keys_of_one_instance_and_tier_only():
    st = ControllerState()
    a, b, c = keys(3)
    st.resync("i1", 0, {"cpu": [a, b, c], "disk": [a]})
    st.resync("i2", 0, {"cpu": [a]})
    st.drop("i1", "cpu", [a, b])
    assert st.best_instances([a], tiers=("cpu",)) == [("i2", 1)]
    assert st.best_instances([a], tiers=("disk",)) == [("i1", 1)]
    assert st.best_instances([c], tiers=("cpu",)) == [("i1", 1)]


def test_a_packed_resync_applies_only_the_difference_and_ends_as_a_full_one_would():
    """Managers send their periodic snapshot packed (`PackedKeys`): the controller
    compares chunk hashes and builds only the keys it did not hold; what it lists after
    is what a resync from plain key lists gives."""
    from raykv.wire import PackedKeys

    a, b, c, d = keys(4)
    other_dtype = CacheKey(a.model_name, 1, 0, a.chunk_hash, "float16")
    packed, plain = ControllerState(), ControllerState()
    for st in (packed, plain):
        st.resync("i1", 0, {"cpu": [a, b, other_dtype], "disk": [c]})
        st.resync("i2", 0, {"cpu": [b]})
    packed.resync("i1", 1, {"cpu": PackedKeys.of([b, c, d]), "disk": PackedKeys.of([])})
    plain.resync("i1", 1, {"cpu": [b, c, d], "disk": []})
    for st in (packed, plain):
        assert st.best_instances([a], tiers=("cpu",)) == []
        assert st.best_instances([other_dtype], tiers=("cpu",)) == []
        assert st.best_instances([b, c, d], tiers=("cpu",)) == [("i1", 3), ("i2", 1)]
        assert st.best_instances([c], tiers=("disk",)) == []
    drop = lambda st: {k: v for k, v in st.stats().items() if k != "incarnation"}  # noqa: E731
    assert drop(packed) == drop(plain)


def test_a_resync_without_a_tier_unlists_that_tiers_keys():
    a, b = keys(2)
    st = ControllerState()
    st.resync("i1", 0, {"cpu": [a], "disk": [b]})
    st.resync("i1", 1, {"cpu": [a]})
    assert st.best_instances([b], tiers=("disk",)) == [] and st.stats()["keys"] == 1
