"""GPUConnector throughput, and the ideal TTFT gain of prefix KV reuse on the demo model.

Part 1 moves one request's KV (chunks of 256 tokens) between engine buffers and
`KV_2LTD` host payloads with `to_payloads` / `from_payloads`, for the paged layout
(random, non-contiguous blocks) and the contiguous layout, and compares the GB/s
with plain torch ops moving the same bytes, timed alternately (min-max shown): on CPU
`index_select` (the same gather into fresh tensors, as `to_payloads` allocates its
payloads) and `index_copy_` (the same scatter into the same preallocated buffers); on
CUDA one `copy_` of a contiguous tensor of the same size, device -> pinned host and
host -> device, into preallocated tensors.

Part 2 does the same for `PageConnector`, the copy raykv's vLLM connector makes:
whole pages of per-layer caches `[num_blocks, kv_heads, BLOCK, 2 * head_dim]` (vLLM's
flash-attention shape), random blocks, one request's chunks per call. A save is
`save_batch` into warm (on CUDA: pinned) buffers until its bytes are there, against one
copy of the same bytes from a contiguous source into a warm buffer (CPU: `np.copyto`,
a memcpy; CUDA: one `copy_` device -> pinned host); on CUDA it also reports what the
engine's thread pays, the `save_batch` call alone. A load is `load_batch` (CPU:
`load` per chunk) until the blocks hold the bytes, against one copy of the same bytes
into a warm contiguous buffer (CPU: memcpy; CUDA: from pinned host memory, and from
pageable memory as an object-store payload is).

Part 3 times a full prefill of prefix + 256-token suffix against a prefill of the
suffix alone with the prefix KV already in the model's cache: the speedup a cache
hit could give at best (loading the KV is not counted).

    python -m benchmarks.bench_connector [--quick] [--device cuda] [--skip-model] [--json PATH]

No goals are set for this benchmark: it reports figures beside their baselines only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks._util import Summary, extent, spread
from raykv.connector import GPUConnector
from raykv.page_connector import PageConnector

CHUNK = 256
BLOCK = 16
SUMMARY = Summary()

TITLE = "Connector and prefill"


def paired(
    fn: Callable[[], object], base: Callable[[], object], repeats: int, sync: bool
) -> tuple[list[float], list[float]]:
    """Wall times of `fn` and `base`, alternating which goes first (after one warm-up
    call each), so that both see the same machine."""
    fn(), base()
    a: list[float] = []
    b: list[float] = []
    for i in range(repeats):
        pair = ((fn, a), (base, b))
        for f, out in pair if i % 2 == 0 else pair[::-1]:
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            if sync:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
    return a, b


def bench_connector(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    tokens = args.tokens
    spans = [(a, min(a + CHUNK, tokens)) for a in range(0, tokens, CHUNK)]
    starts = [a for a, _ in spans]
    print(
        f"\n== connector: {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} "
        f"head_dim, {args.dtype}, {tokens} tokens in {len(spans)} chunks, device {device}"
    )
    for layout in ("paged", "contiguous"):
        conn = GPUConnector(args.layers, args.kv_heads, args.head_dim, dtype, device, layout, BLOCK)
        nbytes = conn.bytes_per_token() * tokens
        if layout == "paged":
            num_blocks = 2 * tokens // BLOCK  # half the blocks are used, in random order
            bufs = conn.allocate_buffers(num_blocks)
            blocks = torch.randperm(num_blocks)[: tokens // BLOCK]
            slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1).to(device)
        else:
            bufs = conn.allocate_buffers(tokens)
            slots = None
        for b in bufs:
            b.normal_()
        payloads = conn.to_payloads(bufs, spans, slots)

        def store(conn=conn, bufs=bufs, slots=slots) -> object:
            return conn.to_payloads(bufs, spans, slots)

        def load(conn=conn, bufs=bufs, slots=slots, payloads=payloads) -> None:
            conn.from_payloads(payloads, bufs, starts, slots)

        if cuda:
            dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            host_src = torch.empty(nbytes, dtype=torch.uint8)
            host_dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

            def base_store() -> object:
                return host_dst.copy_(dev_src)

            def base_load() -> object:
                return dev_dst.copy_(host_src)

            names = ("one copy_ device -> pinned host", "one copy_ host -> device")
        else:
            # The same gather (store) and scatter (load) of the same rows with plain
            # torch ops: index_select into fresh tensors (to_payloads allocates its
            # payloads too), index_copy_ into the same preallocated buffers.
            flat = [b.view(2, -1, conn.hidden).reshape(-1, conn.hidden) for b in bufs]
            num_slots = flat[0].shape[0] // 2
            rows = slots if slots is not None else torch.arange(tokens)
            both = torch.cat([rows, rows + num_slots])
            sources = [f.index_select(0, both) for f in flat]

            def base_store() -> object:
                return [f.index_select(0, both) for f in flat]

            def base_load() -> None:
                for f, src in zip(flat, sources, strict=True):
                    f.index_copy_(0, both, src)

            names = ("index_select (same gather)", "index_copy_ into the same buffers")
        gb = nbytes / 1e9
        for what, fn, base, base_name in (
            ("to_payloads", store, base_store, names[0]),
            ("from_payloads", load, base_load, names[1]),
        ):
            ours, theirs = paired(fn, base, args.repeats, cuda)
            o, b = spread(ours), spread(theirs)
            rng = (gb / o["max"], gb / o["min"])
            SUMMARY.row(
                f"{layout} {what}", gb / o["median"], "GB/s", base_name, gb / b["median"], rng
            )
            print(
                f"{layout:>10} {what:<13} {gb / o['median']:6.2f} GB/s "
                f"[{rng[0]:.2f}-{rng[1]:.2f}]   {base_name:>34} {gb / b['median']:6.2f} GB/s"
                f"   ratio {b['median'] / o['median']:.2f}"
            )


def bench_pages(args: argparse.Namespace) -> None:
    """PageConnector's batched save and load (the vLLM connector's copies) against one
    copy of the same bytes, alternating."""
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    blocks_needed = args.tokens // BLOCK
    num_blocks = 2 * blocks_needed  # half the blocks are used, in random order
    shape = (num_blocks, args.kv_heads, BLOCK, 2 * args.head_dim)
    layers = [
        torch.randn(shape, dtype=torch.float32).to(dtype).to(device) for _ in range(args.layers)
    ]
    conn = PageConnector(layers)
    ids = torch.randperm(num_blocks)[:blocks_needed].tolist()
    per_chunk = CHUNK // BLOCK
    sizes = [min(per_chunk, blocks_needed - a) for a in range(0, blocks_needed, per_chunk)]
    nbytes = blocks_needed * conn.block_nbytes
    print(
        f"\n== pages: {args.layers} layers of {dtype} {list(shape)}, {args.tokens} tokens "
        f"({nbytes / 2**20:.0f} MiB) in {len(sizes)} chunks of {CHUNK}, device {device}"
    )

    def warm(n: int) -> np.ndarray:
        if cuda:
            return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
        out = np.empty(n, dtype=np.uint8)
        out.fill(0)  # touched: a warm buffer, as the save pool's are
        return out

    outs = [warm(conn.meta(n).nbytes) for n in sizes]
    metas, copied = conn.save_batch(ids, sizes, outs)
    copied.synchronize()
    parts = []
    at = 0
    for n, out, meta in zip(sizes, outs, metas, strict=True):
        parts.append((out, meta, ids[at : at + n], 0))
        at += n

    def save() -> None:
        conn.save_batch(ids, sizes, outs)[1].synchronize()

    def load() -> None:
        conn.load_batch(parts).synchronize()

    if cuda:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.ones(nbytes, dtype=torch.uint8)  # touched, not pinned

        def base_save() -> object:
            return pinned.copy_(dev, non_blocking=True)

        def base_load() -> object:
            return dev.copy_(pinned, non_blocking=True)

        def base_load_pageable() -> object:  # a payload in the object store is pageable
            return dev.copy_(pageable, non_blocking=True)

        rows = [
            ("save_batch", save, base_save, "one copy_ device -> pinned host"),
            ("load_batch", load, base_load, "one copy_ pinned host -> device"),
            ("load_batch", load, base_load_pageable, "one copy_ pageable host -> device"),
        ]
    else:
        src, dst = warm(nbytes), warm(nbytes)
        src[:] = 1

        def base_save() -> object:
            return np.copyto(dst, src)

        rows = [
            ("save_batch", save, base_save, "memcpy of the same bytes"),
            ("load_batch", load, base_save, "memcpy of the same bytes"),
        ]
    gb = nbytes / 1e9
    for what, fn, base, base_name in rows:
        ours, theirs = paired(fn, base, args.repeats, cuda)
        o, b = spread(ours), spread(theirs)
        rng = (gb / o["max"], gb / o["min"])
        SUMMARY.row(f"pages {what}", gb / o["median"], "GB/s", base_name, gb / b["median"], rng)
        print(
            f"{'pages':>10} {what:<14} {gb / o['median']:6.2f} GB/s [{rng[0]:.2f}-{rng[1]:.2f}]"
            f"   {base_name:>34} {gb / b['median']:6.2f} GB/s"
            f"   time ratio {o['median'] / b['median']:.2f}"
        )
    if cuda:  # what the engine's thread pays in wait_for_save: the call, not the copy
        calls, copies = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            conn.save_batch(ids, sizes, outs)
            calls.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            base_save()
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        c, b = spread(calls), spread(copies)
        name = "one copy_ device -> pinned host"
        SUMMARY.row(
            "pages save_batch call (engine thread)",
            c["median"] * 1e3,
            "ms",
            name,
            b["median"] * 1e3,
            extent(calls, 1e3),
        )
        print(
            f"{'pages':>10} save_batch call on the engine thread {c['median'] * 1e3:.3f} ms "
            f"[{c['min'] * 1e3:.3f}-{c['max'] * 1e3:.3f}]   {name} {b['median'] * 1e3:.3f} ms"
            f"   time ratio {c['median'] / b['median']:.3f}"
        )


def bench_model(args: argparse.Namespace) -> None:
    from transformers import DynamicCache

    from raykv.demo.model import build_demo_model, prefill, prefill_suffix

    model = build_demo_model(seed=0, device=args.device)
    suffix = 256
    prefixes = [1024, 4096] if args.quick else [1024, 4096, 8192]
    repeats = 1 if args.quick else 3
    cuda = torch.device(args.device).type == "cuda"
    print(
        f"\n== prefill on the demo model (8 layers, hidden 512, fp32, {args.device}), "
        f"suffix {suffix} tokens, median of {repeats} after a warm-up"
    )
    print(f"{'':>7} {'--- wall seconds ---':>31} {'--- process CPU seconds ---':>33}")
    print(
        f"{'prefix':>7} {'full':>9} {'suffix-only':>12} {'speedup':>9}"
        f" {'full':>9} {'suffix-only':>12} {'speedup':>9}"
    )
    g = torch.Generator().manual_seed(0)
    for p in prefixes:
        tokens = torch.randint(0, model.config.vocab_size, (p + suffix,), generator=g)
        _, prefix_cache = prefill(model, tokens[:p], logits_to_keep=1)
        kv = [(layer.keys, layer.values) for layer in prefix_cache.layers]

        def timed(fn: Callable[[], object]) -> tuple[float, float]:
            """(wall, process CPU) seconds: CPU time is steadier on a shared machine."""
            if cuda:
                torch.cuda.synchronize()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - w0, time.process_time() - c0

        def full(tokens=tokens) -> object:
            return prefill(model, tokens, logits_to_keep=suffix)

        def warm(tokens=tokens, kv=kv, p=p) -> tuple[float, float]:
            cache = DynamicCache(ddp_cache_data=kv, config=model.config)  # not timed
            return timed(lambda: prefill_suffix(model, cache, tokens[p:], p, logits_to_keep=suffix))

        full()
        fulls = [timed(full) for _ in range(repeats)]
        warm()
        warms = [warm() for _ in range(repeats)]
        fw, fc = (statistics.median(x) for x in zip(*fulls, strict=True))
        ww, wc = (statistics.median(x) for x in zip(*warms, strict=True))
        warm_cpu = [c for _, c in warms]
        SUMMARY.row(
            f"suffix-only prefill, {p}-token prefix (CPU s)",
            wc,
            "s",
            "full prefill",
            fc,
            value_range=extent(warm_cpu),
        )
        print(
            f"{p:>7} {fw:>9.3f} {ww:>12.3f} {fw / ww:>8.1f}x"
            f" {fc:>9.3f} {wc:>12.3f} {fc / wc:>8.1f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=None, help="default 2048, 512 with --quick")
    parser.add_argument("--repeats", type=int, default=None, help="default 10, 3 with --quick")
    parser.add_argument("--skip-model", action="store_true", help="only the connector part")
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a busy box)"
    )
    args = parser.parse_args()
    args.tokens = args.tokens or (512 if args.quick else 2048)
    args.repeats = args.repeats or (3 if args.quick else 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    torch.manual_seed(0)
    bench_connector(args)
    bench_pages(args)
    if not args.skip_model:
        bench_model(args)
    SUMMARY.write(args.json)


if __name__ == "__main__":
    main()
