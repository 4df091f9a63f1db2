"""Key hashing and payload codec speed, each beside its floor measured in the same run.

    python -m benchmarks.bench_keys [--quick] [--json PATH]

Hashing: tokens -> chained chunk keys for 4k/32k/128k-token prompts (numpy input and
Python-list input) vs `ndarray.tobytes()` of the same tokens. Goal: 128k tokens in < 5 ms.
Codec: `payload.encode` / `payload.decode` GB/s vs a numpy copy (memcpy) of the same
bytes. Goal: >= 0.5x memcpy.
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

from benchmarks._util import Summary, median_seconds, print_table, repeat_seconds, spread
from raykv.keys import KeyMaker
from raykv.payload import PayloadMeta, decode, encode

TITLE = "Keys and codec"
NOTES = """\
Hand-written analysis (figures from the full run this report records (2026-11-25 08:40
UTC, commit 2426809, 2 cores, load 0.5 -> 3.2)): 128k tokens took 0.80 ms from a numpy
array and 2.65 ms from a Python list, whose conversion to int32 dominates. Keys are
`CacheKey` named tuples since 2026-11-25, built in C from the hash chain; the hashing
itself is most of the numpy figure.

Codec decode is zero-copy (checksum only), hence > 1x memcpy (1.39x at 2 MiB, 3.42x at
32 MiB). `encode` returns a numpy buffer rather than `bytes` and reached 0.60x / 0.69x
memcpy: allocating and filling a 32 MiB `bytes` ran at 1.9 GB/s against 4.4 GB/s for
numpy in an earlier run.
"""


def bench_hashing(repeats: int, summary: Summary) -> None:
    """Tokens -> chained keys for 4k/32k/128k tokens, vs `tobytes()` of the same tokens."""
    maker = KeyMaker(chunk_size=256)
    rows = []
    for n in (4096, 32768, 131072):
        tokens = np.random.default_rng(n).integers(0, 128_000, n)
        as_list = tokens.tolist()
        floor = median_seconds(lambda: tokens.astype("<i4").tobytes(), repeats)
        s_np = spread(repeat_seconds(lambda: maker.keys(tokens), repeats))
        s_list = spread(repeat_seconds(lambda: maker.keys(as_list), repeats))
        t_np, t_list = s_np["median"], s_list["median"]
        rows.append([n, t_np * 1e3, n / t_np / 1e6, t_list * 1e3, floor * 1e3, t_np / floor])
        floor_name = "tobytes() of the tokens (floor)"
        for kind, s in (("numpy", s_np), ("list", s_list)):
            summary.row(
                f"keys for {n} tokens, {kind} input",
                s["median"] * 1e3,
                "ms",
                floor_name,
                floor * 1e3,
                value_range=(s["min"] * 1e3, s["max"] * 1e3),
            )
        if n == 131072:
            summary.goal("128k tokens into keys (numpy input) < 5 ms", t_np * 1e3, t_np < 5e-3)
    print("\n## Key hashing (chunk_size=256, XXH3-128 chain)\n")
    print_table(
        ["tokens", "numpy ms", "numpy Mtok/s", "list ms", "tobytes ms (floor)", "numpy / floor"],
        rows,
    )


def bench_codec(repeats: int, summary: Summary) -> None:
    """`encode` / `decode` GB/s of 2 and 32 MiB chunks vs a numpy copy of the same bytes."""
    rows = []
    for mib in (2, 32):
        nbytes = mib << 20
        data = np.random.default_rng(mib).integers(0, 256, nbytes, dtype=np.uint8)
        meta = PayloadMeta("bfloat16", (2, 8, 256, nbytes // (2 * 8 * 256 * 2)))
        blob = encode(data, meta, key="bench")
        t_copy = median_seconds(data.copy, repeats)
        s_enc = spread(repeat_seconds(lambda: encode(data, meta, key="bench"), repeats))
        s_dec = spread(repeat_seconds(lambda: decode(blob, expected_key="bench"), repeats))
        t_enc, t_dec = s_enc["median"], s_dec["median"]
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        rows.append(
            [f"{mib} MiB", gbs(t_copy), gbs(t_enc), t_copy / t_enc, gbs(t_dec), t_copy / t_dec]
        )
        for op, s in (("encode", s_enc), ("decode", s_dec)):
            # GB/s: the slowest repeat gives the minimum, the fastest the maximum
            summary.row(
                f"{op} {mib} MiB",
                gbs(s["median"]),
                "GB/s",
                "numpy memcpy",
                gbs(t_copy),
                value_range=(gbs(s["max"]), gbs(s["min"])),
            )
        for op, t in (("encode", t_enc), ("decode", t_dec)):
            ratio = t_copy / t
            summary.goal(f"{op} {mib} MiB >= 0.5x memcpy", round(ratio, 3), ratio >= 0.5)
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
    """Parse the options, run both parts, write the JSON summary if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--json", help="write a machine-readable summary to this file")
    args = parser.parse_args()
    repeats = 5 if args.quick else 31
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    summary = Summary()
    bench_hashing(repeats, summary)
    bench_codec(repeats, summary)
    summary.write(args.json)


if __name__ == "__main__":
    main()
