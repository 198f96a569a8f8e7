"""The package's import graph: no module imports, even lazily inside a function or only for its types
(``if TYPE_CHECKING:``), one that imports it back."""
from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import ROOT, clean_env


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
        for node in ast.walk(ast.parse(path.read_text())):
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
    assert "pipeline.model.vit_config" in graph["pipeline.config"]  # ... and imports inside a function
    assert find_cycles(graph) == []


def test_the_model_package_depends_on_nothing_above_it():
    """pipeline.model is the bottom layer beside pipeline.utils: it reads params through a Protocol of its
    own, so a model can be built and loaded without the pipeline's config, data or training code."""
    graph = import_graph()
    above = {d for name, deps in graph.items() if name.startswith("pipeline.model") for d in deps
             if not d.startswith("pipeline.model")}
    assert above <= {"pipeline.utils"}, above


def test_find_cycles_sees_one():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_two_modules_share_a_name():
    """A file's name says what it holds once: no module of the library, the stages, the benchmarks or
    infra shares its name with another (a stage's entry point and the library code it runs included)."""
    seen: dict[str, list[str]] = {}
    for folder in ("pipeline", "stages", "benchmarks", "infra"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py":
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_checking_params_and_sharding_load_no_torch_and_a_training_driver_no_torchvision():
    """Every stage checks the whole of params.yaml first, the shard stage too, which never builds a model; a
    training stage's driver hands its ranks the loop and never decodes an image. On a 2-core machine torch
    costs such a process ~1.5 CPU-s and torchvision ~2 more, at every stage start."""
    code = ("import sys; from pipeline.config import load_params; load_params('params.yaml'); import stages.shard; "
            "print('torch' in sys.modules); import stages.pretrain, stages.finetune; "
            "print('torchvision' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False"]
