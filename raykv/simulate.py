"""`raykv simulate`: replay a trace through eviction policies and report miss ratios.

    raykv simulate --policy lru,s3fifo,sieve --size 1%,10% trace.csv

Trace formats: one id per line (``lines``), CSV with a named column (``csv``,
column ``--column``, default ``id`` or the only column), and libCacheSim's
``oracleGeneral`` binary (records ``<u4 time, <u8 id, <u4 size, <i8 next>``).
The format follows the file extension unless ``--format`` says otherwise.
Sizes are object counts (``1000``) or percentages of the trace's unique
objects (``1%``). Every request counts, cold start included.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from raykv.errors import ConfigError, InvalidInputError
from raykv.policies import make_policy, policy_class

FORMATS = ("auto", "lines", "csv", "oracle")
ORACLE_RECORD = 24  # bytes: <u4 time, <u8 id, <u4 size, <i8 next_access>


@dataclass(frozen=True, slots=True)
class Result:
    """One (policy, size) cell of the miss-ratio table."""

    policy: str
    size_spec: str
    size: int
    requests: int
    misses: int

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0


def _id(text: str) -> int | str:
    # Integer ids hash faster and match libCacheSim's numeric ids. Only a
    # canonical ASCII decimal becomes an int: "01", "+1", "1_0" and "-1" stay
    # strings, so distinct ids never merge.
    if text.isascii() and text.isdigit() and (text[0] != "0" or len(text) == 1):
        return int(text)
    return text


def detect_format(path: str) -> str:
    """Pick the trace format from the file name."""
    name = path.lower()
    if name.endswith(".csv"):
        return "csv"
    if "oraclegeneral" in name or name.endswith((".bin", ".og")):
        return "oracle"
    return "lines"


def load_trace(path: str, fmt: str = "auto", column: str | None = None) -> list:
    """Read the request ids of a trace file; raises InvalidInputError on bad input."""
    if not os.path.isfile(path):
        raise InvalidInputError(f"trace file {path!r} does not exist")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "oracle":
        return _load_oracle(path)
    if fmt == "csv":
        return _load_csv(path, column)
    if fmt == "lines":
        return _load_lines(path)
    raise InvalidInputError(f"trace format {fmt!r} is unknown; allowed: {', '.join(FORMATS)}")


def _load_lines(path: str) -> list:
    ids = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            if len(text.split()) != 1:
                raise InvalidInputError(
                    f"{path}:{lineno}: expected one id per line, got {text[:60]!r}"
                )
            ids.append(_id(text))
    return ids


def _load_csv(path: str, column: str | None) -> list:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise InvalidInputError(f"{path}: empty CSV file, expected a header row")
        header = [h.strip() for h in header]
        if column is None:
            column = "id" if "id" in header or len(header) != 1 else header[0]
        if column not in header:
            raise InvalidInputError(
                f"{path}: CSV has no column {column!r}; columns: {', '.join(header)} "
                "(choose one with --column)"
            )
        idx = header.index(column)
        ids = []
        for lineno, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) <= idx or not row[idx].strip():
                raise InvalidInputError(f"{path}:{lineno}: missing value in column {column!r}")
            ids.append(_id(row[idx].strip()))
    return ids


def _load_oracle(path: str) -> list:
    # Pure-Python on purpose: importing numpy alone costs ~0.1 s of a ~0.5 s run.
    nbytes = os.path.getsize(path)
    if nbytes % ORACLE_RECORD:
        raise InvalidInputError(
            f"{path}: {nbytes} bytes is not a whole number of {ORACLE_RECORD}-byte "
            "oracleGeneral records"
        )
    with open(path, "rb") as f:
        data = f.read()
    # Past the first 4-byte time field, each record is three 8-byte words, the
    # id first; dropping the last 4 bytes keeps a whole number of words.
    words = array("Q")
    words.frombytes(memoryview(data)[4 : max(4, len(data) - 4)])
    ids = words[0::3]
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def parse_sizes(spec: str, unique: int | None) -> list[tuple[str, int]]:
    """``"100,1%,0.5%"`` -> [(spec, objects), ...]; a percentage is of the unique objects.

    ``unique`` may be None when ``spec`` has no percentage.
    """
    sizes = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            if part.endswith("%"):
                pct = float(part[:-1])
                if not 0 < pct < float("inf"):  # NaN and inf too
                    raise ValueError
                size = max(1, round(unique * pct / 100))
            else:
                size = int(part)
                if size <= 0:
                    raise ValueError
        except ValueError:
            raise InvalidInputError(
                f"cache size {part!r} is invalid; allowed: a count > 0 or a percentage like 1%"
            ) from None
        sizes.append((part, size))
    if not sizes:
        raise InvalidInputError("no cache size given; use e.g. --size 1%,10%")
    return sizes


def parse_policies(spec: str) -> list[str]:
    """Validate a comma-separated policy list (raises ConfigError naming the known ones)."""
    names = [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise ConfigError("no policy given; use e.g. --policy lru,s3fifo")
    for name in names:
        policy_class(name)
    return names


def run(
    ids: Sequence,
    policies: Sequence[str],
    sizes: Sequence[tuple[str, int]],
    progress: bool | None = None,
) -> list[Result]:
    """Replay ``ids`` through every (policy, size); uses each policy's fast path."""
    results = []
    if progress is None:  # by default a bar only when stderr is a terminal
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm  # imported only when shown: it costs ~50 ms

        total = len(ids) * len(policies) * len(sizes)
        bar = tqdm(total=total, unit="req", unit_scale=True, file=sys.stderr, leave=False)
    try:
        for name in policies:
            for spec, size in sizes:
                if bar is not None:
                    bar.set_description(f"{name}@{spec}")
                misses = make_policy(name, size).simulate(ids)
                results.append(Result(name, spec, size, len(ids), misses))
                if bar is not None:
                    bar.update(len(ids))
    finally:
        if bar is not None:
            bar.close()
    return results


def format_table(results: Sequence[Result]) -> str:
    """A plain-text table: one row per policy, one column per size."""
    specs = list(dict.fromkeys(f"{r.size_spec} ({r.size})" for r in results))
    rows: dict[str, dict[str, float]] = {}
    for r in results:
        rows.setdefault(r.policy, {})[f"{r.size_spec} ({r.size})"] = r.miss_ratio
    width = max(len("policy"), *(len(p) for p in rows))
    cols = [max(len(s), 6) for s in specs]
    lines = [
        "policy".ljust(width)
        + "  "
        + "  ".join(s.rjust(w) for s, w in zip(specs, cols, strict=True))
    ]
    for policy, cells in rows.items():
        vals = "  ".join(f"{cells[s]:.4f}".rjust(w) for s, w in zip(specs, cols, strict=True))
        lines.append(policy.ljust(width) + "  " + vals)
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str) -> None:
    """Draw miss-ratio curves (one line per policy) to an image file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r.policy for r in results):
        pts = sorted((r.size, r.miss_ratio) for r in results if r.policy == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("cache size (objects)")
    ax.set_ylabel("miss ratio")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``raykv simulate``; returns the exit code (2 on bad input)."""
    try:
        policies = parse_policies(args.policy)
        if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
            raise InvalidInputError(f"--plot {args.plot!r}: use a .png, .svg or .pdf file name")
        ids = load_trace(args.trace, args.format, args.column)
        if not ids:
            raise InvalidInputError(f"trace {args.trace!r} has no requests")
        # Counting distinct ids costs ~15% of a run: only when a size or --json needs it.
        unique = len(set(ids)) if args.json or "%" in args.size else None
        sizes = parse_sizes(args.size, unique)
    except (ConfigError, InvalidInputError, UnicodeDecodeError, OSError, csv.Error) as exc:
        print(f"raykv simulate: error: {exc}", file=sys.stderr)
        return 2
    results = run(ids, policies, sizes, progress=False if args.no_progress else None)
    plotted = None
    if args.plot:  # after the run: a plot that cannot be drawn loses no result
        try:
            plot(results, args.plot)
            plotted = args.plot
        except ImportError:
            print(
                "raykv simulate: --plot needs matplotlib: pip install 'raykv[plot]'",
                file=sys.stderr,
            )
        except OSError as exc:
            print(f"raykv simulate: error: cannot write {args.plot}: {exc}", file=sys.stderr)
    if args.json:
        doc = {
            "trace": args.trace,
            "requests": len(ids),
            "unique": unique,
            "results": [asdict(r) | {"miss_ratio": r.miss_ratio} for r in results],
        }
        print(json.dumps(doc, indent=2))
    else:
        counted = f", {unique} unique objects" if unique is not None else ""
        print(f"trace {args.trace}: {len(ids)} requests{counted}")
        print(format_table(results))
        if plotted:
            print(f"plot written to {plotted}")
    return 0 if plotted or not args.plot else 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` subcommand to the ``raykv`` CLI."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a trace through eviction policies and print miss ratios",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace file (one id per line, CSV, or oracleGeneral)")
    p.add_argument("--policy", default="lru", help="comma-separated policies (default: lru)")
    p.add_argument("--size", default="1%", help="comma-separated sizes: counts or N%% of unique")
    p.add_argument("--format", choices=FORMATS, default="auto", help="trace format")
    p.add_argument("--column", default=None, help="CSV column holding the id (default: id)")
    p.add_argument("--plot", metavar="OUT.png", help="draw miss-ratio curves to this file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=main)
