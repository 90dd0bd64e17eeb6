"""The documentation keeps up with the code: the README stays a short user guide, every `bulkinfer`
command and every setting is documented, and every relative link (and its #anchor) resolves."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from bulkinfer.api.cli import COMMANDS
from bulkinfer.jobs.settings import ENVIRONMENT_NAMES, Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 500

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def _documentation() -> str:
    return "\n".join(path.read_text() for path in [README, *DOCS])


# ---------------------------------------------------------------- commands


def _command_module(target: str) -> str:
    return target.split(":")[0]


def _nested_commands(module_name: str) -> list[str]:
    """The subcommands a command's module defines: an argparse parser's subparsers (`models fetch`,
    `schedule pause`) or a dispatch table (`bench embed`). Only modules whose source defines one are
    imported, so the walk never loads torch."""
    source = Path(importlib.util.find_spec(module_name).origin).read_text()
    if "add_subparsers" not in source and "TARGETS" not in source:
        return []
    module = importlib.import_module(module_name)
    if isinstance(getattr(module, "TARGETS", None), dict):
        return list(module.TARGETS)
    names: list[str] = []
    for value in vars(module).values():
        if not callable(value) or getattr(value, "__module__", None) != module_name:
            continue
        if getattr(value, "__name__", "") != "_parser":
            continue
        parser = value()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                names += list(action.choices)
    return names


def every_command() -> list[str]:
    """Every `bulkinfer` command line a user can type, as the CLI itself defines them."""
    commands: list[str] = []
    for name, command in COMMANDS.items():
        commands.append(name)
        commands += [f"{name} {sub}" for sub in _nested_commands(_command_module(command.target))]
    return commands


def undocumented_commands(commands: list[str], text: str) -> list[str]:
    """A top-level command must appear as `bulkinfer NAME`; a nested one as `NAME SUB` (the
    parent's `bulkinfer` may be a table row or a line away)."""
    missing = []
    for command in commands:
        words = command.split(" ")
        phrase = command if len(words) > 1 else f"bulkinfer {command}"
        if not re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", text):
            missing.append(command)
    return missing


def test_the_command_walk_finds_nested_commands() -> None:
    commands = every_command()
    for expected in ["submit", "serve worker", "models fetch", "models import", "bench embed",
                     "bench faults", "schedule pause", "schedule jobs"]:
        assert expected in commands


def test_every_bulkinfer_command_is_documented() -> None:
    missing = undocumented_commands(every_command(), _documentation())
    assert not missing, f"commands in no page of README.md or docs/: {missing}"


def test_a_command_missing_from_the_pages_is_reported() -> None:
    text = "Run `bulkinfer submit rows.jsonl`, then `bench engine` and `bulkinfer models`."
    assert undocumented_commands(["submit", "bench engine", "bench embed", "models", "upload"], text) == [
        "bench embed", "upload"]
    assert undocumented_commands(["up"], "bulkinfer upload") == ["up"]  # a prefix is not a mention


# ---------------------------------------------------------------- settings


def test_every_setting_and_its_variable_is_in_the_configuration_page() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    for field in Settings.model_fields:
        variable = ENVIRONMENT_NAMES.get(field)
        assert variable, f"setting {field} has no environment name in jobs/settings.py"
        assert re.search(rf"^\| `{field}` \| `{variable}` \|", page, re.M), (
            f"setting {field} ({variable}) has no row in docs/configuration.md")
    for variable in ["BULKINFER_API_URL", "BULKINFER_API_KEY", "BULKINFER_CONFIG"]:
        assert f"`{variable}`" in page, f"{variable} is not in docs/configuration.md"


# ---------------------------------------------------------------- links


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than `-` and `_`
    removed, each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for match in HEADING.finditer(_without_code_blocks(path.read_text())):
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_without_code_blocks(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading with that anchor in {linked.name})")
    return broken


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda path: path.name)
def test_relative_links_resolve(path: Path) -> None:
    assert not broken_links(path), f"{path.relative_to(ROOT)}: {broken_links(path)}"


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## On a GPU: `gpu_check.sh`\n\n"
                                       "```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#on-a-gpu-gpu_checksh) [gone](missing.md) [bad](other.md#not-a-heading)\n"
                    "[web](https://example.com/x.md) [self](#title)\n\n# Title\n")
    assert broken_links(page) == ["missing.md (no such file)",
                                  "other.md#not-a-heading (no heading with that anchor in other.md)"]


def test_github_slugs() -> None:
    assert github_slug("Tuning the engine for this machine: `bulkinfer tune`") == (
        "tuning-the-engine-for-this-machine-bulkinfer-tune")
    assert github_slug("`bench engine --structured`") == "bench-engine---structured"
    assert github_slug("Embeddings (engine/embedder.py)") == "embeddings-engineembedderpy"


# ---------------------------------------------------------------- the README


def test_the_readme_stays_a_short_user_guide() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference text to docs/")
