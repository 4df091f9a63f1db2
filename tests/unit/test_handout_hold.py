"""`HandoutHold`: how long handed-out small refs stay alive, and what that may cost."""

from __future__ import annotations

from raykv.actors.common import INLINE_OBJECT_BYTES, HandoutHold

KIB = 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**kw) -> tuple[HandoutHold, Clock]:
    clock = Clock()
    kw.setdefault("hold_secs", 2.0)
    kw.setdefault("min_secs", 0.25)
    kw.setdefault("max_bytes", 100 * KIB)
    return HandoutHold(clock=clock, **kw), clock


def test_small_refs_are_held_for_hold_secs_under_the_cap() -> None:
    hold, clock = make()
    hold.hold("a", 10 * KIB)
    clock.now += 1.9
    hold.hold("b", 10 * KIB)
    assert len(hold) == 2 and hold.nbytes == 20 * KIB
    clock.now += 0.2  # "a" is 2.1 s old
    hold.hold("c", 10 * KIB)
    assert len(hold) == 2 and hold.nbytes == 20 * KIB


def test_big_refs_are_not_held() -> None:
    hold, _ = make(max_bytes=10 * INLINE_OBJECT_BYTES)
    hold.hold("big", INLINE_OBJECT_BYTES + 1)
    assert len(hold) == 0 and hold.nbytes == 0
    hold.hold("edge", INLINE_OBJECT_BYTES)
    assert len(hold) == 1


def test_over_the_cap_refs_go_after_min_secs_oldest_first() -> None:
    hold, clock = make(max_bytes=30 * KIB)
    for name in "abcde":
        hold.hold(name, 10 * KIB)
        clock.now += 0.1
    # 50 KiB held, over the cap, but a (0.5 s), b (0.4 s) and c (0.3 s) are old enough
    hold.hold("f", 10 * KIB)
    assert [r for _, _, r in hold._held] == ["d", "e", "f"]
    assert hold.nbytes == 30 * KIB


def test_never_released_before_min_secs_even_far_over_the_cap() -> None:
    hold, clock = make(max_bytes=10 * KIB)
    for i in range(20):
        hold.hold(i, 50 * KIB)
        clock.now += 0.01
    assert len(hold) == 20  # all younger than 0.25 s
    clock.now += 0.25
    hold.hold("late", 1)
    assert len(hold) == 1 and hold.nbytes == 1


def test_min_secs_never_exceeds_hold_secs() -> None:
    hold, clock = make(hold_secs=0.1, min_secs=5.0)
    hold.hold("a", KIB)
    clock.now += 0.11
    hold.hold("b", KIB)
    assert len(hold) == 1
