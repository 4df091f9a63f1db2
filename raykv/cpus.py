"""Cores for raykv's helper threads in an engine process (`helper_cpus`).

vLLM's CPU backend binds its model runner's compute threads, the runner's main thread
among them, to the cores of `VLLM_CPU_OMP_THREADS_BIND`. Every thread the main thread
starts later inherits that binding: the connector's copy threads, and Ray's own RPC
threads, which `ray.init` starts in the runner process when the connector attaches to
Ray. They would take time on the cores the forward pass runs on, while the cores vLLM
leaves to everything else go unused. Measured at serving load (two replicas on one core,
docs/BENCHMARKS.md): Ray's threads in the two runner processes alone took a tenth of that
core. vLLM's own NIXL connector moves its transfer work off those cores the same way.

Linux only (`os.sched_setaffinity` acts on the calling thread there); elsewhere, and
when the cores cannot be set, threads stay where they start.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

AUTO = "auto"


def parse_cpus(text: str) -> frozenset[int]:
    """`"0,2-3"` -> {0, 2, 3}: a Linux CPU list (commas, inclusive ranges).

    Raises ValueError naming the part that is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{part!r} in {text!r} is not a CPU number or range (like 0,2-3)")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"range {part!r} in {text!r} ends before it starts")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def helper_cpus(setting: str, ranks: int = 1) -> frozenset[int] | None:
    """The cores this process's helper threads should run on, or None to leave them.

    `setting` is `helper_cpus`: "" (leave them), a CPU list, or "auto": the cores this
    process's parent may use that no engine rank computes on. Those are the cores of
    `VLLM_CPU_OMP_THREADS_BIND` when it lists them (every rank's), else the calling
    thread's (the model runner's main thread, bound by vLLM) for a one-rank engine; a
    multi-rank engine under vLLM's automatic binding is left alone (the other ranks'
    cores are not known here). An engine whose main thread is not bound (a GPU engine,
    vLLM's scheduler process) has no such cores, and its threads stay where they are."""
    if not setting or not hasattr(os, "sched_getaffinity"):
        return None
    if setting != AUTO:
        return parse_cpus(setting) or None
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", AUTO)
    try:
        compute = set(os.sched_getaffinity(0))
        if bind not in (AUTO, "nobind"):
            compute |= parse_cpus(bind.replace("|", ","))
        elif ranks > 1:
            return None
        spare = os.sched_getaffinity(os.getppid()) - compute
    except (OSError, ValueError):  # the parent is gone or not ours; an odd bind: leave them
        return None
    return frozenset(spare) or None


def run_on(cpus: frozenset[int] | None) -> None:
    """Move the calling thread to `cpus` (a `ThreadPoolExecutor` initializer)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # none of them usable here: the thread stays where it is
        logger.warning("raykv: helper threads cannot run on cores %s: %s", sorted(cpus), exc)


@contextlib.contextmanager
def starting_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside the block (`ray.init`'s) run on `cpus`: the calling
    thread moves there for the block and back after it."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    run_on(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
