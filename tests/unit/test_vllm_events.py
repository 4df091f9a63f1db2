"""KVEvents: raykv's CPU-tier blocks as vLLM KV events, from the manager's CPU log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from raykv.integrations.vllm_events import OWNERSHIP, KVEvents  # noqa: E402

BLOCK, CHUNK = 2, 4  # two blocks per chunk
IDENTITY = ("model", 1, 0, "bfloat16")


def ext(hashes: list[bytes]) -> list[Any]:
    """Block hashes as vLLM's events carry them (ints by default)."""
    return [maybe_convert_block_hash(h) for h in hashes]


@dataclass
class FakeRequest:
    """What the events read of a vLLM Request: block hashes, token ids, LoRA."""

    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        n = len(self.all_token_ids) // BLOCK
        self.block_hashes = [bytes([i + 1]) * 8 for i in range(n)]


class FakeCache:
    """`KVCache.cpu_events` scripted: each poll answers the next queued change list."""

    def __init__(self) -> None:
        self.replies: list[Any] = []
        self.cursor = 0
        self.present: list[str] | None = None  # `cpu_keys`' answer (None: a fault)
        self.snapshots = 0

    def cpu_keys(self, identity):
        assert identity == IDENTITY
        self.snapshots += 1
        return self.present

    def cpu_events(self, cursor, identity):
        assert identity == IDENTITY
        self.cursor += 1
        if cursor is None:
            return ("log", self.cursor, 0), None
        return ("log", self.cursor, 0), self.replies.pop(0) if self.replies else []


@pytest.fixture
def events():
    cache = FakeCache()
    ev = KVEvents(cache, IDENTITY, BLOCK, CHUNK, poll_s=3600)
    yield ev, cache
    ev.close()


def poll(ev: KVEvents, cache: FakeCache, changes: Any) -> list:
    cache.replies.append(changes)
    ev._poll()
    return ev.take()


def test_a_chunk_is_reported_stored_when_the_cpu_tier_admits_it_and_removed_when_it_leaves(
    events,
):
    ev, cache = events
    req = FakeRequest(list(range(100, 110)))  # 10 tokens: 2 whole chunks, 5 blocks
    ev.planned(req, ["k0", "k1"], 0)
    assert ev.take() == []  # planned is not stored
    got = poll(ev, cache, [(True, "k0"), (True, "k1"), (True, "not-ours")])
    assert [type(e) for e in got] == [BlockStored, BlockStored]
    first, second = got
    assert first.block_hashes == ext(req.block_hashes[0:2]) and first.parent_block_hash is None
    assert second.block_hashes == ext(req.block_hashes[2:4])
    assert second.parent_block_hash == ext(req.block_hashes[1 : 1 + 1])[0]
    assert second.token_ids == list(range(104, 108)) and second.block_size == BLOCK
    assert (second.medium, second.ownership, second.group_idx) == ("CPU", OWNERSHIP, 0)
    (removed,) = poll(ev, cache, [(False, "k1"), (False, "never-stored")])
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == ext(req.block_hashes[2:4])
    assert poll(ev, cache, [(False, "k1")]) == []  # reported once


def test_a_save_the_tier_never_admitted_is_never_reported(events):
    ev, cache = events
    req = FakeRequest(list(range(8)))
    ev.planned(req, ["k0", "k1"], 0)
    assert poll(ev, cache, [(True, "k1")])[0].block_hashes == ext(req.block_hashes[2:4])
    assert poll(ev, cache, [(False, "k0")]) == []


def test_a_chunk_stored_from_the_middle_of_a_request_names_its_parent(events):
    ev, cache = events
    req = FakeRequest(list(range(12)))
    ev.planned(req, ["k2"], 2 * CHUNK)  # chunks 0-1 were a hit
    (stored,) = poll(ev, cache, [(True, "k2")])
    assert stored.block_hashes == ext(req.block_hashes[4:6])
    assert stored.parent_block_hash == ext(req.block_hashes[3 : 3 + 1])[0]
    assert stored.token_ids == list(range(8, 12))


def test_when_the_log_cannot_say_the_events_follow_the_cpu_tiers_keys(events):
    """A CPU store restarted (its index rebuilt from a snapshot, nothing logged): what was
    reported and is gone is removed, and a planned chunk the tier took meanwhile, which
    the log never recorded, is reported stored (the first poll reads no snapshot)."""
    ev, cache = events
    assert cache.snapshots == 0
    req = FakeRequest(list(range(12)))
    ev.planned(req, ["k0", "k1", "k2"], 0)
    poll(ev, cache, [(True, "k0"), (True, "k1")])
    cache.present = ["k1", "k2", "not-ours"]
    removed, stored = poll(ev, cache, None)
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == ext(req.block_hashes[0:2])
    assert isinstance(stored, BlockStored) and stored.block_hashes == ext(req.block_hashes[4:6])
    assert cache.snapshots == 1
    (gone,) = poll(ev, cache, [(False, "k2")])  # the log goes on from the cursor
    assert gone.block_hashes == ext(req.block_hashes[4:6])


def test_when_neither_log_nor_snapshot_can_say_nothing_changes_until_the_snapshot_can(events):
    """The log cannot say and the snapshot of the CPU tier's keys fails: nothing is
    reported and the next poll tries again (reporting every held block removed meant it
    was never advertised again while the tier still held it)."""
    ev, cache = events
    req = FakeRequest(list(range(8)))
    ev.planned(req, ["k0", "k1"], 0)
    poll(ev, cache, [(True, "k0"), (True, "k1")])
    assert poll(ev, cache, None) == []  # cache.present is None: the snapshot failed too
    cache.present = ["k1"]
    (removed,) = poll(ev, cache, None)  # the log still cannot say; the snapshot can
    assert removed.block_hashes == ext(req.block_hashes[0:2])
    assert poll(ev, cache, [(False, "k1")])[0].block_hashes == ext(req.block_hashes[2:4])


def test_past_max_held_the_oldest_are_reported_removed():
    cache = FakeCache()
    ev = KVEvents(cache, IDENTITY, BLOCK, CHUNK, poll_s=3600, max_held=2)
    try:
        req = FakeRequest(list(range(12)))
        ev.planned(req, ["k0", "k1", "k2"], 0)
        cache.replies.append([(True, "k1"), (True, "k2")])  # k0 was forgotten unplanned
        ev._poll()
        assert len(ev.take()) == 2
        ev.planned(FakeRequest(list(range(50, 54))), ["k9"], 0)
        cache.replies.append([(True, "k9")])
        ev._poll()
        stored, removed = ev.take()
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        assert removed.block_hashes == ext(req.block_hashes[2:4])  # k1, the oldest reported
    finally:
        ev.close()


def test_a_fault_while_polling_keeps_what_was_reported(events):
    ev, cache = events
    req = FakeRequest(list(range(4)))
    ev.planned(req, ["k0"], 0)
    poll(ev, cache, [(True, "k0")])
    cache.cpu_events = lambda *a: None  # the client's answer to a fault
    ev._poll()
    assert ev.take() == []


def test_a_salted_requests_blocks_carry_its_extra_keys_as_vllms_own_events_do(events):
    """A router indexes a block by its tokens and extras (vLLM's events carry the LoRA
    name, multimodal ids, cache salt per block): raykv's events for the same blocks carry
    the same, or the router would take a tenant's blocks for the unsalted prompt's."""
    ev, cache = events
    req = FakeRequest(list(range(12)), cache_salt="tenant-a")
    ev.planned(req, ["k0", "k1"], 0)
    first, second = poll(ev, cache, [(True, "k0"), (True, "k1")])
    assert first.extra_keys == [("tenant-a",), None] and second.extra_keys == [None, None]


def test_a_malformed_reply_does_not_end_the_polling_thread():
    """The poller ran unguarded past the manager call: one reply of an unexpected shape
    (a manager of another version) ended the thread, and no event came again."""
    import threading

    class Odd(FakeCache):
        def cpu_events(self, cursor, identity):
            self.cursor += 1
            if cursor is None:
                return ("log", self.cursor, 0), None
            if self.cursor == 2:
                return ("log", self.cursor, 0), 7  # not a list of changes
            return ("log", self.cursor, 0), []

    cache = Odd()
    ev = KVEvents(cache, IDENTITY, BLOCK, CHUNK, poll_s=0.01)
    try:
        deadline = threading.Event()
        for _ in range(300):
            if cache.cursor >= 4:
                break
            deadline.wait(0.01)
        assert cache.cursor >= 4  # it polled again after the malformed reply
    finally:
        ev.close()


def test_saves_planned_before_a_first_poll_answered_are_reported_once_it_does():
    """The first polls failed (the manager slow or down) while saves were planned: the
    first answer only set the cursor, and those chunks were never advertised."""
    cache = FakeCache()
    answer = cache.cpu_events
    cache.cpu_events = lambda *a: None  # no answer yet
    ev = KVEvents(cache, IDENTITY, BLOCK, CHUNK, poll_s=3600)
    try:
        req = FakeRequest(list(range(8)))
        ev.planned(req, ["k0", "k1"], 0)
        cache.cpu_events, cache.present = answer, ["k0", "k1"]
        ev._poll()
        assert [type(e) for e in ev.take()] == [BlockStored, BlockStored]
    finally:
        ev.close()
