"""raykv.cpus: which cores an engine process's helper threads run on (`helper_cpus`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from raykv import RayKVConfig
from raykv.cpus import bound_cores, helper_cpus, parse_cpus, run_on, starting_on
from raykv.errors import ConfigError

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` on a thread of its own (its core changes stay there) and return its result."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if errors:
        raise errors[0]
    return out[0]


def test_cpu_lists_parse_like_linux_and_bad_ones_name_the_part():
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3, 5") == {0, 2, 3, 5}
    for bad, part in (("a", "'a'"), ("1-", "'1-'"), ("3-1", "'3-1'"), ("0,,1", "''"), ("", "''")):
        with pytest.raises(ValueError, match=part):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="0-2000000000"):  # not a set of 2e9 numbers
        parse_cpus("0-2000000000")


def test_config_takes_auto_empty_or_a_list_and_names_the_field_otherwise():
    assert RayKVConfig().helper_cpus == "auto"
    assert RayKVConfig(helper_cpus="").helper_cpus == ""
    assert RayKVConfig(helper_cpus="1,3-4").helper_cpus == "1,3-4"
    for bad in ("x-1", "99999999999"):
        with pytest.raises(ConfigError, match=f"helper_cpus.*'{bad}'"):
            RayKVConfig(helper_cpus=bad)


def test_the_cores_vllm_bound_are_read_from_each_openmp_form():
    assert bound_cores({"GOMP_CPU_AFFINITY": "0 1 3"}) == {0, 1, 3}
    assert bound_cores({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,4]"}) == {2, 4}
    assert bound_cores({"OMP_PLACES": "{5,6}"}) == {5, 6}
    assert bound_cores({}) is None
    assert bound_cores({"OMP_PLACES": "cores"}) is None  # not a list vLLM writes
    assert bound_cores({"GOMP_CPU_AFFINITY": "0-7:2"}) is None  # a stride: not read here


def test_off_or_an_explicit_list_is_taken_as_given():
    assert helper_cpus("") is None
    assert helper_cpus("1,3") == {1, 3}


def parent_cores() -> list[int]:
    if os.getppid() <= 1:
        pytest.skip("no parent process to read (the container's first process)")
    cores = sorted(os.sched_getaffinity(os.getppid()))
    if len(cores) < 2:
        pytest.skip("needs two cores the parent may use")
    return cores


@linux
def test_auto_gives_the_parents_cores_that_no_rank_computes_on():
    cores = parent_cores()
    first, rest = cores[0], set(cores[1:])
    bound = {"GOMP_CPU_AFFINITY": str(first)}  # as vLLM spawns a one-rank model runner
    assert helper_cpus("auto", env=bound) == rest
    # vLLM's automatic binding, several ranks: the others' cores are not known here.
    assert helper_cpus("auto", ranks=2, env=bound) is None
    # Every rank's cores listed: none of them is a helper core.
    listed = {**bound, "VLLM_CPU_OMP_THREADS_BIND": f"{first}|{cores[1]}"}
    assert helper_cpus("auto", ranks=2, env=listed) == (rest - {cores[1]} or None)
    # A process vLLM did not bind (a GPU engine, the scheduler's process): left alone.
    assert helper_cpus("auto", env={}) is None
    assert helper_cpus("auto", env={**bound, "VLLM_CPU_OMP_THREADS_BIND": "0-"}) is None
    # Every core the parent has is an engine core: nowhere else to go.
    every = ",".join(map(str, cores))
    assert helper_cpus("auto", env={"OMP_PLACES": f"{{{every}}}"}) is None


@linux
def test_auto_without_a_parent_to_read_leaves_the_threads(monkeypatch):
    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert helper_cpus("auto", env={"GOMP_CPU_AFFINITY": "0"}) is None


@linux
def test_threads_started_inside_run_on_the_cores_and_the_caller_goes_back():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores")

    def check() -> Any:
        os.sched_setaffinity(0, {cpus[0]})
        seen: list[set[int]] = []
        with starting_on(frozenset({cpus[1]})):
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
            t.join()
        return seen[0], os.sched_getaffinity(0)

    started, after = in_thread(check)
    assert started == {cpus[1]}
    assert after == {cpus[0]}


@linux
def test_cores_that_cannot_be_used_leave_the_thread_where_it_is(caplog):
    def check() -> Any:
        before = os.sched_getaffinity(0)
        run_on(frozenset({max(before) + 4096}))  # no such core here
        with starting_on(None):
            pass
        return before, os.sched_getaffinity(0)

    before, after = in_thread(check)
    assert after == before
    assert "cannot run on cores" in caplog.text
