"""Key hashing and payload codec speed, each beside its floor measured in the same run.

    python benchmarks/bench_keys.py [--quick]

Hashing: tokens -> chained chunk keys for 4k/32k/128k-token prompts (numpy input and
Python-list input) vs `ndarray.tobytes()` of the same tokens. Goal: 128k tokens in < 5 ms.
Codec: `payload.encode` / `payload.decode` GB/s vs a numpy copy (memcpy) of the same
bytes. Goal: >= 0.5x memcpy.
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

from benchmarks._util import median_seconds, print_table
from raykv.keys import KeyMaker
from raykv.payload import PayloadMeta, decode, encode


def bench_hashing(repeats: int) -> None:
    maker = KeyMaker(chunk_size=256)
    rows = []
    for n in (4096, 32768, 131072):
        tokens = np.random.default_rng(n).integers(0, 128_000, n)
        as_list = tokens.tolist()
        floor = median_seconds(lambda: tokens.astype("<i4").tobytes(), repeats)
        t_np = median_seconds(lambda: maker.keys(tokens), repeats)
        t_list = median_seconds(lambda: maker.keys(as_list), repeats)
        rows.append([n, t_np * 1e3, n / t_np / 1e6, t_list * 1e3, floor * 1e3, t_np / floor])
    print("\n## Key hashing (chunk_size=256, XXH3-128 chain)\n")
    print_table(
        ["tokens", "numpy ms", "numpy Mtok/s", "list ms", "tobytes ms (floor)", "numpy / floor"],
        rows,
    )


def bench_codec(repeats: int) -> None:
    rows = []
    for mib in (2, 32):
        nbytes = mib << 20
        data = np.random.default_rng(mib).integers(0, 256, nbytes, dtype=np.uint8)
        meta = PayloadMeta("bfloat16", (2, 8, 256, nbytes // (2 * 8 * 256 * 2)))
        blob = encode(data, meta, key="bench")
        t_copy = median_seconds(data.copy, repeats)
        t_enc = median_seconds(lambda: encode(data, meta, key="bench"), repeats)
        t_dec = median_seconds(lambda: decode(blob, expected_key="bench"), repeats)
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        rows.append(
            [f"{mib} MiB", gbs(t_copy), gbs(t_enc), t_copy / t_enc, gbs(t_dec), t_copy / t_dec]
        )
    print("\n## Payload codec (header + XXH3-64 checksum)\n")
    print_table(
        [
            "chunk",
            "memcpy GB/s",
            "encode GB/s",
            "encode / memcpy",
            "decode GB/s",
            "decode / memcpy",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 5 if args.quick else 31
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    bench_hashing(repeats)
    bench_codec(repeats)


if __name__ == "__main__":
    main()
