"""raykv.cpus: which cores an engine process's helper threads run on (`helper_cpus`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from raykv import RayKVConfig
from raykv.cpus import helper_cpus, parse_cpus, run_on, starting_on
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


def test_config_takes_auto_empty_or_a_list_and_names_the_field_otherwise():
    assert RayKVConfig().helper_cpus == "auto"
    assert RayKVConfig(helper_cpus="").helper_cpus == ""
    assert RayKVConfig(helper_cpus="1,3-4").helper_cpus == "1,3-4"
    with pytest.raises(ConfigError, match="helper_cpus.*'x-1'"):
        RayKVConfig(helper_cpus="x-1")


def test_off_or_an_explicit_list_is_taken_as_given():
    assert helper_cpus("") is None
    assert helper_cpus("1,3") == {1, 3}


@linux
def test_auto_gives_the_parents_cores_minus_the_bound_threads(monkeypatch):
    parent = os.sched_getaffinity(os.getppid())
    mine = sorted(os.sched_getaffinity(0) & parent)
    if len(parent) < 2 or not mine:
        pytest.skip("needs two cores the parent may use")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def bound_to_one() -> Any:
        os.sched_setaffinity(0, {mine[0]})  # as vLLM binds the model runner's main thread
        return helper_cpus("auto"), helper_cpus("auto", ranks=2)

    one_rank, two_ranks = in_thread(bound_to_one)
    assert one_rank == parent - {mine[0]}
    assert two_ranks is None  # vLLM's automatic binding: the other ranks' cores are unknown
    # Not bound (a GPU engine, the scheduler's process): nothing to move away from.
    assert in_thread(lambda: helper_cpus("auto")) is None


@linux
def test_auto_leaves_every_ranks_listed_cores_alone(monkeypatch):
    parent = os.sched_getaffinity(os.getppid())
    if len(parent) < 2:
        pytest.skip("needs two cores the parent may use")
    first, second = sorted(parent)[:2]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")

    def rank0() -> Any:
        os.sched_setaffinity(0, {first})
        return helper_cpus("auto", ranks=2)

    assert in_thread(rank0) == (parent - {first, second} or None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-")  # odd: leave the threads
    assert in_thread(rank0) is None


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
