"""`raykv bench`: run the benchmark suite, a thin alias of `python -m benchmarks`.

The benchmarks live in the repository's `benchmarks/` package, not in the installed
wheel, so the alias works from a source checkout (or an editable install) only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HINT = "run it from a raykv source checkout (`python -m benchmarks` in the repo root)"


def _checkout_root() -> Path | None:
    """The source checkout this raykv was imported from, if it holds the benchmarks."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "runner.py").is_file() else None


def main(args: argparse.Namespace) -> int:
    """Entry point of `raykv bench`: hand every argument to `benchmarks.runner.main`."""
    root = _checkout_root()
    if root is None:
        print(
            f"raykv bench: error: the benchmarks package is not available; {_HINT}", file=sys.stderr
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from benchmarks import runner
    except ImportError as exc:
        print(f"raykv bench: error: cannot import the benchmarks ({exc}); {_HINT}", file=sys.stderr)
        return 2
    if Path(runner.__file__).resolve().parents[1] != root:
        print(
            f"raykv bench: error: `benchmarks` resolves to {runner.__file__}, "
            f"not this checkout's; {_HINT}",
            file=sys.stderr,
        )
        return 2
    return runner.main(list(args.extra), prog="raykv bench")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand; its options are the runner's (see `raykv bench --help`)."""
    p = subparsers.add_parser(
        "bench",
        help="run every benchmark and write docs/BENCHMARKS.md (source checkout only)",
        add_help=False,  # --help goes to the runner, which knows the options
    )
    p.set_defaults(func=main, pass_through=True, extra=[])
