"""raykv quickstart: store a prompt's KV once, load it back from CPU and from disk.

    python examples/quickstart.py

Starts a local Ray, connects raykv with a small CPU tier and a disk tier, stores the
KV of a 4096-token prompt (16 chunks of 256 tokens), then retrieves it: first from
the CPU tier (Ray's object store), then, after other prompts pushed it out of CPU,
from disk. Every retrieved byte is checked against what was stored.
"""

from __future__ import annotations

import os
import tempfile
import time

# Keep this demo's Ray on 127.0.0.1 and quiet.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

import raykv  # noqa: E402

NUM_LAYERS, HIDDEN, PROMPT_TOKENS = 8, 256, 4096  # 32 MiB of fp16 KV


def fake_kv(seed: int) -> torch.Tensor:
    """Stand-in for a model's KV: [2 (K,V), layers, tokens, kv_heads * head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, NUM_LAYERS, PROMPT_TOKENS, HIDDEN, generator=g).half()


def timed(fn):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1000


def main() -> None:
    # address="local": always a fresh embedded Ray, never a cluster started elsewhere.
    ray.init(
        address="local", include_dashboard=False, log_to_driver=False, object_store_memory=512 << 20
    )
    with tempfile.TemporaryDirectory() as disk_dir:
        kv, ms = timed(
            lambda: raykv.connect(
                namespace="raykv-quickstart",
                kv_dtype="float16",
                max_local_cpu_size=0.05,  # 50 MiB of CPU tier: room for one prompt only
                local_disk=disk_dir,
                max_local_disk_size=1.0,
            )
        )
        print(f"connect  (starts the cache's actors) in {ms:7.1f} ms")
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 32000, PROMPT_TOKENS)
        kv_tensor = fake_kv(0)

        stored, ms = timed(lambda: kv.store(prompt, kv_tensor))
        print(f"store    {stored:5d} tokens in {ms:7.1f} ms  ({kv_tensor.nbytes >> 20} MiB of KV)")
        hit, ms = timed(lambda: kv.lookup(prompt))
        print(f"lookup   {hit:5d} tokens in {ms:7.1f} ms")

        dest = torch.zeros_like(kv_tensor)
        (mask, tiers), ms = timed(lambda: kv.retrieve(prompt, dest, return_tiers=True))
        assert torch.equal(dest, kv_tensor), "retrieved KV differs from what was stored"
        print(f"retrieve {int(mask.sum()):5d} tokens in {ms:7.1f} ms  hit tokens per tier: {tiers}")

        # Other prompts fill the CPU tier; the first one now lives only on disk.
        for seed in (1, 2, 3):
            kv.store(rng.integers(0, 32000, PROMPT_TOKENS), fake_kv(seed))
        kv.flush()  # let the background disk writes land

        dest = torch.zeros_like(kv_tensor)
        (mask, tiers), ms = timed(lambda: kv.retrieve(prompt, dest, return_tiers=True))
        assert torch.equal(dest, kv_tensor), "retrieved KV differs from what was stored"
        print(f"retrieve {int(mask.sum()):5d} tokens in {ms:7.1f} ms  hit tokens per tier: {tiers}")

        lookup_id = kv.prefetch(prompt)  # returns at once; loads into CPU in the background
        ready, ms = timed(lambda: kv.wait(lookup_id, timeout=10))
        print(f"prefetch {ready:5d} tokens ready in CPU after {ms:7.1f} ms")
        kv.unpin(lookup_id)

        stats = kv.stats()
        for tier, info in stats["tiers"].items():
            used = info.get("used_bytes", 0) >> 20
            print(f"  {tier:6s} entries={info.get('entries')} used={used} MiB", end=" ")
            print(f"evictions={info.get('evictions')}")
        print(f"hit rate of lookups: {stats['hit_rate']:.2f}. All retrieved bytes verified.")
        kv.clear()
        kv.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
