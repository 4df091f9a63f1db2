"""`import raykv` stays light: public names load on first use, torch and ray only then."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

import raykv
from raykv.cli import main as cli_main


def _fresh(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout.strip()


def test_import_raykv_loads_neither_torch_nor_ray():
    code = "import sys, raykv; print('torch' in sys.modules, 'ray' in sys.modules)"
    assert _fresh(code) == "False False"


def test_version_command_loads_neither_torch_nor_ray():
    code = (
        "import sys, contextlib, io\n"
        "from raykv.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--version'])\n"
        "print('torch' in sys.modules, 'ray' in sys.modules)"
    )
    assert _fresh(code) == "False False"


def test_tier_core_and_wire_records_load_neither_torch_nor_ray():
    # The tier core is plain Python (tested without Ray); the actors are its shells.
    code = (
        "import sys, pkgutil, importlib, raykv.tiers\n"
        "names = ['raykv.wire'] + ['raykv.tiers.' + m.name for m in "
        "pkgutil.iter_modules(raykv.tiers.__path__)]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names) > 5, 'torch' in sys.modules, 'ray' in sys.modules)"
    )
    assert _fresh(code) == "True False False"


def test_tier_actors_do_not_import_torch():
    code = (
        "import sys\n"
        "import raykv.actors.storage_manager, raykv.actors.cpu_store, raykv.actors.disk_store\n"
        "import raykv.actors.remote_store, raykv.actors.kv_server, raykv.actors.controller\n"
        "print('torch' in sys.modules)"
    )
    assert _fresh(code) == "False"


def test_installed_package_does_not_import_the_repo_benchmarks():
    code = (
        "import sys, contextlib, io\n"
        "from raykv.cli import main\n"
        "for argv in (['--version'], ['simulate', '--help'], ['config', 'show']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(any(m == 'benchmarks' or m.startswith('benchmarks.') for m in sys.modules))"
    )
    assert _fresh(code) == "False"


def test_all_lists_exactly_the_lazy_names():
    assert set(raykv.__all__) == {"__version__", *raykv._LAZY}


@pytest.mark.parametrize("name", raykv.__all__)
def test_every_public_name_resolves(name):
    assert getattr(raykv, name) is not None
    assert name in dir(raykv)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        raykv.nope  # noqa: B018


def test_a_subcommand_imports_only_its_own_module_and_help_lists_all():
    code = (
        "import sys, contextlib, io\n"
        "from raykv.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['simulate', '--help'])\n"
        "print(sorted(m for m in ('raykv.config', 'raykv.stats_cli', 'yaml') if m in sys.modules))"
    )
    assert _fresh(code) == "[]"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli_main(["--help"])
    assert all(name in out.getvalue() for name in ("config", "simulate", "stats"))


def _imports(path: Path) -> set[str]:
    """Every module a source file imports, at the top or inside a function."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_tier_core_never_imports_ray_or_the_actors_not_even_lazily():
    tiers = Path(raykv.__file__).parent / "tiers"
    for path in sorted(tiers.glob("*.py")):
        bad = sorted(
            n for n in _imports(path) if n.split(".")[0] == "ray" or n.startswith("raykv.actors")
        )
        assert not bad, f"{path.name} imports {bad}"


def test_no_module_of_the_package_is_over_800_lines():
    root = Path(raykv.__file__).parent
    long = {
        str(p.relative_to(root)): n
        for p in root.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 800
    }
    assert not long, f"split these modules: {long}"
