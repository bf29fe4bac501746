"""Run each example in examples/ for real, with torchrun on CPU/gloo, and check what it prints.

Each torchrun costs seconds of process start-up on a small machine, so every
example runs once: train_3d and quickstart with the 8-process commands their
docstrings give, dtensor on 4 ranks through its ``--shape`` flag.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from scopedmesh import MeshLayout

# Each example runs under torchrun, as its docstring tells a user to: the launch lane.
pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT = 300.0


def torchrun(script: str, nproc: int, *args: str) -> str:
    """``torchrun --standalone --nproc_per_node=<nproc> examples/<script> <args>``; its stdout."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(EXAMPLES / script),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # A session of its own, so a timeout can end torchrun and every worker it started.
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(command)} timed out after {TIMEOUT} s\n{out}\n{err}")
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{out}\n{err[-5000:]}"
    return out


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_3d_matches_a_single_process_run(capsys: pytest.CaptureFixture[str]) -> None:
    steps = "5"
    out = torchrun("train_3d.py", 8, "--steps", steps)
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss (\S+)$", out, re.MULTILINE)]
    final = re.findall(r"^final_loss=(\S+)$", out, re.MULTILINE)
    assert len(losses) == 5 and len(final) == 1, out  # printed once, by rank 0

    train_3d = load_example("train_3d")
    with torch.random.fork_rng():
        train_3d.main(["--reference", "--steps", steps])
    reference_out = capsys.readouterr().out
    reference = [float(v) for v in re.findall(r"^step +\d+ +loss (\S+)$", reference_out, re.M)]
    reference_final = re.findall(r"^final_loss=(\S+)$", reference_out, re.MULTILINE)

    assert len(reference) == 5 and len(reference_final) == 1
    assert losses == pytest.approx(reference, abs=1e-5, rel=0)
    assert float(final[0]) == pytest.approx(float(reference_final[0]), abs=1e-5, rel=0)
    assert losses[-1] < losses[0]  # it does train


def test_quickstart_all_reduces_over_each_axis() -> None:
    out = torchrun("quickstart.py", 8)
    pattern = re.compile(
        r"^rank (\d+) \(dp=(\d), pp=(\d), tp=(\d)\): rank sums "
        r"dp=(\d+) pp=(\d+) tp=(\d+) pp\*tp=(\d+) world=(\d+); mesh closed=True$",
        re.MULTILINE,
    )
    rows = {int(m[1]): [int(v) for v in m.groups()[1:]] for m in pattern.finditer(out)}
    assert list(rows) == list(range(8)), out  # rank 0 prints them all, in rank order
    layout = MeshLayout((2, 2, 2), names=("dp", "pp", "tp"))
    for rank, (dp, pp, tp, *sums) in rows.items():
        coord = layout.unravel(rank)
        assert (dp, pp, tp) == coord
        expected = [sum(layout.group(coord, axes)) for axes in ("dp", "pp", "tp", ("pp", "tp"))]
        assert sums == [*expected, sum(range(8))]


def test_dtensor_runs_on_the_mesh() -> None:
    out = torchrun("dtensor.py", 4, "--shape", "1", "2", "2")
    # torch 2.9 prints "device: 'cpu', stride: (4, 2, 1)" after the shape, later releases "'cpu'".
    assert re.search(r"device mesh: DeviceMesh\(\(dp=1, pp=2, tp=2\), (device: )?'cpu'", out), out
    assert "y = x @ w: (8, 32) as (Shard(dim=0), Replicate(), Shard(dim=1)), local (8, 16)" in out
    match = re.search(r"^max error: matmul=(\S+) tp\+fsdp2 output=(\S+) grad=(\S+)$", out, re.M)
    assert match is not None, out
    assert all(float(error) < 1e-5 for error in match.groups())


def test_heal_survives_a_leaving_rank() -> None:
    """Rank 3 leaves at step 3; ranks 0-1 re-form a 1 x 2 mesh and match the reference."""
    out = torchrun("heal.py", 4)
    assert "lost ranks [3]; re-formed mesh (1, 2) over (0, 1)" in out, out
    assert "rank 2 sits out: rank 2 shares a dropped slice of axis 'dp'" in out, out
    rows = re.findall(r"^step +(\d+) replicas (\d) loss (\S+) reference (\S+)$", out, re.M)
    assert [int(n) for _, n, _, _ in rows] == [2, 2, 2, 1, 1, 1, 1, 1], out
    assert all(float(a) == pytest.approx(float(b), rel=1e-9) for _, _, a, b in rows)


def test_sweep_trains_every_layout_to_the_reference_losses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Four scoped blocks in one process per rank, (2, 2) twice: FSDP2 + TP losses all match."""
    out = torchrun("sweep.py", 4, "--steps", "4")
    rows = re.findall(r"^dp=(\d) tp=(\d) step (\d) loss (\S+)$", out, re.MULTILINE)
    sweep = load_example("sweep")
    assert [(int(dp), int(tp)) for dp, tp, step, _ in rows if step == "0"] == list(sweep.LAYOUTS)
    sweep.main(["--reference", "--steps", "4"])
    reference = [
        float(v)
        for v in re.findall(r"^reference step \d loss (\S+)$", capsys.readouterr().out, re.M)
    ]
    assert len(reference) == 4 and reference[-1] < reference[0]  # it does train
    for dp, tp, step, loss in rows:
        assert float(loss) == pytest.approx(reference[int(step)], abs=1e-12, rel=0), (dp, tp)
