"""The imports inside scopedmesh/ form layers: no cycle, and each module imports only below it.

Every ``import`` statement counts, including those inside functions and under
``if TYPE_CHECKING:``, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scopedmesh

PACKAGE = Path(scopedmesh.__file__).resolve().parent

# Bottom to top (docs/ARCHITECTURE.md); a module imports only from its layer or below.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(f"scopedmesh.{name}" for name in layer.split())
    for layer in (
        "errors",
        "_ints _names _strided _indexing _families layout _seed survivors",
        "_closable _c10d",
        "_checks _scope _cache _device_mesh mesh heal",
        "interop",
        "_plan_math plan cli __main__",
    )
)
TORCH_FREE = LAYERS[0] | LAYERS[1] | LAYERS[5]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports, anywhere in its source (internal ones resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {
        name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def test_find_cycle_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"a"}}) == ["a", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_inside_functions_count(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from scopedmesh import mesh\n    import scopedmesh.cli\n")
    assert _imports("scopedmesh.m", source, {"scopedmesh.mesh"}) == {
        "scopedmesh.mesh",
        "scopedmesh.cli",
    }
    # The package's lazy ProcessGroupMesh is an import inside __getattr__.
    assert "scopedmesh.mesh" in _graph()["scopedmesh"]


def test_no_import_cycle_inside_scopedmesh() -> None:
    cycle = _find_cycle(_internal(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_mesh_never_imports_interop() -> None:
    graph = _internal(_graph())
    assert "scopedmesh.mesh" in graph["scopedmesh.interop"]
    reachable, todo = set(), ["scopedmesh.mesh"]
    while todo:
        for target in graph[todo.pop()] - reachable:
            reachable.add(target)
            todo.append(target)
    assert "scopedmesh.interop" not in reachable


def _layer(name: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if name in layer), None)


@pytest.mark.parametrize("name", sorted(set().union(*LAYERS)))
def test_module_imports_only_from_its_layer_or_below(name: str) -> None:
    graph = _graph()
    assert name in graph, f"{name} is listed in LAYERS but does not exist"
    own = _layer(name)
    assert own is not None
    above = sorted(t for t in _internal(graph)[name] if (_layer(t) or 0) > own)
    assert not above, f"{name} imports {above} from a higher layer"
    if name in TORCH_FREE:
        torch = sorted(t for t in graph[name] if t == "torch" or t.startswith("torch."))
        assert not torch, f"{name} must stay free of torch, imports {torch}"
