"""The import rules between packages hold, everything is imported under `bulkinfer`, and the CLI
starts without the engine."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import REPO_ROOT

# The repository's top-level folders, imported as `bulkinfer.<folder>` (setup.py, bulkinfer/__init__.py).
PACKAGES = ("api", "engine", "jobs", "worker", "benchmarks")
# What each package may not import (benchmarks/ may import all: it measures every layer).
FORBIDDEN_IMPORTS = {
    "engine": {"jobs", "worker", "api", "benchmarks"},
    "jobs": {"engine", "worker", "api", "benchmarks", "torch"},
    "worker": {"api", "benchmarks"},
    "api": {"engine", "worker", "benchmarks", "torch", "transformers"},
}
# Module names other packages must not spell in code (by string: importlib, `python -m`, a task).
NAMED_BY_STRING = re.compile(r"\bbulkinfer\.(worker|engine|benchmarks)\.[a-z_]+")
# A module named by its old top-level name, in a string (`"worker.tasks.x"`, `-m api.cli`).
OLD_NAME_IN_STRING = re.compile(r"(?<![\w.\-/])(?:" + "|".join(PACKAGES) + r")\.([a-z_]\w*)")


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def imported_top_level_names(path: Path) -> set[str]:
    """Top-level names, a package of ours counted by its folder (`bulkinfer.engine.x` is `engine`)."""
    names = set()
    for module in imported_modules(path):
        parts = module.split(".")
        names.add(parts[1] if parts[0] == "bulkinfer" and len(parts) > 1 else parts[0])
    return names


def python_files() -> list[Path]:
    skipped = {".git", ".venv", "build", "dist", "__pycache__"}
    return [path for path in sorted(REPO_ROOT.rglob("*.py"))
            if not skipped & set(path.relative_to(REPO_ROOT).parts)]


def names_a_module_by_its_old_name(text: str) -> bool:
    """`worker.tasks` is an old name when ./worker/tasks(.py) exists; `worker.log` is only a file name."""
    return any((REPO_ROOT / match.group(0).split(".")[0] / match.group(1)).with_suffix(".py").is_file()
               or (REPO_ROOT / match.group(0).split(".")[0] / match.group(1) / "__init__.py").is_file()
               for match in OLD_NAME_IN_STRING.finditer(text))


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


def test_nothing_imports_our_packages_by_their_old_top_level_names() -> None:
    """Installed, only `bulkinfer` is a top-level package: `import engine` would fail there, and in a
    checkout it would load a second copy of the module next to `bulkinfer.engine`'s."""
    violations = [f"{path.relative_to(REPO_ROOT)} imports {module}" for path in python_files()
                  for module in sorted(imported_modules(path)) if module.split(".")[0] in PACKAGES]
    assert violations == []


def test_no_string_names_a_module_by_its_old_top_level_name() -> None:
    """`mock.patch("worker.tasks.x")`, `-m api.cli`, `celery -A worker.celery_app`, `"worker.main:f"`."""
    violations = [f"{path.relative_to(REPO_ROOT)}: {text!r}" for path in python_files()
                  if path.name != "test_package_rules.py"
                  for text in strings_in_code(path) if names_a_module_by_its_old_name(text)]
    assert violations == []
    assert names_a_module_by_its_old_name("celery -A worker.process.celery_app")  # the rule can fail
    assert not names_a_module_by_its_old_name("logs/worker.log and bulkinfer.worker.process.celery_app")


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
    # the rule has something to hold
    assert any(text.startswith("bulkinfer.worker.process.main:") for text in named)


def test_benchmarks_live_in_their_own_package() -> None:
    for package in ("engine", "jobs", "worker", "api"):
        stray = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / package).rglob("bench*.py"))
        assert stray == [], f"benchmarks belong in benchmarks/: {stray}"


def test_cli_help_starts_without_loading_torch_or_the_engine() -> None:
    heavy = "('torch', 'transformers', 'bulkinfer.engine')"
    probe = ("import sys; from bulkinfer.api.cli import main; main(['--help']); "
             f"print(sorted(m for m in sys.modules if m.startswith({heavy})))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True)
    assert "make-checkpoint" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_cli_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from bulkinfer.api.cli import main

    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
