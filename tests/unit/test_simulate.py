"""`raykv simulate`: formats, sizes, outputs and one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from raykv import simulate
from raykv.policies import make_policy


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="raykv")
    simulate.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


@pytest.fixture()
def ids() -> list[int]:
    rng = np.random.default_rng(0)
    return (rng.zipf(1.1, 5_000) % 500).tolist()


def _expected(policy: str, size: int, ids: list[int]) -> float:
    return make_policy(policy, size).simulate(ids) / len(ids)


def test_csv_trace_with_percentage_sizes_prints_a_table(tmp_path, ids, capsys) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("time,id\n" + "".join(f"{i},{k}\n" for i, k in enumerate(ids)))
    assert _cli(["--policy", "lru,s3fifo,sieve", "--size", "1%", str(path)]) == 0
    out = capsys.readouterr().out
    size = round(len(set(ids)) / 100)
    assert f"1% ({size})" in out
    assert f"{_expected('sieve', size, ids):.4f}" in out
    assert out.count("\n") == 5


def test_lines_and_oracle_formats_give_the_same_answer(tmp_path, ids, capsys) -> None:
    lines = tmp_path / "trace.txt"
    lines.write_text("\n".join(map(str, ids)) + "\n")
    oracle = tmp_path / "trace.oracleGeneral"
    rec = np.zeros(len(ids), dtype=[("t", "<u4"), ("id", "<u8"), ("s", "<u4"), ("n", "<i8")])
    rec["id"] = ids
    rec.tofile(oracle)
    docs = []
    for path in (lines, oracle):
        assert _cli(["--json", "--policy", "fifo", "--size", "50,10%", str(path)]) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0]["results"] == docs[1]["results"]
    assert docs[0]["results"][0]["miss_ratio"] == _expected("fifo", 50, ids)


def test_csv_column_is_selectable(tmp_path, capsys) -> None:
    path = tmp_path / "t.csv"
    path.write_text("key,other\na,1\nb,1\na,1\n")
    assert _cli(["--json", "--column", "key", "--size", "5", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["misses"] == 2


def test_plot_writes_an_image(tmp_path, ids) -> None:
    path = tmp_path / "t.txt"
    path.write_text("\n".join(map(str, ids)))
    out = tmp_path / "curve.png"
    assert _cli(["--policy", "lru,fifo", "--size", "1%,5%,20%", "--plot", str(out), str(path)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "content,argv,message",
    [
        (None, [], "does not exist"),
        ("1\n2 3\n", [], ":2: expected one id per line"),
        ("1\n2\n", ["--policy", "nope"], "unknown policy 'nope'; known: arc"),
        ("1\n2\n", ["--size", "0"], "cache size '0' is invalid"),
        ("1\n2\n", ["--size=-5%"], "cache size '-5%' is invalid"),
        ("", [], "has no requests"),
        ("1\n2\n", ["--size", "inf%"], "cache size 'inf%' is invalid"),
        ("1\n2\n", ["--size", "1e400%"], "cache size '1e400%' is invalid"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_code_2(tmp_path, capsys, content, argv, message):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_text(content)
    assert _cli([*argv, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("raykv simulate: error:")


def test_csv_without_the_column_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,b\n1,2\n")
    assert _cli([str(path)]) == 2
    assert "no column 'id'" in capsys.readouterr().err


def test_truncated_oracle_file_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "t.oracleGeneral"
    path.write_bytes(b"\0" * 30)
    assert _cli([str(path)]) == 2
    assert "24-byte" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,expected",
    [
        ("42", 42),
        ("0", 0),
        ("01", "01"),
        ("+1", "+1"),
        ("1_0", "1_0"),
        ("-3", "-3"),
        ("\u0661", "\u0661"),
        ("\u00b2", "\u00b2"),
        ("abc", "abc"),
    ],
)
def test_only_canonical_ascii_digit_strings_become_ints(text: str, expected: object) -> None:
    assert simulate._id(text) == expected and type(simulate._id(text)) is type(expected)


def test_distinct_string_ids_stay_distinct(tmp_path, capsys) -> None:
    path = tmp_path / "t.txt"
    path.write_text("1\n01\n+1\n1_0\n10\n1\n")
    assert _cli(["--json", "--size", "10", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unique"] == 5 and doc["results"][0]["misses"] == 5


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1000])
def test_oracle_reader_matches_numpy_on_full_64_bit_ids(tmp_path, n: int) -> None:
    """The pure-Python reader takes the id word of each 24-byte record, nothing else."""
    rng = np.random.default_rng(n)
    rec = np.zeros(n, dtype=[("t", "<u4"), ("id", "<u8"), ("s", "<u4"), ("n", "<i8")])
    rec["t"] = rng.integers(0, 2**32, n, dtype=np.uint64)
    rec["id"] = rng.integers(0, 2**64, n, dtype=np.uint64)
    rec["s"], rec["n"] = 0xFFFFFFFF, -1
    path = tmp_path / "t.oracleGeneral"
    rec.tofile(path)
    assert simulate.load_trace(str(path)) == rec["id"].tolist()


def test_absolute_sizes_skip_the_unique_count_unless_asked(tmp_path, capsys) -> None:
    path = tmp_path / "t.txt"
    path.write_text("1\n2\n1\n3\n")
    assert _cli(["--size", "2", str(path)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith(": 4 requests")
    assert _cli(["--size", "50%", str(path)]) == 0
    assert "4 requests, 3 unique objects" in capsys.readouterr().out
    assert _cli(["--json", "--size", "2", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["unique"] == 3


def test_progress_bar_is_not_imported_when_hidden(tmp_path) -> None:
    import subprocess
    import sys

    path = tmp_path / "t.txt"
    path.write_text("1\n2\n1\n")
    code = (
        "import sys; from raykv.cli import main; "
        f"rc = main(['simulate', '--size', '1', {str(path)!r}]); "
        "heavy = sorted(m for m in ('tqdm', 'numpy', 'yaml', 'raykv.config', 'raykv.keys') "
        "if m in sys.modules); print(rc, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "0 []"


def test_a_plot_that_cannot_be_written_keeps_the_results(tmp_path, capsys) -> None:
    """The run came first and the plot after it, outside the error handling: a plot
    path in a missing folder lost the whole run to a traceback."""
    path = tmp_path / "t.txt"
    path.write_text("1\n2\n1\n")
    assert _cli(["--plot", str(tmp_path / "missing" / "out.png"), str(path)]) == 2
    out, err = capsys.readouterr()
    assert "lru" in out and err.startswith("raykv simulate: error: cannot write")


def test_a_csv_field_past_the_csv_limit_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "t.csv"
    path.write_text("id\n" + "x" * (200 << 10) + "\n")
    assert _cli([str(path)]) == 2
    assert capsys.readouterr().err.startswith("raykv simulate: error:")
