"""The `raykv` command line: `raykv --version`, `raykv config show`, `raykv simulate`, ...

Each subcommand lives in the module that owns its logic and registers itself
through a `register(subparsers)` function; this file only wires them up.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that contribute subcommands (their optional dependencies import lazily).
_SUBCOMMAND_MODULES = ("raykv.config", "raykv.simulate", "raykv.stats_cli")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand."""
    from raykv import __version__

    parser = argparse.ArgumentParser(prog="raykv", description="raykv: a tiered KV cache on Ray.")
    parser.add_argument("--version", action="version", version=f"raykv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `raykv` console script; returns the process exit code."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in == ["--version"]:  # answered without importing the subcommands (numpy etc.)
        from raykv import __version__

        print(f"raykv {__version__}")
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
