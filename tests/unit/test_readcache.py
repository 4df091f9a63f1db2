"""The client's read cache: held values serve repeat reads, the bound is in bytes, a failed
fetch keeps nothing."""

from __future__ import annotations

import numpy as np
import pytest

from raykv.client.readcache import ReadCache, object_id, value_nbytes


class Fetcher:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, refs: list[str]) -> list[list[np.ndarray]]:
        self.calls.append(list(refs))
        return [[np.full(100, ord(r[0]), dtype=np.uint8)] for r in refs]


def test_a_repeat_read_is_served_without_a_fetch_and_only_missing_refs_are_fetched():
    cache, fetch = ReadCache(1000), Fetcher()
    first = cache.read(["a", "b"], fetch)
    again = cache.read(["b", "a", "c"], fetch)
    assert fetch.calls == [["a", "b"], ["c"]]  # one fetch per read, of the missing only
    assert again[0] is first[1] and again[1] is first[0]
    assert int(again[2][0][0]) == ord("c")
    assert (cache.hits, cache.misses, len(cache), cache.used_bytes) == (2, 3, 3, 300)


def test_the_bound_is_in_bytes_and_drops_the_least_recently_read():
    cache, fetch = ReadCache(250), Fetcher()
    cache.read(["a"], fetch)
    cache.read(["b"], fetch)
    cache.read(["a"], fetch)  # a is now the most recent
    cache.read(["c"], fetch)  # 300 bytes > 250: b goes
    assert cache.used_bytes == 200 and len(cache) == 2
    fetch.calls.clear()
    cache.read(["a", "b", "c"], fetch)
    assert fetch.calls == [["b"]]


def test_an_object_larger_than_the_cache_is_read_but_not_kept():
    cache, fetch = ReadCache(50), Fetcher()
    assert value_nbytes(cache.read(["a"], fetch)[0]) == 100
    assert len(cache) == 0 and cache.used_bytes == 0


def test_a_failed_fetch_keeps_nothing_and_clear_drops_everything():
    cache, fetch = ReadCache(1000), Fetcher()
    cache.read(["a"], fetch)

    def broken(refs):
        raise RuntimeError("object lost")

    with pytest.raises(RuntimeError):
        cache.read(["a", "b"], broken)
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.used_bytes == 0
    assert cache.stats() == {
        "read_cache_hits": 1,
        "read_cache_misses": 2,
        "read_cache_bytes": 0,
        "read_cache_objects": 0,
    }


def test_value_nbytes_counts_arrays_and_lists_of_arrays():
    assert value_nbytes(np.zeros(7, dtype=np.float32)) == 28
    assert value_nbytes((np.zeros(3, dtype=np.uint8), np.zeros(2, dtype=np.uint16))) == 7


class Ref:
    """Stands in for a Ray ref: filed under its `binary()` id."""

    def __init__(self, oid: bytes) -> None:
        self.oid = oid

    def binary(self) -> bytes:
        return self.oid


def test_refs_are_filed_under_their_object_id_and_keys_under_the_object_they_came_from():
    cache = ReadCache(1000)
    a, b = Ref(b"A"), Ref(b"B")
    cache.read([a, b], lambda refs: [[np.zeros(100, np.uint8)] for _ in refs])
    assert object_id(a) == b"A" and cache.read([Ref(b"A")], pytest.fail)  # held by id
    assert not cache.covers(["k1"])  # nothing noted yet
    cache.note(["k1", "k2", "k3"], [a, a, b"B"])
    assert cache.covers(["k1", "k2", "k3"]) and not cache.covers(["k1", "k4"])
    assert not cache.covers([])
    got = cache.held([b"A", b"B"])
    assert got is not None and len(got) == 2
    assert cache.held([b"A", b"C"]) is None


def test_dropping_an_object_forgets_the_keys_read_from_it():
    cache = ReadCache(250)
    fill = lambda refs: [[np.zeros(100, np.uint8)] for _ in refs]  # noqa: E731
    cache.read([Ref(b"A")], fill)
    cache.note(["k1"], [b"A"])
    cache.read([Ref(b"B"), Ref(b"C")], fill)  # 300 bytes: A goes
    assert not cache.covers(["k1"]) and cache.held([b"A"]) is None
    cache.note(["k2"], [b"A"])  # an object not held is not noted
    assert not cache.covers(["k2"])
    cache.note(["k3"], [b"C"])
    assert cache.covers(["k3"])
    cache.clear()
    assert not cache.covers(["k3"])


def test_memo_is_made_once_per_key_while_the_object_is_held_and_goes_with_it():
    cache, fetch = ReadCache(250), Fetcher()
    cache.read(["a", "b"], fetch)
    made: list[str] = []

    def make(tag: str):
        return lambda: made.append(tag) or [tag]

    first = cache.memo("a", (0, "meta"), make("a0"))
    assert cache.memo("a", (0, "meta"), make("again")) is first  # kept: made once
    assert cache.memo("a", (0, "other"), make("a0'")) == ["a0'"]  # another key, made
    assert cache.memo("z", 0, make("z")) == ["z"] and cache.memo("z", 0, make("z2")) == ["z2"]
    assert made == ["a0", "a0'", "z", "z2"]  # an object not held keeps nothing
    cache.read(["c"], fetch)  # 300 bytes > 250: a (least recent) goes, with its memos
    assert len(cache) == 2 and cache.memo("a", (0, "meta"), make("new")) == ["new"]
    cache.read(["a"], fetch)  # held again: made anew, not the old one
    assert cache.memo("a", (0, "meta"), make("fresh")) == ["fresh"]
    cache.clear()
    assert cache.memo("a", (0, "meta"), make("cleared")) == ["cleared"]


def test_a_key_read_from_an_object_not_held_is_no_longer_covered_by_its_old_one():
    """A chunk stored again (or promoted from disk) comes back in a new object too big
    to keep: the cache must stop naming the old object for it, or every retrieve of it
    asks the manager by id, misses here, and asks again by ref."""
    cache = ReadCache(250)
    cache.read([Ref(b"X")], lambda refs: [[np.zeros(100, np.uint8)] for _ in refs])
    cache.note(["k"], [b"X"])
    assert cache.covers(["k"])
    cache.note(["k"], [b"Y"])  # Y was read but not kept (larger than the cache)
    assert not cache.covers(["k"]) and cache.held([b"X"]) is not None
