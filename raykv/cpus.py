"""Cores for raykv's helper threads in an engine process (`helper_cpus`).

vLLM's CPU backend binds each model runner process's compute threads, its main thread
among them, to that rank's cores (`VLLM_CPU_OMP_THREADS_BIND`; it hands them to OpenMP
in the process's environment: `GOMP_CPU_AFFINITY`, `KMP_AFFINITY` or `OMP_PLACES`).
Every thread the main thread starts later inherits that binding: the connector's copy
threads, and Ray's own RPC threads, which `ray.init` starts in the runner process when
the connector attaches to Ray. They then take time on the cores the forward pass runs
on, while the cores vLLM leaves to everything else go unused. Measured at serving load
(two replicas on one engine core, docs/BENCHMARKS.md "Where the two-replica gap went"):
Ray's threads in the two runner processes took a tenth of that core. vLLM's own NIXL
connector moves its transfer work off those cores the same way.

Linux only (`os.sched_setaffinity(0, ...)` acts on the calling thread there); elsewhere,
and whenever the cores cannot be read or set, threads stay where they start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

AUTO = "auto"
MAX_CPU = 65535  # a larger number is a typo, not a core (and would not fit a CPU mask)
_ERRORS = (OSError, ValueError, OverflowError)


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
        if last < first or last > MAX_CPU:
            raise ValueError(f"{part!r} in {text!r} is not a range of CPUs 0-{MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def listed_cores(bind: str) -> frozenset[int]:
    """Every rank's cores in a `VLLM_CPU_OMP_THREADS_BIND` list (`"0-1|2-3"`)."""
    return parse_cpus(bind.replace("|", ","))


def bound_cores(env: Mapping[str, str]) -> frozenset[int] | None:
    """The cores vLLM bound this process's compute threads to, from the OpenMP settings it
    put in the environment; None when it bound none (or in a form not read here)."""
    try:
        if value := env.get("GOMP_CPU_AFFINITY", "").strip():  # "0 1 2"
            return parse_cpus(",".join(value.split()))
        if m := re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", "")):
            return parse_cpus(m.group(1))
        if m := re.fullmatch(r"\{([^{}]*)\}", env.get("OMP_PLACES", "").strip()):
            return parse_cpus(m.group(1))
    except ValueError:  # a stride or another form: not vLLM's list
        return None
    return None


def helper_cpus(
    setting: str, ranks: int = 1, env: Mapping[str, str] | None = None
) -> frozenset[int] | None:
    """The cores this process's helper threads should run on, or None to leave them.

    `setting` is `helper_cpus`: "" (leave them), a CPU list, or "auto": in a process
    vLLM bound (`bound_cores`), the cores its parent may use that no rank of the engine
    computes on. The ranks' cores are `VLLM_CPU_OMP_THREADS_BIND`'s when it lists them;
    under vLLM's automatic binding only this rank's are known, so an engine of several
    `ranks` is left alone. A process vLLM did not bind (a GPU engine, vLLM's scheduler
    process), or whose parent cannot be read, is left alone too."""
    if not setting or not hasattr(os, "sched_getaffinity"):
        return None
    if setting != AUTO:
        return parse_cpus(setting) or None
    env = os.environ if env is None else env
    compute = bound_cores(env)
    if compute is None:
        return None
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", AUTO)
    try:
        if bind not in (AUTO, "nobind"):
            compute |= listed_cores(bind)
        elif ranks > 1:
            return None
        parent = os.getppid()
        if parent <= 1:  # orphaned, or the container's first process: no launcher to ask
            return None
        spare = os.sched_getaffinity(parent) - compute
    except _ERRORS:  # the parent is gone or not ours to read; an odd bind: leave them
        return None
    return frozenset(spare) or None


def run_on(cpus: frozenset[int] | None) -> None:
    """Move the calling thread to `cpus` (a `ThreadPoolExecutor` initializer)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except _ERRORS as exc:  # none of them usable here: the thread stays where it is
        logger.warning("raykv: helper threads cannot run on cores %s: %s", sorted(cpus), exc)


def executor(name: str, workers: int, cpus: frozenset[int] | None) -> ThreadPoolExecutor:
    """A thread pool whose threads run on `cpus` (None: where they start)."""
    return ThreadPoolExecutor(workers, name, initializer=run_on, initargs=(cpus,))


@contextlib.contextmanager
def starting_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside the block (`ray.init`'s) run on `cpus`: the calling
    thread moves there for the block and back after it."""
    if not cpus:
        yield
        return
    try:
        before = os.sched_getaffinity(0)
    except _ERRORS:
        yield
        return
    run_on(cpus)
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before)
        except _ERRORS as exc:
            logger.warning("raykv: could not move this thread back to cores %s: %s", before, exc)
