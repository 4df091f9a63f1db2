"""Key hashing and payload codec speed, each beside its floor measured in the same run.

    python -m benchmarks.bench_keys [--quick] [--json PATH]

Hashing: tokens -> chained chunk keys for 4k/32k/128k-token prompts (numpy input and
Python-list input) vs `ndarray.tobytes()` of the same tokens. Goal: 128k tokens in < 5 ms.
Codec: `payload.encode` / `payload.decode` GB/s vs a numpy copy (memcpy) of the same
bytes. Goal: >= 0.5x memcpy.
Start-up, each a whole new process beside `python -c pass` (the interpreter's own start),
alternating: `import raykv` (timed inside the child, which also checks that neither
torch nor ray got imported; goal <= 0.3 s) and `raykv --version` (goal <= 0.5 s).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys

import numpy as np

from benchmarks._util import (
    Summary,
    interleave_all,
    median_seconds,
    print_table,
    repeat_seconds,
    spread,
)
from raykv.keys import KeyMaker
from raykv.payload import PayloadMeta, decode, encode

TITLE = "Keys and codec"


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


IMPORT_PROBE = (
    "import sys, time; t = time.perf_counter(); import raykv; t = time.perf_counter() - t; "
    "heavy = sorted({'torch', 'ray'} & set(sys.modules)); print(t, ','.join(heavy))"
)


def bench_startup(repeats: int, summary: Summary) -> None:
    """`import raykv` and `raykv --version` in new processes, beside a bare interpreter."""
    cli = shutil.which("raykv")
    if cli is None:
        raise SystemExit("the raykv command is not on PATH: pip install -e . first")
    imports: list[float] = []
    heavy: set[str] = set()

    def run_import(_i: int) -> None:
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, check=True
        ).stdout.split()
        imports.append(float(out[0]))
        heavy.update(out[1].split(",") if len(out) > 1 else [])

    def run(argv: list[str]) -> None:
        subprocess.run(argv, capture_output=True, check=True)

    bare = [sys.executable, "-c", "pass"]
    t_import, t_version, t_bare = interleave_all(
        [run_import, lambda _i: run([cli, "--version"]), lambda _i: run(bare)], repeats
    )
    del imports[0]  # the warm-up call
    s_imp, s_ver, s_bare = spread(imports), spread(t_version), spread(t_bare)
    print("\n## Start-up (whole processes)\n")
    print_table(
        ["what", "median s", "min-max s", "bare python -c pass s"],
        [
            [
                "import raykv (in the child)",
                s_imp["median"],
                f"{s_imp['min']:.4f}-{s_imp['max']:.4f}",
                "-",
            ],
            ["whole process: import raykv", spread(t_import)["median"], "", s_bare["median"]],
            [
                "raykv --version",
                s_ver["median"],
                f"{s_ver['min']:.3f}-{s_ver['max']:.3f}",
                s_bare["median"],
            ],
        ],
    )
    if heavy:
        print(f"import raykv loaded {sorted(heavy)}")
    summary.row(
        "import raykv (timed inside a new process)",
        s_imp["median"] * 1e3,
        "ms",
        value_range=(s_imp["min"] * 1e3, s_imp["max"] * 1e3),
    )
    summary.row(
        "raykv --version (whole process)",
        s_ver["median"],
        "s",
        "python -c pass (whole process)",
        s_bare["median"],
        value_range=(s_ver["min"], s_ver["max"]),
    )
    free = "neither torch nor ray" if not heavy else f"loads {', '.join(sorted(heavy))}"
    summary.goal(
        f"import raykv <= 0.3 s ({free})",
        round(s_imp["median"], 4),
        s_imp["max"] <= 0.3 and not heavy,
    )
    summary.goal("raykv --version <= 0.5 s", round(s_ver["median"], 3), s_ver["median"] <= 0.5)


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
    bench_startup(5 if args.quick else 11, summary)
    summary.write(args.json)


if __name__ == "__main__":
    main()
