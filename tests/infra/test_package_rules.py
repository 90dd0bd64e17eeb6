"""The import rules between packages hold, and the CLI starts without the engine."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import REPO_ROOT

# What each package may not import (benchmarks/ may import all: it measures every layer).
FORBIDDEN_IMPORTS = {
    "engine": {"jobs", "worker", "api", "benchmarks"},
    "jobs": {"engine", "worker", "api", "benchmarks", "torch"},
    "worker": {"api", "benchmarks"},
    "api": {"engine", "worker", "benchmarks", "torch", "transformers"},
}
# Module names other packages must not spell in code (by string: importlib, `python -m`, a task).
NAMED_BY_STRING = re.compile(r"\b(worker|engine|benchmarks)\.[a-z_]+")


def imported_top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def strings_in_code(path: Path) -> list[str]:
    """Every string constant of the module but its docstrings (prose may name modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_package_does_not_import_what_it_must_not(package: str) -> None:
    violations = [
        f"{path.relative_to(REPO_ROOT)} imports {name}"
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        for name in imported_top_level_names(path) & FORBIDDEN_IMPORTS[package]
    ]
    assert violations == []


def test_only_the_cli_names_worker_or_engine_modules_and_only_by_string() -> None:
    """api/cli/ starts commands and processes by "module:function" and `-m module` strings; the rest
    of api/ (the HTTP service and the SDK) never names the worker's or the engine's modules."""
    outside_cli = [path for path in sorted((REPO_ROOT / "api").rglob("*.py"))
                   if (REPO_ROOT / "api" / "cli") not in path.parents]
    violations = [f"{path.relative_to(REPO_ROOT)}: {text!r}" for path in outside_cli
                  for text in strings_in_code(path) if NAMED_BY_STRING.search(text)]
    assert violations == []
    named = [text for path in (REPO_ROOT / "api" / "cli").rglob("*.py") for text in strings_in_code(path)
             if NAMED_BY_STRING.search(text)]
    assert any(text.startswith("worker.main:") for text in named)  # the rule has something to hold


def test_benchmarks_live_in_their_own_package() -> None:
    for package in ("engine", "jobs", "worker", "api"):
        stray = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / package).rglob("bench*.py"))
        assert stray == [], f"benchmarks belong in benchmarks/: {stray}"


def test_cli_help_starts_without_loading_torch_or_the_engine() -> None:
    heavy = "('torch', 'engine', 'transformers')"
    probe = ("import sys; from api.cli import main; main(['--help']); "
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True)
    assert "make-checkpoint" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_cli_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from api.cli import main

    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
