"""The public surface: exported names, layering, and the lazy torch import."""

from __future__ import annotations

import subprocess
import sys

import scopedmesh


def test_all_is_pinned() -> None:
    assert sorted(scopedmesh.__all__) == [
        "AxisError",
        "CoordinateError",
        "Decision",
        "GroupFormationError",
        "JobFinishedError",
        "JobMismatchError",
        "JobView",
        "LivenessWatch",
        "LostRankError",
        "MeshClosedError",
        "MeshLayout",
        "NoLiveReplicaError",
        "ProcessGroupMesh",
        "Replicas",
        "StepError",
        "__version__",
        "agree_on_lost",
        "job_view",
        "node_aware_mesh",
        "node_aware_ranks",
        "reform",
        "shrink",
        "world_nodes",
    ]
    for name in scopedmesh.__all__:
        assert getattr(scopedmesh, name) is not None


def test_unknown_attribute_raises_attribute_error() -> None:
    try:
        scopedmesh.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_scopedmesh_leaves_torch_out() -> None:
    modules = _modules_after(
        "import scopedmesh, scopedmesh.layout, scopedmesh.errors, scopedmesh.layout.placement"
    )
    assert "scopedmesh.layout" in modules
    assert "torch" not in modules


def test_process_group_mesh_loads_torch_on_use() -> None:
    modules = _modules_after("from scopedmesh import ProcessGroupMesh")
    assert "torch.distributed" in modules
    assert "scopedmesh.mesh" in modules


def test_replicas_loads_on_use() -> None:
    modules = _modules_after("from scopedmesh import Replicas")
    assert "scopedmesh.fault.replicas" in modules
    assert "scopedmesh.fault.replicas" not in _modules_after("import scopedmesh")


def test_layers_import_downward_only() -> None:
    """layout imports no torch; mesh never imports interop or cli at import time."""
    modules = _modules_after("import scopedmesh.mesh")
    assert "scopedmesh.mesh.interop" not in modules
    assert "scopedmesh.plan.cli" not in modules
