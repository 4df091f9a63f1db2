"""Hand-computed sequences and the registry."""

from __future__ import annotations

import re

import pytest

from raykv.errors import ConfigError, InvalidInputError
from raykv.policies import (
    LRUPolicy,
    known_policies,
    make_policy,
    replay,
)


def _hits(name: str, capacity: int, ids: list, **params) -> list[bool]:
    policy = make_policy(name, capacity, **params)
    out = []
    for key in ids:
        out.append(key in policy)
        replay(policy, [key])
    return out


def test_mru_evicts_the_most_recently_used() -> None:
    # cap 2: a b -> [a b]; c evicts b (MRU) -> [a c]; a hit; b evicts a (MRU) -> [c b]; c hit
    assert _hits("mru", 2, list("abcabc")) == [False, False, False, True, False, True]


def test_mru_beats_lru_on_a_loop_larger_than_the_cache() -> None:
    loop = list(range(5)) * 20
    assert replay(make_policy("mru", 4), loop) < replay(make_policy("lru", 4), loop)


def test_filo_evicts_the_newest_insert_and_ignores_hits() -> None:
    # cap 2: a b -> [a b]; b hit; c evicts b -> [a c]; a hit; b evicts c -> [a b]; c evicts b
    assert _hits("filo", 2, list("abbcabc")) == [False, False, True, False, True, False, False]


def test_lfu_breaks_ties_by_recency() -> None:
    policy = make_policy("lfu", 3)
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    policy.touch("b")
    assert policy.evict(1) == ["c"]
    assert policy.evict(1) == ["a"]  # a and b both at 2; a was used less recently


def test_lfu_forgets_counts_on_eviction() -> None:
    policy = make_policy("lfu", 2)
    policy.insert("a")
    for _ in range(5):
        policy.touch("a")
    assert policy.evict(1) == ["a"]
    policy.insert("a")
    policy.insert("b")
    policy.touch("b")
    assert policy.evict(1) == ["a"]


def test_priority_evicts_lowest_priority_then_lru() -> None:
    policy = make_policy("priority", 4)
    policy.insert("hi", priority=9)
    policy.insert("lo1", priority=1)
    policy.insert("lo2", priority=1)
    policy.touch("lo1")
    assert policy.evict(3) == ["lo2", "lo1", "hi"]


@pytest.mark.parametrize("capacity", [1, 5, 10, 40])
def test_arc_keeps_the_papers_ghost_bounds_under_multi_evictions(capacity: int) -> None:
    """A byte-budget store evicts several keys at once; B1/B2 must not grow past 2c."""
    import random

    rng = random.Random(capacity)
    policy = make_policy("arc", capacity)
    c = capacity
    for _ in range(3000):
        key = rng.randrange(20 * c)
        if key in policy:
            policy.touch(key)
            continue
        policy.evict(max(rng.randint(1, 4), len(policy) - c + 1), incoming=key)
        if rng.random() < 0.7:
            policy.insert(key)
        t1, t2, b1, b2 = (len(q) for q in (policy._t1, policy._t2, policy._b1, policy._b2))
        assert t1 + b1 <= c and t1 + t2 + b1 + b2 <= 2 * c


def test_arc_bounds_return_once_an_overfilled_cache_is_evicted_back() -> None:
    """Inserting without evicting relaxes the bounds; evicting back to c restores them."""
    import random

    rng, c = random.Random(7), 6
    policy = make_policy("arc", c)
    for _ in range(3000):
        key = rng.randrange(10 * c)
        if key in policy:
            policy.touch(key)
        elif rng.random() < 0.3:
            policy.insert(key)  # no eviction: len may pass c
        else:
            policy.evict(rng.randint(1, 4) + max(0, len(policy) - c), incoming=key)
            t1, t2, b1, b2 = (len(q) for q in (policy._t1, policy._t2, policy._b1, policy._b2))
            assert t1 + b1 <= max(c, t1) and t1 + t2 + b1 + b2 <= max(2 * c, t1 + t2)
            if len(policy) <= c:
                assert t1 + b1 <= c and t1 + t2 + b1 + b2 <= 2 * c


def test_slru_promotes_on_probation_hit_and_demotes_protected_overflow() -> None:
    policy = make_policy("slru", 5)  # probation 1, protected 4
    for key in "abcdef":
        policy.insert(key)
    for key in "abcde":
        policy.touch(key)  # a..d fill protected, e pushes a back to probation
    assert policy.evict(3) == ["f", "a", "b"]


def test_s3fifo_one_hit_wonders_go_to_ghost_and_come_back_to_main() -> None:
    policy = make_policy("s3fifo", 10)  # small 1, main 9, ghost 9
    policy.insert("x")
    assert policy.evict(1) == ["x"]
    policy.insert("x")  # found in the ghost: goes straight to main
    assert "x" in policy._main


def test_s3fifo_moves_twice_hit_keys_to_main() -> None:
    policy = make_policy("s3fifo", 10, move_threshold=2)
    policy.insert("a")
    policy.insert("b")
    policy.touch("a")
    policy.touch("a")
    assert policy.evict(1) == ["b"]
    assert "a" in policy._main


def test_sieve_hand_keeps_visited_keys() -> None:
    policy = make_policy("sieve", 3)
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert policy.evict(1) == ["b"]  # a visited: bit cleared, hand moves on
    policy.insert("d")
    assert policy.evict(1) == ["c"]
    assert policy.evict(1) == ["d"]  # hand passed the head and wrapped; a cleared earlier
    assert policy.evict(1) == ["a"]


def test_sieve_survives_deepcopy_and_pickle_with_tombstones() -> None:
    """The tombstone must stay the module's singleton, or a copy misreads it as a key."""
    import copy
    import pickle

    policy = make_policy("sieve", 4)
    for key in "abcd":
        policy.insert(key)
    policy.touch("a")
    assert policy.evict(1) == ["b"]
    policy.remove("c")
    for clone in (copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert clone.evict(3) == ["d", "a"]
        assert len(clone) == 0


@pytest.mark.parametrize("bad", ["high", float("nan"), float("inf"), -float("inf"), True, [1]])
def test_priority_rejects_bad_priorities_without_changing_state(bad: object) -> None:
    policy = make_policy("priority", 4)
    policy.insert("a", priority=1)
    for key in ("a", "new"):
        with pytest.raises(InvalidInputError, match=re.escape(repr(bad))):
            policy.insert(key, priority=bad)  # type: ignore[arg-type]
    assert len(policy) == 1 and "new" not in policy
    policy.insert("b", priority=0.5)
    assert policy.evict(2) == ["b", "a"]  # "a" kept priority 1
    assert len(policy) == 0


def test_priority_accepts_ints_floats_and_numpy_numbers() -> None:
    import numpy as np

    policy = make_policy("priority", 4)
    policy.insert("a", priority=np.float64(2.5))
    policy.insert("b", priority=np.int64(1))
    policy.insert("c", priority=10**30)
    policy.insert("d", priority=-1.5)
    assert policy.evict(4) == ["d", "b", "a", "c"]


@pytest.mark.parametrize("bad", ["high", float("nan"), True])
def test_priority_rejects_a_bad_default_priority(bad: object) -> None:
    with pytest.raises(ConfigError, match="default_priority"):
        make_policy("priority", 4, default_priority=bad)


def test_registry_names_are_sorted_lower_case_and_case_insensitive() -> None:
    names = known_policies()
    assert names == sorted(names) and all(n == n.lower() for n in names)
    assert {"lru", "fifo", "mru", "filo", "lfu", "slru", "priority", "s3fifo", "sieve"} <= set(
        names
    )
    assert isinstance(make_policy("LRU", 3), LRUPolicy)
    assert type(make_policy("S3-FIFO", 30)).__name__ == "S3FIFOPolicy"


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="known: arc, clock"):
        make_policy("belady", 3)


def test_out_of_tree_policy_by_module_path() -> None:
    policy = make_policy("raykv.policies.lru:LRUPolicy", 3)
    assert isinstance(policy, LRUPolicy)
    with pytest.raises(ConfigError, match="cannot be loaded"):
        make_policy("no.such.module:Thing", 3)


def test_a_type_error_inside_a_constructor_is_not_hidden(monkeypatch) -> None:
    """Only parameters that do not bind are "bad parameters"; a bug must surface as itself."""
    import raykv.policies as policies

    class Buggy(LRUPolicy):
        def __init__(self, capacity: int, depth: int = 1) -> None:
            super().__init__(capacity)
            self.depth = depth + "1"  # a bug: TypeError

    monkeypatch.setattr(policies, "policy_class", lambda name: Buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        make_policy("buggy", 3)
    with pytest.raises(ConfigError, match="bad parameters"):
        make_policy("buggy", 3, width=2)


def test_bad_policy_parameters_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        make_policy("lru", 3, bogus=1)
    with pytest.raises(ConfigError):
        make_policy("s3fifo", 10, small_ratio=1.5)
    with pytest.raises(ConfigError):
        make_policy("slru", 10, split=(1,))
