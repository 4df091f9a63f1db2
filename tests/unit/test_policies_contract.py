"""The policy contract, run against every registered policy."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from raykv.errors import ConfigError
from raykv.policies import Policy, known_policies, make_policy, replay

ALL = known_policies()


def _filled(name: str, n: int = 20, capacity: int = 10) -> Policy:
    policy = make_policy(name, capacity)
    for key in range(n):
        policy.insert(key)
        if key % 3 == 0:
            policy.touch(key)
    return policy


# State a drain cannot see: ghost ids (S3-FIFO, ARC's B1/B2), ARC's target and
# adaptation marker, S3-FIFO's "came back from the ghost" marker.
HIDDEN = ("_ghost", "_b1", "_b2", "p", "_adapted", "_returning")


def _snapshot(policy: Policy) -> object:
    """Everything a later eviction order depends on: drain a deep copy, plus the ghosts."""
    import copy

    hidden = {}
    for attr in HIDDEN:
        if hasattr(policy, attr):
            value = getattr(policy, attr)
            hidden[attr] = list(value) if isinstance(value, OrderedDict) else value
    clone = copy.deepcopy(policy)
    return clone.evict(len(clone) + 1), hidden


@pytest.mark.parametrize("name", ALL)
def test_policy_satisfies_protocol(name: str) -> None:
    assert isinstance(make_policy(name, 4), Policy)


@pytest.mark.parametrize("name", ALL)
def test_len_and_contains_follow_insert_and_remove(name: str) -> None:
    policy = make_policy(name, 8)
    for key in "abc":
        policy.insert(key)
    policy.insert("a")  # re-insert counts as a hit, not a second entry
    assert len(policy) == 3 and "a" in policy and "z" not in policy
    policy.remove("b")
    assert len(policy) == 2 and "b" not in policy


@pytest.mark.parametrize("name", ALL)
def test_remove_and_touch_of_absent_key_are_noops(name: str) -> None:
    policy = _filled(name)
    before = _snapshot(policy)
    policy.remove("absent")
    policy.touch("absent")
    assert _snapshot(policy) == before


@pytest.mark.parametrize("name", ALL)
def test_evict_returns_exactly_what_it_removed(name: str) -> None:
    policy = _filled(name)
    size = len(policy)
    victims = policy.evict(5)
    assert len(victims) == 5 and len(set(victims)) == 5
    assert len(policy) == size - 5
    assert all(v not in policy for v in victims)


@pytest.mark.parametrize("name", ALL)
def test_evict_never_returns_a_pinned_key(name: str) -> None:
    policy = _filled(name)
    pinned = {k for k in range(20) if k % 2 == 0}
    victims = policy.evict(100, lambda k: k not in pinned)
    assert set(victims) == set(range(1, 20, 2))
    assert all(k in policy for k in pinned)
    assert len(policy) == len(pinned)


@pytest.mark.parametrize("name", ALL)
def test_evict_with_nothing_evictable_changes_nothing(name: str) -> None:
    policy = _filled(name)
    before = _snapshot(policy)
    assert policy.evict(3, lambda k: False) == []
    assert _snapshot(policy) == before


@pytest.mark.parametrize("name", ALL)
def test_evict_with_nothing_evictable_ignores_incoming(name: str) -> None:
    """ARC must not adapt its target for an insert that cannot happen."""
    policy = _filled(name)
    gone = policy.evict(4)  # into the ghosts, where a policy keeps them
    policy.insert("new")
    before = _snapshot(policy)
    for incoming in (*gone, "other"):
        assert policy.evict(3, lambda k: False, incoming=incoming) == []
        assert _snapshot(policy) == before


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n", [0, -1])
def test_evict_zero_or_negative_returns_nothing_and_changes_nothing(name: str, n: int) -> None:
    policy = _filled(name)
    gone = policy.evict(2)
    before = _snapshot(policy)
    assert policy.evict(n) == []
    assert policy.evict(n, lambda k: True, incoming=gone[0]) == []
    assert policy.evict(n, incoming="new") == []
    assert _snapshot(policy) == before


@pytest.mark.parametrize("name", ALL)
def test_evict_more_than_available_returns_what_it_can(name: str) -> None:
    policy = _filled(name, n=4)
    assert sorted(policy.evict(10)) == [0, 1, 2, 3]
    assert len(policy) == 0
    assert policy.evict(1) == []


@pytest.mark.parametrize("name", ALL)
def test_clear_empties_the_policy(name: str) -> None:
    policy = _filled(name)
    policy.clear()
    assert len(policy) == 0 and 0 not in policy
    policy.insert("x")
    assert policy.evict(1) == ["x"]


@pytest.mark.parametrize("name", ALL)
def test_insert_accepts_priority_keyword(name: str) -> None:
    policy = make_policy(name, 4)
    policy.insert("a", priority=5)
    assert "a" in policy


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("capacity", [1, 2, 3, 7])
def test_tiny_capacities_never_crash(name: str, capacity: int) -> None:
    ids = [i % 11 for i in range(200)] + list(range(50))
    policy = make_policy(name, capacity)
    misses = replay(policy, ids)
    assert 0 < misses <= len(ids)
    assert len(policy) <= capacity
    assert policy.simulate(ids) == misses


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("capacity", [0, -1, 2.5, True])
def test_bad_capacity_is_a_config_error(name: str, capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        make_policy(name, capacity)  # type: ignore[arg-type]
