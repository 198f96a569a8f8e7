"""The package's import graph: no module imports, even lazily inside a function, one that imports it back.

Imports under ``if TYPE_CHECKING:`` never run, so they are not edges (that is what the guard is for)."""
from __future__ import annotations

import ast

from tests.conftest import ROOT


def _module_name(path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def import_graph(package: str = "pipeline") -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, read from the source (nothing is imported)."""
    paths = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert "pipeline.data.records" in graph["pipeline.data.folder"]  # the graph sees relative imports
    assert "pipeline.model.build" in graph["pipeline.config"]  # ... and imports inside a function
    assert "pipeline.config" not in graph["pipeline.model.build"]  # ... but not type-only ones
    assert find_cycles(graph) == []


def test_find_cycles_sees_one():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
