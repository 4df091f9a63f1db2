"""Run every raykv benchmark, each in its own subprocess, and write one report.

    python -m benchmarks [--quick] [--only keys,policies] [--no-write] [--out PATH]
    python -m benchmarks --record run.json     # also save the run
    python -m benchmarks --render run.json     # rewrite the report from it (new notes)

Each benchmark runs as `python -m benchmarks.bench_NAME [--quick] --json TMP` under a
time limit, in a fresh process (so Ray instances and memory never leak from one to
the next). The runner prints a summary (every figure beside its same-run baseline,
and the goals), then rewrites docs/BENCHMARKS.md (or --out) with the machine, the
exact command, and per benchmark: what it measures (its docstring), its output as
printed, its goals, PNG plots written beside the report, and the hand-written
analysis kept in `benchmarks/notes/NAME.md`. A benchmark that fails or times out is
reported as such; no figure is ever carried over from an earlier run.

Only the standard library is imported at module level: `--help` stays fast, and
tqdm / matplotlib load when a run needs them.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "BENCHMARKS.md"
# Hand-written analysis, one markdown file per benchmark (`NAME.md`), never in code:
# measurements change, the benchmark's code need not.
NOTES_DIR = Path(__file__).with_name("notes")
SOAK_NOTES = NOTES_DIR / "soak.md"
MAX_OUTPUT_LINES = 400  # per benchmark, in the report


@dataclass(frozen=True)
class Spec:
    """One benchmark: its short name, module, and time limits (seconds) per mode."""

    name: str
    module: str
    limit_quick: int
    limit_full: int

    @property
    def path(self) -> Path:
        return ROOT / (self.module.replace(".", "/") + ".py")

    def command(self, quick: bool, json_path: str | None = None) -> list[str]:
        """The argv that runs this benchmark (the interpreter is this one)."""
        cmd = [sys.executable, "-m", self.module]
        if quick:
            cmd.append("--quick")
        if json_path:
            cmd += ["--json", json_path]
        return cmd


BENCHMARKS: tuple[Spec, ...] = (
    Spec("keys", "benchmarks.bench_keys", 120, 300),
    Spec("policies", "benchmarks.bench_policies", 240, 900),
    Spec("tiers", "benchmarks.bench_tiers", 300, 1200),
    Spec("disk", "benchmarks.bench_disk", 300, 900),
    Spec("connector", "benchmarks.bench_connector", 300, 1200),
    Spec("ttft", "benchmarks.bench_ttft", 480, 2400),
    Spec("cluster", "benchmarks.bench_cluster", 480, 2400),
    Spec("peer", "benchmarks.bench_peer", 300, 900),
    Spec("datapath", "benchmarks.bench_datapath", 300, 900),
    Spec("vllm", "benchmarks.bench_vllm", 900, 2400),
    Spec("isolation", "benchmarks.bench_isolation", 900, 3000),
    Spec("serving", "benchmarks.bench_serving", 300, 7200),
    Spec("memory", "benchmarks.bench_memory", 300, 1800),
)


@dataclass
class Outcome:
    """What one benchmark run gave: status, output as printed, and its JSON summary."""

    name: str
    module: str
    command: str
    status: str  # "ok", "failed", "timed out"
    seconds: float
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    summary: dict[str, Any] | None = None
    plots: list[tuple[str, str]] = field(default_factory=list)  # (title, file name)


@dataclass(frozen=True)
class ModuleText:
    """A benchmark module's title and docstring (read without importing) and its notes."""

    title: str
    doc: str
    notes: str


def module_text(path: Path) -> ModuleText:
    """Read TITLE and the docstring of a benchmark module by parsing (no import), and its
    hand-written notes from `benchmarks/notes/NAME.md`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    consts[target.id] = node.value.value
    doc = ast.get_docstring(tree) or ""
    notes = NOTES_DIR / f"{path.stem.removeprefix('bench_')}.md"
    text = notes.read_text(encoding="utf-8").strip() if notes.exists() else ""
    return ModuleText(consts.get("TITLE", path.stem), doc, text)


def describe(doc: str) -> str:
    """A module docstring without its usage lines (indented `python ...` commands)."""
    keep = [line for line in doc.splitlines() if not line.lstrip().startswith("python ")]
    text = "\n".join(keep).strip()
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def select(only: str | None) -> list[Spec]:
    """The benchmarks named in `--only` (all when None); raises ValueError on unknown names."""
    if not only:
        return list(BENCHMARKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {s.name: s for s in BENCHMARKS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"unknown benchmark {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
        )
    return [s for s in BENCHMARKS if s.name in names]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a benchmark we started and everything in its process group (Ray included)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(
    spec: Spec,
    quick: bool,
    limit: float,
    workdir: Path,
    tick: Callable[[float], None] | None = None,
) -> Outcome:
    """Run one benchmark in a fresh process group under `limit` seconds and collect it."""
    json_path = workdir / f"{spec.name}.json"
    cmd = spec.command(quick, str(json_path))
    shown = shlex.join(["python", *cmd[1:3], *[a for a in cmd[3:] if a == "--quick"]])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # keep what a benchmark printed before a time-out
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    out_path, err_path = workdir / f"{spec.name}.out", workdir / f"{spec.name}.err"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True
        )
        timed_out = False
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                if elapsed > limit:
                    timed_out = True
                    _kill_group(proc)
                    break
                if tick:
                    tick(elapsed)
                time.sleep(0.5)
        except BaseException:
            _kill_group(proc)
            raise
    seconds = time.monotonic() - start
    summary = None
    if not timed_out and proc.returncode == 0 and json_path.exists():
        try:
            summary = json.loads(json_path.read_text())
        except ValueError:
            summary = None
    status = "timed out" if timed_out else ("ok" if proc.returncode == 0 else "failed")
    return Outcome(
        spec.name,
        spec.module,
        shown,
        status,
        seconds,
        proc.returncode,
        out_path.read_text(errors="replace"),
        err_path.read_text(errors="replace"),
        summary,
    )


# --------------------------------------------------------------------------- machine


def _first_line(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    """Total memory in GiB (Linux), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError):
        pass
    return None


def machine_info() -> dict[str, str]:
    """Everything about the machine the report states, except the load averages."""
    mem = memory_gib()
    gpu = _first_line(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    commit = _first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = _first_line(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {
        "CPU": f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()})",
        "memory": f"{mem:.1f} GiB" if mem else "unknown",
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "Ray": _version("ray"),
        "torch": _version("torch"),
        "GPU": gpu.replace("\n", "; ") if gpu else "none detected (nvidia-smi)",
        "git commit": (commit or "unknown") + (" with uncommitted changes" if dirty else ""),
    }


def load_average() -> str:
    """The 1/5/15-minute load averages as text."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


# --------------------------------------------------------------------------- tables


def fmt(value: object) -> str:
    """A table cell: floats to 3 significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    return str(value).replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned Markdown table."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def met_text(met: object, noisy: bool = False) -> str:
    """How a goal's `met` value reads in a table; "noisy" when the benchmark found the
    baseline's own spread wider than the gap between the figure and the goal."""
    if noisy:
        return "noisy"
    return {True: "met", False: "**missed**"}.get(met, "n/a")  # type: ignore[call-overload]


def status_text(o: Outcome) -> str:
    """'ok', 'FAILED (exit 1)' or 'TIMED OUT after N s'."""
    if o.status == "ok":
        return "ok" if o.summary is not None else "ok, but no JSON summary"
    if o.status == "timed out":
        return f"TIMED OUT after {o.seconds:.0f} s"
    return f"FAILED (exit {o.returncode})"


def runs_table(outcomes: Sequence[Outcome]) -> str:
    rows = [[o.name, f"`{o.command}`", status_text(o), f"{o.seconds:.1f}"] for o in outcomes]
    return markdown_table(["benchmark", "command", "status", "seconds"], rows)


def goal_rows(outcomes: Sequence[Outcome]) -> list[list[object]]:
    rows: list[list[object]] = []
    for o in outcomes:
        for g in (o.summary or {}).get("goals", []):
            met = met_text(g.get("met"), bool(g.get("noisy")))
            rows.append([o.name, g.get("goal"), g.get("value"), met])
    return rows


def figure_rows(outcomes: Sequence[Outcome]) -> list[list[object]]:
    rows: list[list[object]] = []
    for o in outcomes:
        for r in (o.summary or {}).get("rows", []):
            ratio = r.get("ratio")
            rows.append(
                [
                    o.name,
                    r.get("name"),
                    r.get("value"),
                    value_range(r.get("range")),
                    r.get("unit", ""),
                    r.get("baseline") or "-",
                    r.get("baseline_value"),
                    f"{ratio:.2f}" if isinstance(ratio, float) and ratio == ratio else "-",
                ]
            )
    return rows


def value_range(pair: object) -> str:
    """A figure's min-max over its repeats, where the benchmark recorded them."""
    if isinstance(pair, list) and len(pair) == 2:
        return f"{fmt(pair[0])}-{fmt(pair[1])}"
    return "-"


GOAL_HEADERS = ["benchmark", "goal", "value", "met"]
FIGURE_HEADERS = [
    "benchmark",
    "figure",
    "value",
    "min-max",
    "unit",
    "baseline (same run)",
    "baseline",
    "ratio",
]


# --------------------------------------------------------------------------- plots


def draw_plot(plot: dict[str, Any], path: Path) -> None:
    """Draw one plot spec from a benchmark summary (line or bar chart) to a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bar = plot.get("kind") == "bar"
    cats = plot.get("categories") or []
    fig, ax = plt.subplots(figsize=(7, 3.2 + (0.18 * len(cats) if bar else 0.6)), dpi=90)
    series: dict[str, list[Any]] = plot.get("series") or {}
    if bar:
        width = 0.8 / max(1, len(series))
        for i, (label, ys) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(ys))]
            ax.barh(xs, [y or 0 for y in ys], height=width, label=label)
        ax.set_yticks(range(len(cats)), cats, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(plot.get("ylabel", ""))
    else:
        colors = plt.get_cmap("tab20" if len(series) > 10 else "tab10").colors
        for i, (label, pts) in enumerate(series.items()):
            pts = sorted(pts)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", markersize=4, label=label, color=colors[i % len(colors)])
        ax.set_xscale(plot.get("xscale", "linear"))
        ax.set_xlabel(plot.get("xlabel", ""))
        ax.set_ylabel(plot.get("ylabel", ""))
    ax.set_title(plot.get("title", ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def draw_plots(outcomes: Sequence[Outcome], directory: Path) -> None:
    """Write every plot of every benchmark summary as `bench_<name>.png` into `directory`."""
    for o in outcomes:
        for plot in (o.summary or {}).get("plots", []):
            name = f"bench_{plot.get('name') or o.name}.png"
            try:
                draw_plot(plot, directory / name)
            except Exception as exc:  # a broken plot must not lose the report
                print(f"plot {name} failed: {exc}", file=sys.stderr)
                continue
            o.plots.append((str(plot.get("title", name)), name))


# --------------------------------------------------------------------------- report


def render_report(
    outcomes: Sequence[Outcome],
    *,
    command: str,
    quick: bool,
    started: datetime.datetime,
    total_seconds: float,
    machine: dict[str, str],
    load_start: str,
    load_end: str,
    rendered: str | None = None,
) -> str:
    """The Markdown report: header, machine, summary tables, then one section per benchmark.
    `rendered`: the command that rewrote it later from the recorded run (`--render`)."""
    mode = "quick (every benchmark's `--quick`: smaller sizes, fewer repeats)" if quick else "full"
    out = [
        "# raykv benchmarks",
        "",
        "Generated by `python -m benchmarks` (`benchmarks/runner.py`); do not edit by hand. "
        "The numbers come from the run described below; the analysis under each section is "
        "kept in `benchmarks/notes/` and says which run its figures are from. "
        "Every figure is printed beside a baseline measured in the same run: on a shared "
        "machine compare ratios, not absolute seconds.",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        f"- command: `{command}`",
        f"- mode: {mode}",
        f"- total wall time: {total_seconds / 60:.1f} min",
        *(
            [
                f"- rewritten from that run's record by `{rendered}`, with the modules' "
                "notes as they are now (written after the run); the figures are the run's"
            ]
            if rendered
            else []
        ),
        "",
        "## Machine",
        "",
        markdown_table(
            ["", ""],
            [
                *machine.items(),
                ("load average at start (1/5/15 min)", load_start),
                ("load average at end (1/5/15 min)", load_end),
            ],
        ),
        "",
        "## Summary",
        "",
        "### Runs",
        "",
        runs_table(outcomes),
        "",
    ]
    goals = goal_rows(outcomes)
    out += ["### Goals", ""]
    out += [markdown_table(GOAL_HEADERS, goals) if goals else "No goals were reported.", ""]
    for o in outcomes:
        if o.status != "ok" or o.summary is None:
            out.append(f"- {o.name}: {status_text(o)}, its goals are not evaluated.")
    if any(o.status != "ok" or o.summary is None for o in outcomes):
        out.append("")
    figures = figure_rows(outcomes)
    out += ["### Figures beside their baselines", ""]
    out += [markdown_table(FIGURE_HEADERS, figures) if figures else "No figures.", ""]
    for o in outcomes:
        out += section(o)
    if SOAK_NOTES.exists():
        out += [SOAK_NOTES.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(out).rstrip() + "\n"


def section(o: Outcome) -> list[str]:
    """One benchmark's section of the report."""
    spec = next((s for s in BENCHMARKS if s.name == o.name), None)
    text = module_text(spec.path) if spec else ModuleText(o.name, "", "")
    lines = [
        f"## {text.title} (`{o.command}`)",
        "",
        f"Status: {status_text(o)}, {o.seconds:.1f} s.",
        "",
    ]
    if text.doc:
        lines += ["What it measures:", "", describe(text.doc), ""]
    lines += ["### Output", ""]
    printed = o.stdout.rstrip().splitlines()
    if len(printed) > MAX_OUTPUT_LINES:
        printed = printed[:MAX_OUTPUT_LINES] + [
            f"... ({len(printed) - MAX_OUTPUT_LINES} more lines)"
        ]
    lines += ["```text", *(printed or ["(no output)"]), "```", ""]
    if o.status != "ok":
        tail = o.stderr.rstrip().splitlines()[-30:]
        lines += ["Last lines of its stderr:", "", "```text", *(tail or ["(empty)"]), "```", ""]
    goals = [g[1:] for g in goal_rows([o])]
    if goals:
        lines += ["### Goals", "", markdown_table(GOAL_HEADERS[1:], goals), ""]
    for title, name in o.plots:
        lines += [f"![{title}]({name})", ""]
    if text.notes:
        lines += ["### Notes", "", text.notes, ""]
    return lines


def print_summary(outcomes: Sequence[Outcome]) -> None:
    """The terminal summary: runs, goals, and every figure beside its baseline."""
    print("\n" + runs_table(outcomes))
    goals = goal_rows(outcomes)
    if goals:
        print("\n" + markdown_table(GOAL_HEADERS, goals))
    figures = figure_rows(outcomes)
    if figures:
        print("\n" + markdown_table(FIGURE_HEADERS, figures))


# --------------------------------------------------------------------------- CLI


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    """The runner's options (of `python -m benchmarks`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="benchmarks: "
        + ", ".join(s.name for s in BENCHMARKS)
        + ". Exit status 1 when any benchmark failed or timed out.",
    )
    parser.add_argument("--quick", action="store_true", help="every benchmark's quick mode")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="run only these benchmarks")
    parser.add_argument("--no-write", action="store_true", help="print only; write no files")
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        metavar="PATH",
        help="report to write; plots go beside it (default: docs/BENCHMARKS.md)",
    )
    parser.add_argument(
        "--timeout", type=float, metavar="S", help="time limit per benchmark, seconds"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print each benchmark's output as it ends"
    )
    parser.add_argument(
        "--record",
        metavar="JSON",
        help="also save the run (outputs, summaries, machine) to JSON, for --render",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="run nothing: rewrite the report from a run saved with --record, with the "
        "current notes in benchmarks/notes/ (analysis written after the run)",
    )
    return parser


def save_run(path: Path, outcomes: Sequence[Outcome], meta: dict[str, Any]) -> None:
    """Save a finished run (see `--record`): every outcome and the report's header facts."""
    runs = [{k: v for k, v in asdict(o).items() if k != "plots"} for o in outcomes]
    path.write_text(json.dumps({"meta": meta, "outcomes": runs}, indent=1), encoding="utf-8")


def load_run(path: Path) -> tuple[list[Outcome], dict[str, Any]]:
    """A run saved by `save_run`: its outcomes and header facts (`started` as a datetime)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    meta = dict(data["meta"])
    meta["started"] = datetime.datetime.fromisoformat(meta["started"])
    return [Outcome(**o) for o in data["outcomes"]], meta


def write_report(out: Path, outcomes: Sequence[Outcome], meta: dict[str, Any]) -> None:
    """Draw the plots beside `out` and write the report there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    draw_plots(outcomes, out.parent)
    out.write_text(render_report(outcomes, **meta), encoding="utf-8")
    print(f"report written to {out}")


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """Run the selected benchmarks, print the summary, write the report; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.render:
        outcomes, meta = load_run(Path(args.render))
        print_summary(outcomes)
        if not args.no_write:
            rendered = shlex.join([*prog.split(), "--render", Path(args.render).name])
            write_report(Path(args.out), outcomes, {**meta, "rendered": rendered})
        return 0 if all(o.status == "ok" for o in outcomes) else 1
    try:
        specs = select(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    from tqdm import tqdm

    command = shlex.join([*prog.split(), *argv])
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = load_average()
    machine = machine_info()
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="raykv-bench-run-") as tmp:
        bar = tqdm(specs, unit="bench", file=sys.stderr, dynamic_ncols=True)
        for spec in bar:
            limit = args.timeout or (spec.limit_quick if args.quick else spec.limit_full)
            bar.set_description(spec.name)

            def tick(elapsed: float, limit: float = limit) -> None:
                bar.set_postfix_str(f"{spec.name} {elapsed:.0f}s (limit {limit:.0f}s)")

            o = run_one(spec, args.quick, limit, Path(tmp), tick)
            outcomes.append(o)
            bar.write(f"{spec.name}: {status_text(o)} in {o.seconds:.1f} s")
            if args.verbose:
                bar.write(o.stdout.rstrip())
        bar.close()
    total = time.monotonic() - t0
    load_end = load_average()
    print_summary(outcomes)
    print(f"\ntotal {total / 60:.1f} min; load average {load_start} -> {load_end}")
    meta = {
        "command": command,
        "quick": args.quick,
        "started": started,
        "total_seconds": total,
        "machine": machine,
        "load_start": load_start,
        "load_end": load_end,
    }
    if args.record:
        save_run(Path(args.record), outcomes, {**meta, "started": started.isoformat()})
    if not args.no_write:
        write_report(Path(args.out), outcomes, meta)
    return 0 if all(o.status == "ok" for o in outcomes) else 1
