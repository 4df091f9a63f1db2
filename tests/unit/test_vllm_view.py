"""CPUView: the vLLM scheduler's copy of which chunks raykv's CPU tier holds, from a
scripted manager (snapshot, events, faults) and the answers it gives or refuses to give."""

from __future__ import annotations

import time
from typing import Any

import pytest

from raykv import metrics
from raykv.integrations.vllm_view import CPUView
from raykv.keys import CacheKey, ChunkSpan

IDENTITY = ("model", 1, 0, "bfloat16")


class FakeCache:
    """`KVCache.cpu_events` / `cpu_keys` over per-tier sets the test changes: events are
    queued as the test changes the sets; `lose()` makes the next poll unable to say."""

    def __init__(self, held: set[str], disk: set[str] = frozenset()) -> None:
        self.tiers = {"cpu": set(held), "disk": set(disk)}
        self.queued: list[tuple[bool, str, str]] = []
        self.log = 0  # the log's id: a new one refuses old cursors
        self.fail = False
        self.snapshots = 0

    @property
    def held(self) -> set[str]:
        return self.tiers["cpu"]

    @held.setter
    def held(self, keys: set[str]) -> None:
        self.tiers["cpu"] = set(keys)

    def admit(self, *keys: str, tier: str = "cpu") -> None:
        self.tiers[tier].update(keys)
        self.queued += [(True, tier, k) for k in keys]

    def evict(self, *keys: str, tier: str = "cpu") -> None:
        self.tiers[tier].difference_update(keys)
        self.queued += [(False, tier, k) for k in keys]

    def lose(self) -> None:
        self.log += 1
        self.queued = []

    def cpu_events(self, cursor: Any, identity: Any, tiers: Any = None) -> Any:
        assert tuple(identity) == IDENTITY
        if self.fail:
            return None
        now = (str(self.log), 0, 0)
        if cursor is None or cursor[0] != str(self.log):
            self.queued = []
            return now, None
        out, self.queued = self.queued, []
        if tiers is None:  # the CPU log's own form
            return now, [(a, k) for a, t, k in out if t == "cpu"]
        return now, [c for c in out if c[1] in tiers]

    def cpu_keys(self, identity: Any, tier: str = "cpu") -> list[str] | None:
        assert tuple(identity) == IDENTITY
        if self.fail:
            return None
        self.snapshots += tier == "cpu"
        return sorted(self.tiers[tier])


def spans(*hashes: str) -> list[ChunkSpan]:
    return [ChunkSpan(i * 4, (i + 1) * 4, CacheKey.of(IDENTITY, h)) for i, h in enumerate(hashes)]


@pytest.fixture
def view_of():
    made: list[CPUView] = []

    def make(cache: FakeCache, **kw: Any) -> CPUView:
        # The poller never runs by itself (an hour between polls): the test polls.
        v = CPUView(cache, IDENTITY, poll_s=3600, idle_poll_s=3600, stale_s=3600, **kw)
        made.append(v)
        v.prefix([])  # the first call after start counts as after an idle spell
        return v

    yield make
    for v in made:
        v.close()


def test_the_view_starts_from_a_snapshot_and_follows_admissions_and_evictions(view_of):
    cache = FakeCache({"a", "b"})
    v = view_of(cache)
    assert cache.snapshots == 1
    assert v.prefix(["a", "b", "c"]) == 2
    cache.admit("c")
    cache.evict("a")
    assert v.prefix(["a", "b", "c"]) == 2  # not polled yet: the set trails the tier
    v._poll()
    assert v.prefix(["a", "b", "c"]) == 0
    assert v.prefix(["b", "c", "d"]) == 2
    assert cache.snapshots == 1  # events, not snapshots, while the log can say


def test_a_log_that_cannot_say_or_a_failed_poll_resyncs_from_a_snapshot(view_of):
    cache = FakeCache({"a"})
    v = view_of(cache)
    cache.lose()
    cache.held = {"x", "y"}  # changed unrecorded
    v._poll()
    assert v.prefix(["x", "y"]) == 2 and v.prefix(["a"]) == 0
    assert cache.snapshots == 2
    cache.fail = True
    v._poll()
    assert v.prefix(["x"]) is None  # unknown: the scheduler sends a lookup
    cache.fail = False
    cache.held = {"x"}
    v._poll()
    assert v.prefix(["x", "y"]) == 1 and v.resyncs == 3


def test_a_stale_or_idle_view_is_not_used_and_wakes_the_poller(view_of):
    cache = FakeCache({"a"})
    v = view_of(cache)
    v._stale_s = 0.0  # last poll too long ago
    assert v.prefix(["a"]) is None
    assert v._wake.is_set()
    v._wake.clear()
    v._stale_s = 3600
    v._busy_until = 0.0  # idle for a while: the first request is looked up
    assert v.prefix(["a"]) is None and v._wake.is_set()
    assert v.prefix(["a"]) == 1  # busy again


def test_a_chunk_this_engine_is_saving_is_looked_up_until_the_tier_admits_it(view_of):
    cache = FakeCache({"a"})
    v = view_of(cache)
    v.saving(["b"])
    assert v.prefix(["a", "b"]) is None  # b may be in the tier already
    assert v.prefix(["a", "c"]) == 1  # the first missing chunk is not being saved
    cache.admit("b")
    v._poll()
    assert v.prefix(["a", "b", "c"]) == 2
    v.saving(["c"])
    v._saving_s = 0.0  # a save never admitted (dropped): trusted again after saving_s
    assert v.prefix(["a", "b", "c"]) == 2


def test_saving_forgets_saves_past_their_time(view_of):
    v = view_of(FakeCache(set()), saving_s=0.0)
    v.saving(["a", "b"])
    v.saving(["c"])
    assert list(v._saving) == ["c"]


def test_hit_answers_tokens_and_counts_the_lookup_as_the_manager_would(view_of, monkeypatch):
    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "inc", lambda n, v=1, **tags: recorded.append((n, v, tags)))
    v = view_of(FakeCache({"a", "b"}))
    assert v.hit(spans("a", "b", "c")) == (8, [("cpu", 8)])
    assert recorded == [
        ("raykv_lookups", 1, {}),
        ("raykv_hit_tokens", 8, {}),
        ("raykv_miss_tokens", 4, {}),
        ("raykv_tier_hit_tokens", 8, {"tier": "cpu"}),
    ]
    recorded.clear()
    assert v.hit(spans("z")) == (0, [])
    assert [r[:2] for r in recorded] == [
        ("raykv_lookups", 1),
        ("raykv_hit_tokens", 0),
        ("raykv_miss_tokens", 4),
    ]


def test_a_partial_chunk_only_an_earlier_tier_holds_after_a_disk_run_is_not_claimed(view_of):
    """The manager reads a tail from the tier of the run before it on (never back)."""
    cache = FakeCache({"a", "t6"}, disk={"b", "t5"})
    v = view_of(cache, tiers=("cpu", "disk"))

    def tails(n: int) -> list[ChunkSpan]:
        return [ChunkSpan(n * 4, n * 4 + k, CacheKey.of(IDENTITY, f"t{k + 4}")) for k in (2, 1)]

    # a in CPU, b on disk: t6 (CPU only) is not read after the disk run, t5 (disk) is
    assert v.hit(spans("a", "b", "c"), tails) == (9, [("cpu", 4), ("disk", 9)])
    cache.evict("t5", tier="disk")
    v._poll()
    assert v.hit(spans("a", "b", "c"), tails) == (8, [("cpu", 4), ("disk", 8)])


def test_a_partial_chunk_after_the_whole_ones_held_ends_the_hit(view_of):
    """`save_unfull_chunk`: after the whole chunks held, the longest partial chunk held
    (of those `tails(n)` names, longest first) extends the hit, in its tier."""
    cache = FakeCache({"a", "b", "t6"}, disk={"t5", "u9"})
    v = view_of(cache, tiers=("cpu", "disk"))
    asked: list[int] = []

    def tails(n: int) -> list[ChunkSpan]:
        asked.append(n)
        return [ChunkSpan(n * 4, n * 4 + k, CacheKey.of(IDENTITY, f"t{k + 4}")) for k in (3, 2, 1)]

    # chunks a, b held, c not: the partial chunks of chunk 2 are asked for, t6 is held
    assert v.hit(spans("a", "b", "c"), tails) == (10, [("cpu", 10)])
    assert asked == [2]
    cache.evict("t6")
    v._poll()
    assert v.hit(spans("a", "b", "c"), tails) == (9, [("cpu", 8), ("disk", 9)])
    # no whole chunk (a short prompt): the partial chunks of chunk 0
    assert v.hit([], tails) == (1, [("disk", 1)])
    cache.evict("t5", tier="disk")
    v._poll()
    assert v.hit(spans("a", "b", "c"), tails) == (8, [("cpu", 8)])
    v.saving(["t6"])  # this engine is saving a partial chunk the hit would take: ask
    assert v.hit(spans("a", "b", "c"), tails) is None
    cache.admit("t6")
    v._poll()
    assert v.hit(spans("a", "b", "c"), tails) == (10, [("cpu", 10)])
    v._lost()  # not known: no answer at all, partial chunks included
    assert v.hit(spans("a"), tails) is None


def test_the_poller_thread_keeps_the_view_current_while_busy():
    cache = FakeCache({"a"})
    v = CPUView(cache, IDENTITY, poll_s=0.01, idle_poll_s=0.01)
    try:
        v.prefix([])
        cache.admit("b")
        deadline = time.monotonic() + 5
        while v.prefix(["a", "b"]) != 2:
            assert time.monotonic() < deadline, "the poller never brought b in"
            time.sleep(0.01)
    finally:
        v.close()
        v._thread.join(5)
    assert not v._thread.is_alive()


def test_a_cpu_and_disk_view_locates_chunks_in_runs_as_the_manager_reads_them(view_of):
    """A run from the CPU tier, then one from disk, never back (`PrefixIndex.plan`): a
    chunk that only the CPU tier holds after a disk run ends the prefix (claimed, its
    load failed and the request recomputed it)."""
    cache = FakeCache({"a", "c", "e"}, disk={"b", "c"})
    v = view_of(cache, tiers=("cpu", "disk"))
    assert v.locate(["a", "b", "c", "e"]) == ["cpu", "disk", "disk"]
    assert v.locate(["a", "c", "b"]) == ["cpu", "cpu", "disk"]
    cache.evict("c")
    cache.admit("d", tier="disk")
    cache.evict("b", tier="disk")
    v._poll()
    assert v.locate(["a", "c", "d"]) == ["cpu", "disk", "disk"]
    assert v.locate(["a", "b"]) == ["cpu"]
    assert v.hit(spans("a", "c", "d", "e")) == (12, [("cpu", 4), ("disk", 12)])


@pytest.mark.parametrize(
    ("overrides", "tiers"),
    [
        ({}, ("cpu",)),
        ({"lookup_view": False}, None),
        ({"world_size": 2}, None),  # the scheduler looks up every rank's keys
        ({"local_cpu": False, "local_disk": "/tmp/raykv-view", "max_local_disk_size": 1.0}, None),
        ({"local_disk": "/tmp/raykv-view", "max_local_disk_size": 1.0}, ("cpu", "disk")),
        (  # sync loads: a lookup promotes disk hits before the step that loads them
            {"local_disk": "/tmp/raykv-view", "max_local_disk_size": 1.0, "load_mode": "sync"},
            None,
        ),
        ({"remote_url": "redis://127.0.0.1:1"}, None),
        ({"enable_controller": True}, None),  # a peer may hold what this node does not
    ],
)
def test_the_view_follows_the_local_tiers_only_where_nothing_else_can_hold_a_chunk(
    overrides, tiers
):
    from raykv.config import RayKVConfig
    from raykv.integrations.vllm_setup import view_tiers

    assert view_tiers(RayKVConfig(**overrides)) == tiers
