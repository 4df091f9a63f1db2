"""A real Llama model served through raykv: the warm path equals the cold path, from every tier.

Two prompts share a prefix and differ in their suffix. Prompt A is generated first and
stores the prefix's KV; prompt B then loads that KV from raykv into the model's own
cache and prefills only its suffix (the warm path). Its first-token logits must equal a
full prefill of B (the cold path) within fp32 tolerance, ATOL = 1e-4 absolute, and its
greedy generation must be the same tokens. (Measured on CPU with SDPA: bit-identical for
the small model, max |diff| 8.6e-7 for the default one, whose projections of 192 and
1216 rows may take different matmul kernels.) This must hold wherever the prefix
comes from: the CPU tier, the disk tier after the CPU copy is removed, and the remote
tier (`redis://` and a `ray://` KVServer) after the CPU and disk copies are removed.
The retrieve reports the tier each hit came from, so every case checks that the hits
came from the tier under test.

Cases: a 1k prefix on the default demo model, and a 4k prefix on a smaller model of the
same architecture (fp32 both) to keep the 4k prefills cheap on a 2-core box.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch

pytest.importorskip("transformers")

from raykv_testing import RedisServer  # noqa: E402

import raykv  # noqa: E402
from raykv.actors.factory import shutdown_namespace  # noqa: E402
from raykv.actors.kv_server import get_or_create_kv_server  # noqa: E402
from raykv.config import RayKVConfig  # noqa: E402
from raykv.demo.gpu_worker import ModelWorker, create_gpu_worker  # noqa: E402
from raykv.demo.model import greedy_generate, prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

CHUNK = 256
SUFFIX = 192  # not a whole chunk: the trailing partial chunk is never stored
NEW_TOKENS = 12
ATOL = 1e-4
# 4 layers, hidden 256, 4 query heads, 2 KV heads of 64: a quarter of the demo model's work.
SMALL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4)


@dataclass(frozen=True)
class Case:
    name: str
    prefix_len: int
    model: dict[str, Any]


CASES = [Case("1k-demo", 1024, {}), Case("4k-small", 4096, SMALL)]


@dataclass
class Prompts:
    """Prompt A stores the shared prefix; prompt B is the one served warm and cold."""

    prefix_len: int
    a: torch.Tensor
    b: torch.Tensor


def make_prompts(prefix_len: int, seed: int = 0) -> Prompts:
    g = torch.Generator().manual_seed(seed)
    prefix, sa, sb = (
        torch.randint(0, 32000, (n,), generator=g) for n in (prefix_len, SUFFIX, SUFFIX)
    )
    return Prompts(prefix_len, torch.cat([prefix, sa]), torch.cat([prefix, sb]))


def config(namespace: str, **kw: Any) -> RayKVConfig:
    return RayKVConfig(
        namespace=namespace,
        model_name="tiers-demo",
        kv_dtype="float32",
        chunk_size=CHUNK,
        max_local_cpu_size=0.25,
        lookup_timeout_ms=5000,
        **kw,
    )


def assert_same_as_cold(
    warm: dict[str, Any], cold_logits: torch.Tensor, cold_gen: list[int]
) -> None:
    diff = (warm["logits"] - cold_logits).abs().max().item()
    assert diff <= ATOL, f"warm vs cold first-token logits differ by {diff:.3g} > {ATOL}"
    assert warm["tokens"] == cold_gen


@dataclass
class Served:
    """One case: its prompts, the cold reference for prompt B, a worker per remote kind."""

    case: Case
    prompts: Prompts
    cold_logits: torch.Tensor
    cold_gen: list[int]
    workers: dict[str, ModelWorker]


@dataclass(frozen=True)
class Namespaces:
    """Two cache namespaces shared by the module (actor start-ups are the slow part)."""

    redis: RayKVConfig  # CPU + disk + redis://
    ray: RayKVConfig  # CPU + ray://KVServer


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    """A redis-server, a KVServer and the two namespaces; all stopped at the end."""
    tag = uuid.uuid4().hex[:8]
    server_name = f"t-mt-kv-{tag}"
    redis_server = RedisServer(tmp_path_factory.mktemp("redis"))
    redis_server.start()
    disk = tmp_path_factory.mktemp("disk")
    spaces = Namespaces(
        redis=config(
            f"t-mt-redis-{tag}",
            local_disk=str(disk),
            max_local_disk_size=0.25,
            remote_url=redis_server.url,
        ),
        ray=config(f"t-mt-ray-{tag}", remote_url=f"ray://{server_name}", max_remote_size=0.25),
    )
    try:
        # Start the KVServer first: calls made while it boots would time out (as misses).
        ray.get(get_or_create_kv_server(server_name, spaces.ray).incarnation.remote())
        yield spaces
    finally:
        for cfg in (spaces.redis, spaces.ray):
            shutdown_namespace(cfg.namespace)
        try:
            ray.kill(ray.get_actor(server_name, namespace=spaces.ray.namespace))
        except ValueError:
            pass
        redis_server.stop()


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def served(request: pytest.FixtureRequest, namespaces: Namespaces) -> Served:
    """In-process workers of one case (its own `model_name`), one per namespace.

    Each has generated prompt A once, so the shared prefix is stored in all its tiers.
    """
    case: Case = request.param
    workers = {
        kind: ModelWorker(cfg.replace(model_name=case.name), seed=0, **case.model)
        for kind, cfg in (("redis", namespaces.redis), ("ray", namespaces.ray))
    }
    prompts = make_prompts(case.prefix_len)
    # The cold path, as `generate` runs it but with no cache: full prefill, greedy decode.
    model = workers["redis"].model
    logits, cache = prefill(model, prompts.b, logits_to_keep=1)
    first = int(logits[-1].argmax())
    rest = greedy_generate(
        model, torch.cat([prompts.b, torch.tensor([first])]), NEW_TOKENS - 1, cache
    )
    for worker in workers.values():
        out = worker.generate(prompts.a, max_new_tokens=1)
        assert (out["hit_tokens"], out["stored_tokens"]) == (0, case.prefix_len)
        assert worker.kv.flush()
    return Served(case, prompts, logits[-1].float().cpu(), [first, *rest], workers)


def remove(worker: ModelWorker, tokens: torch.Tensor, tiers: list[str]) -> None:
    """Drop the prompt's stored chunks from `tiers`, after the lower tiers have them."""
    assert worker.kv.flush()
    keys = [s.key for s in worker.kv.spans(tokens)]
    ray.get(worker.kv._manager.remove.remote(keys, tiers))


def serve_warm(served: Served, kind: str) -> dict[str, Any]:
    out = served.workers[kind].generate(served.prompts.b, NEW_TOKENS, return_logits=True)
    assert out["hit_tokens"] == served.case.prefix_len
    assert out["stored_tokens"] == 0  # B's only new tokens form a partial chunk
    return out


def test_warm_path_from_cpu_equals_cold_prefill(served: Served) -> None:
    out = serve_warm(served, "redis")
    assert out["hit_tiers"] == {"cpu": served.case.prefix_len}
    assert_same_as_cold(out, served.cold_logits, served.cold_gen)


def test_warm_path_from_disk_after_cpu_removal_equals_cold_prefill(served: Served) -> None:
    worker = served.workers["redis"]
    remove(worker, served.prompts.a, ["cpu"])
    out = serve_warm(served, "redis")
    assert out["hit_tiers"] == {"disk": served.case.prefix_len}
    assert_same_as_cold(out, served.cold_logits, served.cold_gen)


@pytest.mark.parametrize("kind", ["redis", "ray"])
def test_warm_path_from_remote_only_equals_cold_prefill(served: Served, kind: str) -> None:
    worker = served.workers[kind]
    remove(worker, served.prompts.a, ["cpu", "disk"] if worker.kv.config.local_disk else ["cpu"])
    assert worker.kv.lookup(served.prompts.b[: served.case.prefix_len]) == served.case.prefix_len
    out = serve_warm(served, kind)
    assert out["hit_tiers"] == {"remote": served.case.prefix_len}
    assert_same_as_cold(out, served.cold_logits, served.cold_gen)


def test_wait_sources_names_the_tier_a_prefetch_found_the_prefix_in(served: Served) -> None:
    """`wait_sources` (the vLLM connector's hit sources): where the prefetch found the
    prefix, before it promoted it into CPU."""
    worker, n = served.workers["redis"], served.case.prefix_len
    remove(worker, served.prompts.a, ["cpu", "disk"])
    for where in ("remote", "cpu"):  # the first prefetch promoted it into CPU
        lookup_id = worker.kv.prefetch(served.prompts.a)
        assert worker.kv.wait_sources(lookup_id, timeout=10) == (n, [(where, n)])
        worker.kv.unpin(lookup_id)


def test_fetch_is_a_prefetch_and_its_wait_in_one_call_and_a_miss_leaves_no_pins(
    served: Served,
) -> None:
    """`fetch_spans` (the vLLM connector's lookup): one manager round trip; a hit stays
    pinned under its id until unpinned, a miss leaves no open lookup behind."""
    worker, n = served.workers["redis"], served.case.prefix_len
    remove(worker, served.prompts.a, ["cpu", "disk"])
    kv, manager = worker.kv, worker.kv._manager
    spans = kv.spans(served.prompts.a)
    assert kv.fetch_spans(spans, "fetch-hit", timeout=10) == (n, [("remote", n)])
    open_ids = ray.get(manager.stats.remote())["open_lookups"]
    assert open_ids >= 1
    kv.unpin("fetch-hit")
    assert ray.get(manager.stats.remote())["open_lookups"] == open_ids - 1
    other = kv.spans(torch.arange(10_000, 10_000 + n))
    assert kv.fetch_spans(other, "fetch-miss", timeout=10) == (0, [])
    assert ray.get(manager.stats.remote())["open_lookups"] == open_ids - 1
    assert kv.fetch_spans([], "fetch-empty") == (0, [])


def test_gpu_worker_actor_warm_path_from_cpu_equals_its_cold_path(namespaces: Namespaces) -> None:
    """The same through the `GPUWorker` actor; cold and warm both run in the actor, so
    they use the same torch threads (a thread count can change fp32 sums' rounding)."""
    cfg = namespaces.ray.replace(model_name="actor-small")
    prompts = make_prompts(1024, seed=1)
    worker = create_gpu_worker(cfg, seed=0, **SMALL)
    try:
        first = ray.get(worker.generate.remote(prompts.a, 1))
        assert (first["hit_tokens"], first["stored_tokens"]) == (0, 1024)
        warm = ray.get(worker.generate.remote(prompts.b, NEW_TOKENS, return_logits=True))
        assert warm["hit_tokens"] == 1024 and warm["hit_tiers"] == {"cpu": 1024}
        with raykv.connect(cfg) as kv:
            assert kv.flush()
            ray.get(kv._manager.remove.remote([s.key for s in kv.spans(prompts.a)]))
        cold = ray.get(worker.generate.remote(prompts.b, NEW_TOKENS, return_logits=True))
        assert cold["hit_tokens"] == 0 and cold["hit_tiers"] == {}
        assert_same_as_cold(warm, cold["logits"], cold["tokens"])
    finally:
        ray.kill(worker)
