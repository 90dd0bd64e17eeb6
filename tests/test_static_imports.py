"""Tools that read the code without running it resolve every `bulkinfer.*` import in a checkout: the
links in bulkinfer/ (`bulkinfer/engine -> ../engine`) make the namespace real on disk. jedi (the
completion engine behind many editors) goes to the definitions, and mypy types them (`LLM.generate`'s
real signature, not Any)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "benchmarks", "engine", "jobs", "worker")


@pytest.mark.parametrize(("source", "defined_in", "line"), [
    ("from bulkinfer.engine import LLM\nLLM", "engine/llm.py", "class LLM"),
    ("from bulkinfer import Client\nClient", "api/client/client.py", "class Client"),
    ("from bulkinfer.worker.hosts import engine_rows\nengine_rows", "worker/hosts/engine_rows.py", None),
])
def test_jedi_goes_to_each_definition(source: str, defined_in: str, line: str | None) -> None:
    import jedi

    script = jedi.Script(source, path=REPO / "scratch.py", project=jedi.Project(REPO))
    [definition] = script.goto(line=2, column=0, follow_imports=True)
    assert definition.module_path is not None
    assert Path(definition.module_path).resolve() == (REPO / defined_in).resolve()
    if line is not None:
        assert definition.get_line_code().startswith(line)


def test_mypy_sees_the_real_types_through_the_namespace(tmp_path: Path) -> None:
    """Against the cache `make test`'s `mypy` run leaves (seconds); alone, mypy checks the packages
    first (a minute or two)."""
    from mypy import api

    probe = tmp_path / "probe.py"
    probe.write_text("from bulkinfer import Client\nfrom bulkinfer.engine import LLM\n"
                     "from bulkinfer.worker.hosts import engine_rows\n\n"
                     "reveal_type(LLM.generate)\nreveal_type(Client)\nreveal_type(engine_rows.EngineRun)\n")
    out, err, code = api.run([str(probe), "--config-file", str(REPO / "pyproject.toml"),
                              "--cache-dir", str(REPO / ".mypy_cache")])
    assert code == 0, out + err
    generate, client, run = [line for line in out.splitlines() if "Revealed type" in line]
    assert "-> list[bulkinfer.engine.outputs.RequestOutput]" in generate
    assert "-> bulkinfer.api.client.client.Client" in client
    assert "-> bulkinfer.worker.hosts.engine_rows.EngineRun" in run
    assert "Any" not in generate.split("Revealed type is")[1][:40]


def test_each_package_folder_is_linked_under_bulkinfer() -> None:
    """The links the tools follow; Python itself imports through them too (no run-time path change)."""
    import bulkinfer
    import bulkinfer.engine

    for name in PACKAGES:
        link = REPO / "bulkinfer" / name
        assert link.is_symlink() and link.resolve() == (REPO / name).resolve(), name
    assert list(bulkinfer.__path__) == [str(REPO / "bulkinfer")]
    assert Path(bulkinfer.engine.__file__).resolve() == (REPO / "engine" / "__init__.py").resolve()
