"""The parts of `client_remote_probe` that need no Ray: notes sent from a thread, in
order, never raising into the caller; and where a lookup's local answer ends."""

from __future__ import annotations

import threading

from raykv.engine import _chunks_within
from raykv.keys import ChunkSpan, KeyMaker
from raykv.probe import Notes


class Method:
    """Stands in for an actor method: `.remote(*args)` records (or raises)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self.fail = fail

    def remote(self, *args: object) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("actor gone")
        self.calls.append(args)


def test_notes_are_sent_in_order_from_their_own_thread_and_drain_waits_for_them():
    notes, method = Notes("test-notes"), Method()
    for i in range(50):
        notes.post(method, i, "x")
    assert notes.drain(5)
    assert method.calls == [(i, "x") for i in range(50)]
    assert method.threads == {"test-notes"}
    notes.close()


def test_a_note_that_fails_to_send_is_dropped_and_the_next_ones_still_go():
    notes, bad, good = Notes(), Method(fail=True), Method()
    notes.post(bad, 1)
    notes.post(good, 2)
    assert notes.drain(5) and good.calls == [(2,)]
    notes.close()


def test_chunks_within_a_hit_counts_whole_chunks_and_falls_back_to_a_search():
    spans = KeyMaker(chunk_size=4).keys(list(range(14)))  # 3 whole chunks, tail dropped
    assert [_chunks_within(spans, hit, 4) for hit in (0, 4, 8, 12)] == [0, 1, 2, 3]
    key = spans[0].key
    odd = [ChunkSpan(0, 3, key), ChunkSpan(3, 7, key), ChunkSpan(7, 9, key)]  # uneven
    assert [_chunks_within(odd, hit, 4) for hit in (0, 3, 7, 9)] == [0, 1, 2, 3]
