"""The imports inside scopedmesh/ form layers, and each module's layer is its folder.

Bottom to top (docs/ARCHITECTURE.md): ``errors``, ``layout/`` (pure), ``c10d/``
(the torch boundary), ``mesh/``, ``fault/`` (the liveness watch, heal, replicas),
``interop/`` (optional integrations, leaves), ``launch/`` (the launcher of replicated jobs),
``plan/`` (pure), ``testing/``, then the public face (``__init__`` and ``__main__``).
A module imports only from its own layer or below; a module this test cannot
place fails it. Every ``import`` statement counts, including those inside
functions and under ``if TYPE_CHECKING:``, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scopedmesh

PACKAGE = Path(scopedmesh.__file__).resolve().parent

# Folders (and the one module that is a layer by itself), bottom to top.
LAYERS = (
    "errors",
    "layout",
    "c10d",
    "mesh",
    "fault",
    "interop",
    "launch",
    "plan",
    "testing",
    "public",
)
TORCH_FREE = frozenset({"errors", "layout", "plan"})


def layer_of(name: str) -> str | None:
    """The layer of module ``name`` from where it lies, or None where it cannot be placed.

    >>> layer_of("scopedmesh.layout.mesh_layout"), layer_of("scopedmesh.__main__")
    ('layout', 'public')
    >>> layer_of("scopedmesh.helpers") is None
    True
    """
    parts = name.split(".")
    if parts[0] != "scopedmesh":
        return None
    if len(parts) == 1 or parts[1] == "__main__":
        return "public" if len(parts) <= 2 else None
    if parts[1] == "errors" and len(parts) == 2:
        return "errors"
    if parts[1] in LAYERS[1:-1]:
        return parts[1]
    return None


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


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The import graph, parsed once for the module's tests (each only reads it)."""
    return _graph()


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


def test_imports_inside_functions_count(tmp_path: Path, graph: dict[str, set[str]]) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from scopedmesh import mesh\n    import scopedmesh.plan.cli\n")
    assert _imports("scopedmesh.m", source, {"scopedmesh.mesh"}) == {
        "scopedmesh.mesh",
        "scopedmesh.plan.cli",
    }
    # The package's lazy ProcessGroupMesh is an import inside __getattr__.
    assert "scopedmesh.mesh" in graph["scopedmesh"]


def test_no_import_cycle_inside_scopedmesh(graph: dict[str, set[str]]) -> None:
    cycle = _find_cycle(_internal(graph))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_mesh_never_imports_interop(graph: dict[str, set[str]]) -> None:
    graph = _internal(graph)
    assert "scopedmesh.mesh.process_group_mesh" in graph["scopedmesh.mesh.interop"]
    reachable, todo = set(), ["scopedmesh.mesh.process_group_mesh"]
    while todo:
        for target in graph[todo.pop()] - reachable:
            reachable.add(target)
            todo.append(target)
    assert "scopedmesh.mesh.interop" not in reachable


def test_integrations_are_leaves_nothing_imports(graph: dict[str, set[str]]) -> None:
    """An optional integration (an extra, e.g. torchtitan) is imported by its users only."""
    graph = _internal(graph)
    integrations = {name for name in graph if layer_of(name) == "interop"}
    assert "scopedmesh.interop.torchtitan" in integrations
    importers = sorted(
        name
        for name, targets in graph.items()
        if name not in integrations and targets & integrations
    )
    assert not importers, f"{importers} import an optional integration"


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in _modules() if layer_of(name) is None)
    assert not unplaced, f"modules outside the layer folders: {unplaced}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_imports_only_from_its_layer_or_below(name: str, graph: dict[str, set[str]]) -> None:
    own = layer_of(name)
    assert own is not None, f"{name} lies outside the layer folders"
    internal = _internal(graph)[name]
    above = sorted(t for t in internal if LAYERS.index(layer_of(t) or "public") > LAYERS.index(own))
    assert not above, f"{name} ({own}) imports {above} from a higher layer"
    if own in TORCH_FREE:
        torch = sorted(t for t in graph[name] if t == "torch" or t.startswith("torch."))
        assert not torch, f"{name} must stay free of torch, imports {torch}"
        torch_backed = sorted(t for t in internal if layer_of(t) not in TORCH_FREE)
        assert not torch_backed, f"{name} must stay free of torch, imports {torch_backed}"
