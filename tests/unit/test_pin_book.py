"""The client's pin book (`raykv.client.pins.PinBook`) without Ray."""

from __future__ import annotations

from raykv_testing import chunk_key

from raykv.client.pins import PinBook
from raykv.keys import ChunkSpan


def spans(*ids: int) -> list[ChunkSpan]:
    return [ChunkSpan(16 * i, 16 * (i + 1), chunk_key(i)) for i in ids]


def test_a_retrieve_takes_the_oldest_lookup_ending_in_its_spans_once() -> None:
    book = PinBook()
    book.open("a", chunk_key(2))
    book.open("b", chunk_key(2))  # another request with the same prefix
    book.open("c", chunk_key(5))
    assert book.take(spans(0, 1, 2)) == "a"  # the oldest of the two, exactly one
    assert book.take(spans(0, 1, 2)) == "b"
    assert book.take(spans(0, 1, 2)) is None
    assert book.take(spans(3, 4, 5, 6)) == "c" and len(book) == 0


def test_past_the_limit_the_oldest_are_handed_back_to_unpin() -> None:
    book = PinBook(limit=2)
    assert book.open("a", chunk_key(1)) == []
    assert book.open("b", chunk_key(2)) == []
    assert book.open("c", chunk_key(3)) == ["a"]
    assert list(book) == ["b", "c"] and book.take(spans(1)) is None
    book.forget("b")
    assert list(book) == ["c"]
    book.clear()
    assert len(book) == 0 and book.take(spans(3)) is None
