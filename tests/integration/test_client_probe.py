"""`client_remote_probe` (the default): a lookup asks the `ray://` server itself, beside
the manager's `lookup_local`, and joins the answers. Same hits as the manager asking,
one round trip; the manager still learns what the server held and counts the lookup; a
dead or slow server costs the server's hits, never the lookup."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import ray
import torch
from raykv_testing import kv_for

import raykv
from raykv.actors.factory import shutdown_namespace
from raykv.client.probe import ServerProbe
from raykv.payload import tensor_to_buffer

pytestmark = pytest.mark.usefixtures("ray_session")

C = 16
LAYERS, HIDDEN = 2, 16


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture
def cache_fields():
    ns = f"t-probe-{uuid.uuid4().hex[:8]}"
    name = f"kv-{ns}"
    fields = dict(
        namespace=ns,
        chunk_size=C,
        kv_dtype="float16",
        max_local_cpu_size=0.01,
        remote_url=f"ray://{name}",
        max_remote_size=0.01,
        lookup_timeout_ms=2000,
    )
    try:
        yield fields, name
    finally:
        shutdown_namespace(ns)
        try:
            ray.kill(ray.get_actor(name, namespace=ns))
        except ValueError:
            pass


def server_of(name: str, ns: str):
    """The KVServer the manager created at start-up."""
    found = []

    def up() -> bool:
        try:
            found.append(ray.get_actor(name, namespace=ns))
        except ValueError:
            return False
        return True

    wait_until(up)
    return found[-1]


def write_to_server(cache, server, tokens, kv, first: int, last: int) -> None:
    """Chunks [first, last) of `tokens` put straight into the server: what another
    instance's writes look like to this cache's manager (its index does not know them)."""
    spans = cache.spans(tokens)[first:last]
    bufs = [tensor_to_buffer(kv[:, :, s.start : s.end, :].contiguous()) for s in spans]
    ref = ray.put([b for b, _ in bufs])
    ack = ray.get(server.put.remote([s.key for s in spans], [m for _, m in bufs], [ref]))
    assert len(ack.accepted) == len(spans), ack


def test_a_probing_client_finds_what_only_the_server_holds_and_the_manager_learns_it(
    cache_fields,
):
    fields, name = cache_fields
    tokens = np.random.default_rng(1).integers(0, 30000, 6 * C)
    kv = kv_for(tokens, LAYERS, HIDDEN)
    with (
        raykv.connect(**fields, client_remote_probe=True) as probing,
        raykv.connect(**fields, client_remote_probe=False) as plain,
    ):
        server = server_of(name, fields["namespace"])
        assert probing.store(tokens[: 2 * C], kv[:, :, : 2 * C]) == 2 * C
        write_to_server(probing, server, tokens, kv, 2, 5)  # chunk 5 is nowhere
        before = probing.stats()
        probes = ray.get(server.stats.remote())["probes"]
        assert probing.lookup(tokens) == 5 * C
        assert probing.stats()["client"]["remote_probes_sent"] == 1
        assert ray.get(server.stats.remote())["probes"] == probes + 1  # the manager did not ask
        # The manager indexed the server's chunks and counted the lookup (no wait: poll).
        keys = {s.key for s in probing.spans(tokens)[2:5]}
        manager = probing._manager
        wait_until(lambda: keys <= set(ray.get(manager.indexed_keys.remote("remote"))))
        after = probing.stats()
        assert after["lookups"] == before["lookups"] + 1
        assert after["hit_tokens"] == before["hit_tokens"] + 5 * C
        assert after["miss_tokens"] == before["miss_tokens"] + C
        # The same answer from a client that lets the manager ask, and the same bytes back.
        probes = ray.get(server.stats.remote())["probes"]
        assert plain.lookup(tokens) == 5 * C
        assert "remote_probes_sent" not in plain.stats().get("client", {})
        # One call at the server: the manager's, for chunk 5, which no index knows.
        assert ray.get(server.stats.remote())["probes"] == probes + 1
        dest = torch.zeros_like(kv)
        hit = probing.retrieve(tokens, dest)
        assert hit.sum() == 5 * C and torch.equal(dest[:, :, : 5 * C], kv[:, :, : 5 * C])
        # Pinned lookups take the same way; a prefix the local tiers hold needs no wait.
        assert probing.lookup(tokens, pin=True) == 5 * C
        assert probing.retrieve(tokens, dest).sum() == 5 * C
        assert probing.lookup(tokens[: 2 * C]) == 2 * C


def test_clients_probe_by_default_and_a_retrieve_right_after_needs_no_note(cache_fields):
    # The default: a lookup asks the server itself. The retrieve that follows at once
    # (as an engine's does) must find the server's chunks although the note that tells
    # the manager about them may not have arrived: the manager's get asks the server
    # for keys no index knows.
    fields, name = cache_fields
    tokens = np.random.default_rng(5).integers(0, 30000, 5 * C)
    kv = kv_for(tokens, LAYERS, HIDDEN)
    with raykv.connect(**fields) as cache:
        assert cache.config.client_remote_probe
        server = server_of(name, fields["namespace"])
        assert cache.store(tokens[:C], kv[:, :, :C]) == C
        write_to_server(cache, server, tokens, kv, 1, 4)  # chunk 4 is nowhere
        notes = cache._probe.notes
        release = __import__("threading").Event()
        notes.submit(release.wait)  # hold the note back until the retrieve is done
        try:
            assert cache.lookup(tokens) == 4 * C
            assert cache.stats()["client"]["remote_probes_sent"] == 1
            dest = torch.zeros_like(kv)
            hit = cache.retrieve(tokens, dest)
            assert hit.sum() == 4 * C and torch.equal(dest[:, :, : 4 * C], kv[:, :, : 4 * C])
        finally:
            release.set()
        assert notes.drain(10)


def test_a_dead_server_costs_a_probing_client_the_servers_hits_never_the_lookup(cache_fields):
    fields, name = cache_fields
    tokens = np.random.default_rng(2).integers(0, 30000, 4 * C)
    kv = kv_for(tokens, LAYERS, HIDDEN)
    with raykv.connect(**fields, client_remote_probe=True) as probing:
        server = server_of(name, fields["namespace"])
        assert probing.store(tokens[: 2 * C], kv[:, :, : 2 * C]) == 2 * C
        ray.kill(server, no_restart=True)
        for seed in (3, 4):  # prefixes the local tiers hold, then unknown chunks
            tail = np.random.default_rng(seed).integers(0, 30000, 2 * C)
            t0 = time.monotonic()
            assert probing.lookup(np.concatenate([tokens[: 2 * C], tail])) == 2 * C
            assert time.monotonic() - t0 < 3 * fields["lookup_timeout_ms"] / 1000
        client = probing.stats()["client"]
        # The first probe failed; the second lookup went through the manager (back-off).
        assert client["remote_probes_failed"] >= 1 and client["remote_probes_sent"] <= 2


@ray.remote(num_cpus=0)
class FakeServer:
    """A `contains` that answers late or wrongly, for `ServerProbe`."""

    def __init__(self, delay: float, answer: object) -> None:
        self.delay, self.answer = delay, answer

    def contains(self, keys: bytes) -> object:
        time.sleep(self.delay)
        return self.answer


@pytest.mark.parametrize("delay, answer", [(3.0, [True]), (0.0, "not a list"), (0.0, [True] * 5)])
def test_a_late_or_malformed_server_answer_is_no_answer_and_backs_the_probe_off(
    delay, answer, monkeypatch
):
    import raykv.actors.common

    # FakeServer stands in for a misbehaving KVServer: let it past the class check.
    monkeypatch.setattr(raykv.actors.common, "check_actor_class", lambda handle, *a: handle)
    ns = f"t-fake-{uuid.uuid4().hex[:8]}"
    server = FakeServer.options(name="fake", namespace=ns).remote(delay, answer)
    try:
        probe = ServerProbe("fake", ns)
        ref = probe.send(b"keys")
        assert ref is not None
        assert probe.answer(ref, 1, timeout=0.5) is None
        assert probe.failed == 1 and probe.send(b"keys") is None  # backing off
    finally:
        ray.kill(server)


def test_an_actor_of_another_class_under_the_server_name_is_never_probed():
    ns = f"t-fake-{uuid.uuid4().hex[:8]}"
    squatter = FakeServer.options(name="fake", namespace=ns).remote(0.0, [True])
    try:
        probe = ServerProbe("fake", ns)
        assert probe.send(b"keys") is None  # refused: the lookup asks the manager
        assert probe.failed == 1 and probe.sent == 0
    finally:
        ray.kill(squatter)


def test_a_missing_server_is_no_probe_and_backs_off():
    probe = ServerProbe(f"none-{uuid.uuid4().hex[:8]}", "t-nowhere")
    assert probe.send(b"keys") is None
    assert probe.failed == 1 and probe.sent == 0
