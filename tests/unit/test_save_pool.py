"""The pool of warm save buffers (the vLLM connector's saves): reused by size, bounded."""

from __future__ import annotations

from raykv.client.staging import BufferPool


def test_a_given_back_buffer_is_taken_again_for_the_same_size():
    pool = BufferPool(1 << 20)
    a = pool.take(4096)
    pool.give(a)
    assert pool.held == 4096
    assert pool.take(4096) is a and pool.held == 0
    b = pool.take(4096)  # none kept: a new one
    assert b is not a and b.nbytes == 4096
    assert pool.take(8192) is not a


def test_the_pool_keeps_no_more_than_its_capacity():
    pool = BufferPool(10_000)
    bufs = [pool.take(4096) for _ in range(3)]
    for buf in bufs:
        pool.give(buf)
    assert pool.held == 8192  # the third did not fit
    assert {id(pool.take(4096)), id(pool.take(4096))} == {id(bufs[0]), id(bufs[1])}
    assert pool.take(4096) is not bufs[2]
