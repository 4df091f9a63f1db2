"""The README's two commands are the project's contract with a newcomer and with CI."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)
    return [
        line.strip() for line in blocks[0].splitlines() if line.strip() and not line.startswith("#")
    ]


def test_readme_opens_with_exactly_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text.index("```")
    assert text[:first_block].count("\n") < 6, "the commands must open the README"
    assert len(_readme_commands()) == 2


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _readme_commands()[1]
    assert "pytest" in test_command
    assert f"TEST_COMMAND='{test_command}'" in (ROOT / ".ci" / "run").read_text()


def test_readme_main_job_installs_torch_cpu_first():
    main_job = _readme_commands()[0]
    assert main_job.startswith("pip install torch==2.13.0 ")
    assert "examples/quickstart.py" in main_job
