"""The import rules between packages hold, and the CLI starts without the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import REPO_ROOT

FORBIDDEN_IMPORTS = {
    "engine": {"jobs", "worker", "api"},
    "api": {"engine", "torch", "transformers"},
    "jobs": {"engine", "worker", "api", "torch"},
}


def imported_top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_package_does_not_import_what_it_must_not(package: str) -> None:
    violations = [
        f"{path.relative_to(REPO_ROOT)} imports {name}"
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        for name in imported_top_level_names(path) & FORBIDDEN_IMPORTS[package]
    ]
    assert violations == []


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
