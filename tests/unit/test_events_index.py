"""BlockIndex and EventSubscriber: a router's view of every replica's blocks from vLLM's
KV events (vLLM's own and raykv's), and the ranking `EventsRouter` makes from it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from raykv.errors import InvalidInputError  # noqa: E402
from raykv.events_index import OWNERSHIP, BlockIndex, EventSubscriber  # noqa: E402

BS = 4  # tokens per block


def stored(hashes, tokens, parent=None, *, raykv=False, extra=None, block_size=BS):
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium="CPU" if raykv else "GPU",
        lora_name=None,
        extra_keys=extra,
        ownership=OWNERSHIP if raykv else None,
    )


def removed(hashes, *, raykv=False):
    return BlockRemoved(
        block_hashes=list(hashes),
        medium="CPU" if raykv else "GPU",
        ownership=OWNERSHIP if raykv else None,
    )


PROMPT = list(range(100, 116))  # 4 blocks


def test_a_replicas_stored_blocks_match_the_same_prompt_and_only_on_that_replica() -> None:
    index = BlockIndex()
    assert index.request_ids(PROMPT) == []  # no block size known yet
    index.apply("r1", [stored([11, 12], PROMPT[:8])])
    index.apply("r1", [stored([13], PROMPT[8:12], parent=12)])
    ids = index.request_ids(PROMPT + [1, 2])  # the partial block is not an id
    assert len(ids) == 4
    assert index.matches(ids, ["r1", "r2"]) == ({"r1": 3, "r2": 0}, 0)
    other = index.request_ids([7] + PROMPT[1:])  # another first token: another chain
    assert index.matches(other, ["r1"]) == ({"r1": 0}, 0)


def test_raykv_blocks_count_for_every_replica_and_chain_on_a_replicas_parent() -> None:
    index = BlockIndex()
    index.apply("r1", [stored([11], PROMPT[:4])])
    # raykv's chunk after the replica's own first block (its parent, from vLLM's event)
    index.apply("r1", [stored([12, 13], PROMPT[4:12], parent=11, raykv=True)])
    ids = index.request_ids(PROMPT)
    assert index.matches(ids, ["r1", "r2"]) == ({"r1": 1, "r2": 0}, 0)  # 11 is not raykv's
    index.apply("r2", [stored([11], PROMPT[:4], raykv=True)])
    assert index.matches(ids, ["r1", "r2"]) == ({"r1": 1, "r2": 0}, 3)
    index.apply("r1", [removed([12], raykv=True)])
    assert index.matches(ids, ["r1", "r2"])[1] == 1
    assert index.sizes() == {"local": 1, "shared": 2}


def test_removed_and_cleared_blocks_stop_matching() -> None:
    index = BlockIndex()
    index.apply("r1", [stored([11, 12, 13], PROMPT[:12]), stored([21], PROMPT[:4], raykv=True)])
    ids = index.request_ids(PROMPT)
    index.apply("r1", [removed([12])])
    assert index.matches(ids, ["r1"]) == ({"r1": 1}, 1)
    index.apply("r1", [AllBlocksCleared()])  # vLLM's pool reset: raykv's blocks stay
    assert index.matches(ids, ["r1"]) == ({"r1": 0}, 1)
    index.forget("r1")
    assert index.matches(ids, ["r1"]) == ({"r1": 0}, 0)
    assert index.counts["removed"] == 1 and index.counts["cleared"] == 1


def test_orphans_salted_blocks_and_other_block_sizes_never_match() -> None:
    index = BlockIndex()
    index.apply("r1", [stored([12], PROMPT[4:8], parent=99)])  # parent never seen
    index.apply("r1", [stored([11], PROMPT[:4], extra=[("tenant-a",)])])  # cache_salt
    index.apply("r1", [stored([31], PROMPT[:8], block_size=8)])
    ids = index.request_ids(PROMPT)
    assert index.matches(ids, ["r1"]) == ({"r1": 0}, 0)
    assert (index.counts["orphans"], index.counts["foreign"]) == (1, 1)
    with pytest.raises(InvalidInputError, match="max_blocks"):
        BlockIndex(max_blocks=0)


def test_multimodal_keys_other_groups_and_skipped_blocks_are_read_safely() -> None:
    index = BlockIndex()
    # msgpack gives a multimodal key's (identifier, offset) pair back as a list
    index.apply("r1", [stored([11], PROMPT[:4], extra=[(["img", 0],)])])
    index.apply("r1", [stored([12], PROMPT[:8])])  # 8 tokens for one block: a skipped one
    sliding = stored([13], PROMPT[:4])
    sliding.group_idx = 1  # another KV cache group (a hybrid model's sliding window)
    index.apply("r1", [sliding, stored([14], PROMPT[:4])])
    gone = removed([14])
    gone.group_idx = 1  # a removal in the other group leaves group 0's block
    index.apply("r1", [gone])
    ids = index.request_ids(PROMPT)
    assert index.matches(ids, ["r1"]) == ({"r1": 1}, 0)  # only block 14 counts
    assert index.counts["foreign"] == 2


def test_each_set_is_bounded() -> None:
    index = BlockIndex(max_blocks=2)
    index.apply("r1", [stored([11, 12, 13], PROMPT[:12])])
    ids = index.request_ids(PROMPT)
    assert index.sizes()["local"] == 2
    assert index.matches(ids, ["r1"]) == ({"r1": 0}, 0)  # the first block was forgotten


def test_another_replicas_traffic_never_makes_a_replica_forget_its_block_hashes() -> None:
    """Each engine hashes apart: one replica's many new blocks must not push another's
    hashes out of the index, or that replica's later removals (and children) go unread
    and the router credits it with blocks it dropped."""
    index = BlockIndex(max_blocks=4)
    index.apply("r1", [stored([11, 12], PROMPT[:8])])
    for start in range(0, 40, 4):  # r2 stores 10 blocks of another prompt
        other = list(range(500 + start, 504 + start))
        index.apply("r2", [stored([1000 + start], other, 996 + start if start else None)])
    ids = index.request_ids(PROMPT)
    assert index.matches(ids, ["r1"])[0] == {"r1": 2}
    index.apply("r1", [stored([13], PROMPT[8:12], 12)])  # its chain goes on
    assert index.matches(ids, ["r1"])[0] == {"r1": 3}
    index.apply("r1", [removed([11])])
    assert index.matches(ids, ["r1"])[0] == {"r1": 0}
    assert 11 not in index._ids["r1"] and 12 in index._ids["r1"]  # a map holds what is held
    index.apply("r1", [stored([13], PROMPT[8:12], 12, raykv=True)])  # raykv holds 13 too
    index.apply("r1", [removed([12, 13])])  # vLLM drops them; raykv's 13 stays known
    assert 12 not in index._ids["r1"] and 13 in index._ids["r1"]


def test_ranking_prefers_own_blocks_and_with_raykv_events_any_replica_that_can_load() -> None:
    from raykv.serve import rank_by_blocks

    index = BlockIndex()
    index.apply("r1", [stored([11], PROMPT[:4])])
    index.apply("r2", [stored([11, 12, 13, 14], PROMPT, raykv=True)])
    ids = index.request_ids(PROMPT)
    queue = {"r1": 0, "r2": 0, "r3": 0}
    with_events = rank_by_blocks(index, ids, ["r1", "r2", "r3"], queue)
    assert with_events[0] == ["r1"]  # all can serve 4 blocks; r1 holds one itself
    busy = {"r1": 9, "r2": 0, "r3": 0}
    assert sorted(rank_by_blocks(index, ids, ["r1", "r2", "r3"], busy)[0]) == ["r2", "r3"]
    # without raykv's events: 1 of 4 blocks is below half the prompt: power of two
    blind = rank_by_blocks(index, ids, ["r1", "r2", "r3"], queue, raykv_events=False)
    assert len(blind[0]) == 2


def test_blocks_just_routed_count_for_their_replica_until_they_expire() -> None:
    from raykv.serve import RecentBlocks, rank_by_blocks

    index = BlockIndex()
    index.apply("r1", [stored([11], PROMPT[:4])])  # teaches the block size
    ids = index.request_ids(PROMPT)
    recent = RecentBlocks(ttl_s=10.0, capacity=3)
    recent.add(ids, now=100.0)
    assert recent.covered(ids, now=105.0) == 0  # the first id fell out (capacity 3)
    recent.add(ids[:2], now=100.0)
    assert recent.covered(ids, now=105.0) == 2 and recent.covered(ids, now=111.0) == 0
    fresh = RecentBlocks()
    fresh.add(ids)
    queue = {"r1": 0, "r2": 0}
    # r2 was just sent the whole prompt: it ranks first before its events arrive
    assert rank_by_blocks(index, ids, ["r1", "r2"], queue, routed={"r2": fresh})[0] == ["r2"]
    assert len(rank_by_blocks(index, ids, ["r1", "r2"], queue)[0]) == 2  # 1 of 4: no match


def test_a_late_subscriber_replays_what_a_real_vllm_publisher_sent_before(monkeypatch) -> None:
    """vLLM's publisher bound on free ports (as `EventsServer` asks); batches sent before
    the router subscribed arrive through the replay socket, later ones through PUB,
    each applied once and in order."""
    from raykv.integrations.serve_llm import bound_endpoint
    from raykv.serve import events_endpoints

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    index = BlockIndex()
    subscriber = EventSubscriber(index)
    try:
        client = SimpleNamespace(get_kv_event_sources=lambda: {0: publisher._publisher_config})
        advertised = bound_endpoint(client)
        assert advertised is not None and set(advertised) == {"endpoint", "replay"}
        assert advertised["endpoint"].startswith("tcp://127.0.0.1:")
        # published before anyone subscribed: a PUB socket alone would drop these
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([11], PROMPT[:4])]))
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([12], PROMPT[4:8], 11)]))
        time.sleep(0.5)  # the publisher's thread has sent them
        subscriber.watch({"r1": events_endpoints(advertised)})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and index.sizes()["local"] < 2:
            time.sleep(0.05)
        ids = index.request_ids(PROMPT)
        assert index.matches(ids, ["r1"]) == ({"r1": 2}, 0)
        assert subscriber.counts["replayed"] == 2
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([13], PROMPT[8:12], 12)]))
        while time.monotonic() < deadline and index.sizes()["local"] < 3:
            time.sleep(0.05)
        assert index.matches(ids, ["r1"]) == ({"r1": 3}, 0)
        assert subscriber.counts["batches"] == 3  # none applied twice
        assert index.counts["orphans"] == 0
        subscriber.watch({})  # the replica went away: forgotten
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and index.sizes()["local"]:
            time.sleep(0.05)
        assert index.sizes()["local"] == 0
        assert subscriber.counts["undecodable"] == 0
    finally:
        subscriber.close()
        publisher.shutdown()


def test_advertised_endpoints_are_read_in_either_form() -> None:
    from raykv.serve import events_endpoints

    assert events_endpoints("tcp://h:1") == ("tcp://h:1", None)
    assert events_endpoints({"endpoint": "tcp://h:1", "replay": "tcp://h:2"}) == (
        "tcp://h:1",
        "tcp://h:2",
    )
    assert events_endpoints({"endpoint": "tcp://h:1", "replay": 5}) == ("tcp://h:1", None)
    assert events_endpoints(None) is None and events_endpoints({"replay": "x"}) is None


def test_a_malformed_endpoint_is_refused_and_the_subscriber_keeps_running() -> None:
    subscriber = EventSubscriber(BlockIndex())
    try:
        subscriber.watch({"bad": "not-an-endpoint"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not subscriber.counts["refused"]:
            time.sleep(0.05)
        assert subscriber.counts["refused"] == 1
        assert subscriber._thread.is_alive()
    finally:
        subscriber.close()


def test_an_engine_client_without_sources_gives_no_endpoint() -> None:
    from raykv.integrations.serve_llm import bound_endpoint

    assert bound_endpoint(None) is None
    assert bound_endpoint(SimpleNamespace(get_kv_event_sources=lambda: {})) is None


def test_replicas_redeployed_with_another_block_size_are_indexed() -> None:
    """The first event fixed the block size for the router's life: after a redeploy
    with another block size every event counted as foreign, routing by load for good."""
    index = BlockIndex()
    index.apply("old", [stored([11], PROMPT[:4])])
    index.forget("old")
    index.apply("new", [stored([21], PROMPT[:8], block_size=8)])
    assert index.counts["foreign"] == 0 and len(index.request_ids(PROMPT)) == 2
    assert index.matches(index.request_ids(PROMPT), ["new"]) == ({"new": 1}, 0)


def test_a_subscriber_that_fails_forgets_its_feeds_and_starts_over(monkeypatch) -> None:
    """Any unexpected error ended the thread for good, its sets frozen: replicas kept
    credit for blocks they had since evicted."""
    from raykv.integrations.serve_llm import bound_endpoint
    from raykv.serve import events_endpoints

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    real, fail = EventSubscriber._receive, threading.Event()

    def fail_once(self, feed, frames, replay):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("a socket error nobody expected")
        return real(self, feed, frames, replay)

    monkeypatch.setattr(EventSubscriber, "_receive", fail_once)
    index = BlockIndex()
    subscriber = EventSubscriber(index)
    try:
        client = SimpleNamespace(get_kv_event_sources=lambda: {0: publisher._publisher_config})
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([11], PROMPT[:4])]))
        time.sleep(0.5)
        subscriber.watch({"r1": events_endpoints(bound_endpoint(client))})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and index.sizes()["local"] < 1:
            time.sleep(0.05)
        forgotten = []
        monkeypatch.setattr(index, "forget", lambda source: forgotten.append(source))
        fail.set()
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([12], PROMPT[4:8], 11)]))
        while time.monotonic() < deadline and not subscriber.counts["restarts"]:
            time.sleep(0.05)
        assert subscriber.counts["restarts"] == 1 and forgotten == ["r1"]
        monkeypatch.undo()  # a working _receive and forget again
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([13], PROMPT[8:12], 12)]))
        while time.monotonic() < deadline and index.sizes()["local"] < 3:
            time.sleep(0.05)
        assert subscriber._thread.is_alive()
        assert index.matches(index.request_ids(PROMPT), ["r1"]) == ({"r1": 3}, 0)
    finally:
        subscriber.close()
        publisher.shutdown()
