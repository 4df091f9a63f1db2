"""Hand-computed sequences and the registry."""

from __future__ import annotations

import pytest

from raykv.errors import ConfigError
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


def test_bad_policy_parameters_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        make_policy("lru", 3, bogus=1)
    with pytest.raises(ConfigError):
        make_policy("s3fifo", 10, small_ratio=1.5)
    with pytest.raises(ConfigError):
        make_policy("slru", 10, split=(1,))
