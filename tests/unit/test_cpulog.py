"""CPULog: the CPU tier's admissions and evictions, numbered, for readers that poll."""

from __future__ import annotations

import pytest
from raykv_testing import chunk_key

from raykv.errors import InvalidInputError
from raykv.tiers.cpulog import CPULog, Reporters
from raykv.wire import TIER_CPU, TIER_DISK


def key(i: int, model: str = "m", worker: int = 0):
    return chunk_key(i, model=model)._replace(worker_id=worker)


ID = key(0).identity


def test_nothing_is_recorded_until_a_reader_polls_and_a_first_poll_cannot_say():
    log = CPULog()
    log.admitted(TIER_CPU, [key(1)])
    cursor, events = log.since(None, ID)
    assert events is None  # a first poll: the reader starts here
    assert log.since(cursor, ID) == (cursor, [])


def test_a_reader_gets_its_engines_cpu_events_once_in_order():
    log = CPULog()
    cursor, _ = log.since(None, ID)
    other_dtype = key(6)._replace(kv_dtype="float32")
    log.admitted(TIER_CPU, [key(1), key(2), key(3, model="other"), key(4, worker=1), other_dtype])
    log.admitted(TIER_DISK, [key(5)])  # another tier: not the CPU tier's event
    log.evicted(TIER_CPU, [key(1)])
    cursor, events = log.since(cursor, ID)
    hashes = {i: key(i).chunk_hash for i in (1, 2)}
    assert events == [(True, hashes[1]), (True, hashes[2]), (False, hashes[1])]
    assert log.since(cursor, ID) == (cursor, [])  # each once
    log.evicted(TIER_CPU, [key(2)])
    assert log.since(cursor, ID)[1] == [(False, hashes[2])]


def test_a_loss_or_an_overflow_tells_the_reader_it_cannot_say():
    log = CPULog(capacity=3)
    cursor, _ = log.since(None, ID)
    log.lost(TIER_DISK)  # another tier's index was rebuilt: the CPU log can still say
    assert log.since(cursor, ID) == (cursor, [])
    log.lost(TIER_CPU)  # the CPU index was rebuilt: keys may have left unrecorded
    cursor, events = log.since(cursor, ID)
    assert events is None
    log.admitted(TIER_CPU, [key(i) for i in range(4)])  # one more than the ring holds
    cursor, events = log.since(cursor, ID)
    assert events is None
    log.admitted(TIER_CPU, [key(9)])
    assert log.since(cursor, ID)[1] == [(True, key(9).chunk_hash)]
    assert log.since((cursor[0], cursor[1] + 5, cursor[2]), ID)[1] is None  # from the future
    assert log.since(("another log", *cursor[1:]), ID)[1] is None  # a restarted manager's


def test_reporters_tell_every_reporter_and_skip_none():
    seen: list = []

    class Spy:
        def admitted(self, tier, keys):
            seen.append(("admitted", tier, list(keys)))

        def evicted(self, tier, keys):
            seen.append(("evicted", tier, list(keys)))

        def lost(self, tier=None):
            seen.append(("lost", tier))

    both = Reporters(Spy(), None, Spy())
    both.admitted(TIER_CPU, iter([key(1)]))  # an iterator is read once, for both
    both.evicted(TIER_CPU, [key(1)])
    both.lost(TIER_CPU)
    assert seen == [
        ("admitted", TIER_CPU, [key(1)]),
        ("admitted", TIER_CPU, [key(1)]),
        ("evicted", TIER_CPU, [key(1)]),
        ("evicted", TIER_CPU, [key(1)]),
        ("lost", TIER_CPU),
        ("lost", TIER_CPU),
    ]


def test_a_reader_of_cpu_and_disk_gets_both_tiers_events_and_either_tiers_losses():
    log = CPULog()
    cpu_only, _ = log.since(None, ID)
    both, _ = log.since_tiers(None, ID, (TIER_CPU, TIER_DISK))
    log.admitted(TIER_DISK, [key(1)])
    log.admitted(TIER_CPU, [key(2)])
    log.evicted(TIER_DISK, [key(1)])
    both, events = log.since_tiers(both, ID, (TIER_CPU, TIER_DISK))
    assert events == [
        (True, TIER_DISK, key(1).chunk_hash),
        (True, TIER_CPU, key(2).chunk_hash),
        (False, TIER_DISK, key(1).chunk_hash),
    ]
    cpu_only, events = log.since(cpu_only, ID)
    assert events == [(True, key(2).chunk_hash)]  # a CPU reader sees the CPU tier only
    log.lost(TIER_DISK)  # a rebuilt disk index: only readers of the disk tier start over
    assert log.since(cpu_only, ID)[1] == []
    assert log.since_tiers(both, ID, (TIER_CPU, TIER_DISK))[1] is None


def test_nothing_is_recorded_for_the_disk_tier_until_a_reader_asks_for_it():
    log = CPULog()
    cursor, _ = log.since(None, ID)
    log.admitted(TIER_DISK, [key(1)])
    assert log.since(cursor, ID) == (cursor, [])  # not numbered: nobody reads disk events
    with pytest.raises(InvalidInputError, match="remote"):
        log.since_tiers(None, ID, ("remote",))


@pytest.mark.parametrize(
    "cursor, identity",
    [(("id", 5), ID), (("id", "5", 0), ID), ("id-5-0", ID), (None, None), (None, 7)],
)
def test_a_malformed_cursor_or_identity_is_a_clear_error(cursor, identity):
    """They reach the manager from any client (`KVCache.cpu_events`): an IndexError or a
    TypeError from inside the log named nothing."""
    with pytest.raises(InvalidInputError, match="cursor|identity"):
        CPULog().since(cursor, identity)
