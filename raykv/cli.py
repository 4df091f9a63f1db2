"""The `raykv` command line: `raykv --version`, `raykv config show`, `raykv simulate`, ...

Each subcommand registers itself through a `register(subparsers)` function in the module
that owns its logic (`raykv config` here); this file wires them up.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand -> the module that registers it (imported only when needed).
_SUBCOMMANDS = {"config": "raykv.cli", "simulate": "raykv.simulate", "stats": "raykv.stats_cli"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand, or just ``only``.

    Registering one subcommand keeps a run from importing the others'
    dependencies (yaml, the key hasher); help and errors list them all.
    """
    from raykv import __version__

    parser = argparse.ArgumentParser(prog="raykv", description="raykv: a tiered KV cache on Ray.")
    parser.add_argument("--version", action="version", version=f"raykv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, module in _SUBCOMMANDS.items():
        if only is None or command == only:
            importlib.import_module(module).register(subparsers)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``raykv config show [--file PATH] [--json]`` (the subcommand this module owns)."""
    config = subparsers.add_parser("config", help="inspect the effective raykv configuration")
    config.set_defaults(func=lambda args: _usage(config))
    sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    show = sub.add_parser(
        "show",
        help="print the effective config (defaults < file < RAYKV_* env), password masked",
    )
    show.add_argument(
        "--file", metavar="PATH", help="YAML config file (default: $RAYKV_CONFIG_FILE)"
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.set_defaults(func=_show_command)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _show_command(args: argparse.Namespace) -> int:
    import json

    from raykv.config import RayKVConfig
    from raykv.errors import ConfigError

    try:
        cfg = RayKVConfig.load(args.file)
    except ConfigError as exc:
        print(f"raykv config show: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(cfg.to_dict(mask_secrets=True), indent=2))
    else:
        print(cfg.to_yaml(mask_secrets=True), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `raykv` console script; returns the process exit code."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in == ["--version"]:  # answered without importing the subcommands (numpy etc.)
        from raykv import __version__

        print(f"raykv {__version__}")
        return 0
    first = args_in[0] if args_in else None
    parser = build_parser(first if first in _SUBCOMMANDS else None)
    args = parser.parse_args(args_in)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
