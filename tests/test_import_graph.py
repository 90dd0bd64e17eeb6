"""No import circles between bulkinfer's modules: every import counts (module level, inside
functions, and type-only ones under TYPE_CHECKING), read from the source as import-graph tools read
it. A circle means two modules cannot be understood, tested or moved apart; each one is broken by a
module both sides import, or by turning a dependency the right way round (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "benchmarks", "engine", "jobs", "worker")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO / package).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(["bulkinfer", package, *parts])] = path
    for path in (REPO / "bulkinfer").glob("*.py"):
        files["bulkinfer" if path.stem == "__init__" else f"bulkinfer.{path.stem}"] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the bulkinfer modules it imports (`from x import name` counts as x.name where that is
    a module, else x)."""

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                target = owner(name)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_module_imports_itself_round_a_circle() -> None:
    found = circles(import_graph(module_files()))
    assert found == [], "import circles: " + "; ".join(" <-> ".join(sorted(component)) for component in found)


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph(module_files())
    # module level, type-only and inside a function
    assert "bulkinfer.engine.models.llama" in graph["bulkinfer.engine.models.moe"]
    assert "bulkinfer.worker.hosts.model_hosts" in graph["bulkinfer.worker.hosts.engine_rows"]
    assert "bulkinfer.engine.model_runner" in graph["bulkinfer.engine.parallel.rank_worker"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
