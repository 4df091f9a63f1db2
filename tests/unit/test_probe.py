"""The part of `client_remote_probe` that needs no Ray: where a lookup's local answer
ends (its notes go through `staging.SerialWorker`, tested in test_staging)."""

from __future__ import annotations

from raykv.client.reads import chunks_within as _chunks_within
from raykv.keys import ChunkSpan, KeyMaker


def test_chunks_within_a_hit_counts_whole_chunks_and_falls_back_to_a_search():
    spans = KeyMaker(chunk_size=4).keys(list(range(14)))  # 3 whole chunks, tail dropped
    assert [_chunks_within(spans, hit, 4) for hit in (0, 4, 8, 12)] == [0, 1, 2, 3]
    key = spans[0].key
    odd = [ChunkSpan(0, 3, key), ChunkSpan(3, 7, key), ChunkSpan(7, 9, key)]  # uneven
    assert [_chunks_within(odd, hit, 4) for hit in (0, 3, 7, 9)] == [0, 1, 2, 3]
