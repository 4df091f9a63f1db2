"""Small helpers shared by the benchmarks: repeat-and-take-median timing and table printing."""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median wall time of `fn` over `repeats` runs after `warmup` unmeasured runs;
    `setup` (untimed) runs before each measured run."""
    return statistics.median(repeat_seconds(fn, repeats, warmup, setup))


def repeat_seconds(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Wall times of `fn` over `repeats` runs, as `median_seconds` takes them (for a
    figure's min-max: `spread` of the result)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def extent(values: Sequence[float], scale: float = 1.0) -> tuple[float, float]:
    """(min, max) of a figure's samples, times `scale` (a row's `value_range`)."""
    return min(values) * scale, max(values) * scale


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a plain, aligned text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print(line(r))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class Summary:
    """A benchmark's machine-readable results, written by `--json PATH` for the report.

    rows: one per figure, each beside its same-run baseline (`ratio` = value / baseline).
    goals: the project's targets with the measured value and whether they are met.
    plots: line or bar charts the report draws (see `benchmarks.runner.draw_plot`).
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []
        self.goals: list[dict[str, object]] = []
        self.plots: list[dict[str, object]] = []

    def row(
        self,
        name: str,
        value: float,
        unit: str,
        baseline: str = "",
        baseline_value: float | None = None,
        value_range: tuple[float, float] | None = None,
    ) -> None:
        """Record one figure (a median; `value_range`: its min and max over the repeats)
        and, optionally, its baseline from the same run."""
        ratio = value / baseline_value if baseline_value else None
        self.rows.append(
            {
                "name": name,
                "value": value,
                "unit": unit,
                "baseline": baseline,
                "baseline_value": baseline_value,
                "ratio": ratio,
                "range": list(value_range) if value_range else None,
            }
        )

    def goal(self, goal: str, value: float | str, met: bool | None, noisy: bool = False) -> None:
        """Record a goal, the measured value it is judged on, and whether it is met
        (`noisy`: the baseline's spread is wider than the gap, so neither can be said)."""
        self.goals.append({"goal": goal, "value": value, "met": met, "noisy": noisy})

    def plot(
        self,
        name: str,
        title: str,
        xlabel: str,
        ylabel: str,
        series: dict[str, list[list[float]]] | None = None,
        kind: str = "line",
        categories: list[str] | None = None,
        xscale: str = "linear",
    ) -> None:
        """Record a chart: `line` series are [[x, y], ...]; `bar` series are one y per category."""
        self.plots.append(
            {
                "name": name,
                "title": title,
                "xlabel": xlabel,
                "ylabel": ylabel,
                "kind": kind,
                "series": series or {},
                "categories": categories or [],
                "xscale": xscale,
            }
        )

    def write(self, path: str | None) -> None:
        """Write the summary as JSON to `path` (no-op when `path` is None)."""
        if not path:
            return
        import json
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        doc = {"rows": self.rows, "goals": self.goals, "plots": self.plots}
        Path(path).write_text(json.dumps(doc, indent=2, default=float))


def spread(times: list[float]) -> dict[str, float]:
    """min / median / max, and `iqr`: the middle half's width relative to the median (the
    noise measure: one stray repeat on a shared 2-core box must not hide a clear gap)."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    med = statistics.median(times)
    return {"min": min(times), "median": med, "max": max(times), "iqr": (q3 - q1) / med}


def interleave(
    fn: Callable[[int], object], base: Callable[[int], object], reps: int, between=None
) -> tuple[list[float], list[float]]:
    """Times of `fn(i)` and `base(i)`, alternating which goes first; `between` untimed."""
    a, b = interleave_all([fn, base], reps, between)
    return a, b


def interleave_all(
    fns: Sequence[Callable[[int], object]], reps: int, between=None
) -> list[list[float]]:
    """Times of each `fns[k](i)` over `reps` rounds, each round starting one further
    along the list (each goes first as often); `between` runs untimed after each call."""
    for f in fns:
        f(-1)
    if between:
        between()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(reps):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            t0 = time.perf_counter()
            fns[k](i)
            times[k].append(time.perf_counter() - t0)
            if between:
                between()
    return times


def judge(
    summary: Summary, goal: str, ratio: float, limit: float, higher: bool, noise: float
) -> bool:
    """Record `goal` (ratio vs limit); "noisy" instead of met/missed when the gap to the
    limit is within `noise` (the baseline's relative interquartile range)."""
    gap = abs(ratio - limit) / limit
    met = ratio >= limit if higher else ratio <= limit
    noisy = gap <= noise
    summary.goal(goal, round(ratio, 3), None if noisy else met, noisy)
    return met


@functools.cache
def testing_module() -> Any:
    """tests/raykv_testing.py, loaded by path since tests/ is no package: one set of
    helpers (a real redis-server, free loopback ports) for the tests and the benchmarks."""
    path = Path(__file__).resolve().parents[1] / "tests" / "raykv_testing.py"
    spec = importlib.util.spec_from_file_location("raykv_testing", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def redis_server_class() -> type:
    """`RedisServer` from tests/raykv_testing.py (a real redis-server on a free loopback
    port, stopped by PID)."""
    return testing_module().RedisServer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return testing_module().free_port()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank, NaNs dropped); NaN for none."""
    ordered = sorted(v for v in values if v == v)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
