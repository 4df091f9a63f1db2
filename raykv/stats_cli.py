"""`raykv stats`: per-tier entries, bytes, hit rate and evictions of a running cache.

Attaches to a running cluster (`ray.init(address=...)`), finds every storage manager
of the namespace by name (the cluster-wide one and the node-scoped ones,
`raykv-storage-manager-<node>`), and prints what their `stats()` report. Exit code 2
with a clear message when Ray is unreachable or the namespace has no manager.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

from raykv.actors.base import DEFAULT_NAMESPACE, STORAGE_MANAGER_NAME

# How long one manager may take to answer stats() before it is reported as unavailable.
STATS_TIMEOUT_SECS = 30.0


def manager_names(namespace: str) -> list[str]:
    """Names of the storage managers alive in `namespace` (Ray must be initialised)."""
    import ray

    names = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == namespace and a["name"].startswith(STORAGE_MANAGER_NAME)
    }
    return sorted(names)


# Longest wait to attach to a cluster before giving up with exit code 2.
ATTACH_TIMEOUT_SECS = 30.0


def collect(namespace: str, timeout: float = STATS_TIMEOUT_SECS) -> dict[str, Any]:
    """manager name -> its `stats()` (or `{"error": ...}`); Ray must be initialised."""
    import ray

    out: dict[str, Any] = {}
    for name in manager_names(namespace):
        try:
            handle = ray.get_actor(name, namespace=namespace)
            out[name] = ray.get(handle.stats.remote(), timeout=timeout)
        except Exception as exc:  # one dead manager must not hide the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _rate(hits: float, misses: float) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def summarize(stats: dict[str, Any]) -> dict[str, Any]:
    """The CLI's view of one manager's stats: overall numbers plus one row per tier."""
    if "error" in stats:
        return {"error": stats["error"]}
    tiers = {}
    for tier, info in stats.get("tiers", {}).items():
        hits, misses = info.get("lookup_hit_chunks", 0), info.get("lookup_miss_chunks", 0)
        tiers[tier] = {
            "entries": info.get("entries", info.get("index_entries", 0)),
            "used_bytes": info.get("used_bytes", 0),
            "capacity_bytes": info.get("capacity_bytes", 0),
            "hit_rate": _rate(hits, misses),
            "evictions": info.get("evictions", 0),
            "policy": info.get("policy", ""),
            **({"error": info["error"]} if "error" in info else {}),
        }
    return {
        "lookups": stats.get("lookups", 0),
        "hit_tokens": stats.get("hit_tokens", 0),
        "miss_tokens": stats.get("miss_tokens", 0),
        "hit_rate": stats.get("hit_rate", 0.0),
        "remote_errors": stats.get("remote_errors", 0),
        "tiers": tiers,
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """Plain-text report, one block per manager."""
    lines: list[str] = []
    for name, s in summary.items():
        lines.append(f"{name}")
        if "error" in s:
            lines.append(f"  unavailable: {s['error']}")
            continue
        lines.append(
            f"  lookups {s['lookups']}  hit tokens {s['hit_tokens']}  "
            f"miss tokens {s['miss_tokens']}  hit rate {s['hit_rate']:.1%}  "
            f"remote errors {s['remote_errors']}"
        )
        lines.append(
            f"  {'tier':<8}{'entries':>10}{'used':>12}{'capacity':>12}{'hit rate':>10}"
            f"{'evictions':>11}  policy"
        )
        for tier, t in s["tiers"].items():
            lines.append(
                f"  {tier:<8}{t['entries']:>10}{_human(t['used_bytes']):>12}"
                f"{_human(t['capacity_bytes']):>12}{t['hit_rate']:>10.1%}{t['evictions']:>11}"
                f"  {t['policy']}{'  ERROR ' + t['error'] if 'error' in t else ''}"
            )
    return "\n".join(lines)


def _use_token_auth_if_available(address: str) -> None:
    """Ray only auto-enables token auth for `address="auto"`; do the same for an explicit
    address when a token is at hand (and RAY_AUTH_MODE does not say otherwise)."""
    if address == "auto" or "RAY_AUTH_MODE" in os.environ:
        return
    try:  # Ray's own rule (also refreshes its cached config); private, hence the fallback
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
        if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
            os.environ["RAY_AUTH_MODE"] = "token"


def _attach(address: str, namespace: str, timeout: float) -> str | None:
    """`ray.init(address=...)`, bounded: Ray retries an unreachable GCS for minutes.

    Returns None on success, else the reason. A hung attach leaves a daemon thread
    behind, which is harmless in a CLI that exits next.
    """
    import ray

    outcome: list[BaseException | None] = []

    def attach() -> None:
        try:
            ray.init(
                address=address, namespace=namespace, logging_level="ERROR", log_to_driver=False
            )
            outcome.append(None)
        except BaseException as exc:  # reported to the user, never raised
            outcome.append(exc)

    thread = threading.Thread(target=attach, daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer within {timeout:.0f} s (is a Ray cluster running there?)"
    return None if outcome[0] is None else str(outcome[0])


def _stats_command(args: argparse.Namespace) -> int:
    import ray

    attached = False
    if not ray.is_initialized():
        _use_token_auth_if_available(args.address)
        error = _attach(args.address, args.namespace, ATTACH_TIMEOUT_SECS)
        if error is not None:
            print(
                f"raykv stats: error: cannot attach to Ray at {args.address!r}: {error}",
                file=sys.stderr,
            )
            return 2
        attached = True
    try:
        raw = collect(args.namespace)
    finally:
        if attached:
            ray.shutdown()
    if not raw:
        print(
            f"raykv stats: error: no raykv storage manager in namespace {args.namespace!r} "
            f"(is a raykv app running on this cluster? pass --namespace NS)",
            file=sys.stderr,
        )
        return 2
    summary = {name: summarize(stats) for name, stats in raw.items()}
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(format_table(summary))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `raykv stats [--namespace NS] [--address ADDR] [--json]` to the CLI."""
    p = subparsers.add_parser(
        "stats", help="per-tier entries, bytes, hit rate and evictions of a running cache"
    )
    p.add_argument(
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help=f"Ray namespace of the raykv actors (default: {DEFAULT_NAMESPACE})",
    )
    p.add_argument(
        "--address",
        default="auto",
        help="Ray cluster (GCS) address, e.g. 127.0.0.1:6379 (default: auto, the local "
        "cluster); token auth is used when ~/.ray/auth_token or RAY_AUTH_TOKEN is set",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_stats_command)
