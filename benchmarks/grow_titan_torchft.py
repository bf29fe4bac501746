"""torchtitan's own torchft trainer, killed and restarted, on CPU and gloo:
``python -m benchmarks.grow_titan_torchft [--steps 120] [--sync-quorum] [--no-init-sync]``
(needs torchtitan 0.3.0 and torchft 0.2.0).

torchtitan 0.3.0's ``FaultTolerantTrainer`` (``torchtitan/experiments/torchft``:
HSDP whose replicate dimension is torchft's dynamic replica group, a
``torchft.Manager`` per replica group, its ``TorchFTOptimizersContainer`` and its
``TorchFTCheckpointManager``, whose in-memory state dict a healing replica
receives) on the model of ``examples/titan_replicas.py``: llama3's debug model
(6 layers, causal SDPA), 3 replica groups x 2 ranks (FSDP2 inside each), one
``torchrun --nproc-per-node 2 --max-restarts 3`` agent per replica group, a
Lighthouse in this process (``min_replicas=2``; by default the values of
``benchmarks.grow_torchft``: join timeout and quorum tick 100 ms, heartbeat
timeout 200 ms). Once every group has committed 3 steps with all 3, a random rank
of a random group other than 0 is SIGKILLed; its agent restarts the group. Each
worker records, per ``should_commit``, its time, step, ``num_participants()`` and
the verdict; the figures are ``benchmarks.grow``'s (death -> reduced, start ->
full, the survivors' stall, equal state).

It does not run on CPU as shipped, and each worker changes what it must:

- ``torchtitan.tools.utils`` sets ``device_type = _get_available_device_type() or
  "cuda"``; the trainer's ``__init__`` calls ``torch.cuda.set_device``
  ("RuntimeError: Found no NVIDIA driver on your system"). Each worker sets
  ``device_type = "cpu"`` (and ``device_module`` to ``torch.cpu`` with the device
  name, properties and memory statistics torchtitan's metrics ask for:
  "AttributeError: module 'torch.cpu' has no attribute 'get_device_name'") before
  torchtitan's other modules import them; the gloo backend follows.
- The tokenizer and the ``c4_test`` set live in torchtitan's source tree, not in
  the wheel: the launcher writes a word-level tokenizer and a small text set.
- FlexAttention has no backward on CPU: causal SDPA, as in ``tests/titan``.
- gloo has neither AVG nor PREMUL_SUM ("RuntimeError: Cannot use ReduceOp.PREMUL_SUM
  with Gloo" in FSDP2's reduce-scatter): FSDP2 sums and divides, as
  ``examples/titan_replicas.py`` does.

Then it trains, and fails at its first heal (docs/torchtitan.md quotes each run):
a source replica serves its state from torchft's quorum thread, and torchtitan's
model ``state_dict`` hook (``_split_qkv_on_save``) redistributes the fused
``wqkv`` DTensor, a collective on the replica's FSDP2 group, while the training
thread runs FSDP2's own collectives on it: gloo aborts the source ("op.preamble.length
<= op.nbytes ... Is there a distributed collective mismatch"). ``--sync-quorum``
(torchft's ``use_async_quorum=False``, set on the Manager after the trainer made
it) keeps the training thread out of the way; ``--no-init-sync`` skips the heal
at step 0. The launcher prints each distinct error line of the agents' logs when
the job never trains whole.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPLICAS, LOCAL = 3, 2
LIGHTHOUSE = {"join_timeout_ms": 100, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 200}
SEQ, BATCH = 16, 2
# A worker's failure, in its agent's log: the run stops there.
FATAL = (
    "Fatal Python error",
    "got exception in recovery",
    "ChildFailedError",
)  # tokens per sequence; sequences per rank per step (4 per replica)


# ------------------------------------------------------------------ the worker


class _Cpu:
    """``torch.cpu`` with what torchtitan asks of a device module (a name, properties,
    memory statistics): the CPU has none of those."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: Any = None) -> Any:
        return argparse.Namespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def set_device(self, device: Any) -> None:
        return None


def _on_cpu() -> None:
    """torchtitan picks "cuda" where no accelerator is found; make it the CPU, before its
    other modules copy ``device_type`` and ``device_module``."""
    import torch
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", _Cpu()  # type: ignore[assignment]
    utils.get_local_device = lambda: torch.device("cpu")  # type: ignore[assignment]


def _digest(trainer: Any) -> str:
    import torch

    from scopedmesh.fault.state_transfer import local

    model = trainer.model_parts[0]
    state = {
        "model": {k: v.detach() for k, v in model.named_parameters()},
        "optim": [o.state_dict() for o in trainer.optimizers.optimizers],
    }
    buffer = io.BytesIO()
    torch.save(local(state), buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def _parallelize_summing(model: Any, **kwargs: Any) -> Any:
    """torchtitan's ``parallelize_llama``, then FSDP2 told to sum and divide: gloo has
    neither AVG nor PREMUL_SUM (as ``examples/titan_replicas.py`` does)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.llama3 import parallelize_llama

    model = parallelize_llama(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def worker(
    replica: int, steps: int, assets: str, out: str, sync_quorum: bool, init_sync: bool
) -> None:
    started = time.time()
    _on_cpu()
    import torch
    from torchtitan.experiments.torchft.llama3 import model_registry
    from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel
    from torchtitan.models.common.attention import ScaledDotProductAttention

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    config = llama3_torchft_debugmodel()
    config.model_spec = model_registry("debugmodel")
    config.model_spec.parallelize_fn = _parallelize_summing
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.hf_assets_path = str(Path(assets, "tokenizer"))
    config.dataloader.dataset_path = str(Path(assets, "c4_test"))
    config.profiler.enable_profiling = False
    config.validator.enable = False
    config.activation_checkpoint = None
    config.training.seq_len = SEQ
    config.training.local_batch_size = BATCH
    config.training.steps = steps
    config.training.mixed_precision_param = "float32"
    config.training.mixed_precision_reduce = "float32"
    config.compile.enable = False
    config.metrics.log_freq = 1
    config.checkpoint.enable = True  # the in-memory state a healing replica receives
    config.checkpoint.interval = 10**6
    config.checkpoint.folder = "checkpoint"
    config.dump_folder = str(Path(out, f"dump{replica}"))
    config.comm.init_timeout_seconds = 60
    config.comm.train_timeout_seconds = 60
    ft = config.fault_tolerance
    ft.enable, ft.semi_sync_method, ft.process_group = True, None, "gloo"
    ft.replica_id, ft.group_size, ft.min_replica_size = replica, REPLICAS, 2
    ft.process_group_timeout_ms = 10000
    built = time.time()
    trainer = config.build()
    manager = trainer.ft_manager.manager
    if sync_quorum:  # the quorum, and a source's state_dict, on the loop's time
        manager._use_async_quorum = False
    if not init_sync:  # no heal at step 0: every group starts from one seed
        manager._init_sync = False
    commits: list[list[Any]] = []
    record = Path(out, f"r{replica}c{rank}-{os.getpid()}.json")

    def write(extra: dict[str, Any] | None = None) -> None:
        tmp = record.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"started": started, "built": built, "commits": commits, **(extra or {})})
        )
        tmp.replace(record)

    should_commit = manager.should_commit

    def recorded(*args: Any, **kwargs: Any) -> bool:
        ok = bool(should_commit(*args, **kwargs))
        commits.append([time.time(), trainer.step, manager.num_participants(), ok])
        write()
        return ok

    manager.should_commit = recorded
    trainer.train()
    write({"digest": _digest(trainer), "final_step": trainer.step})
    trainer.close()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------ the launcher


def _records(out: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    found = {}
    for path in out.glob("r*c*-*.json"):
        r, rest = path.stem[1:].split("c", 1)
        c, pid = rest.split("-")
        try:
            found[(int(r), int(c), int(pid))] = json.loads(path.read_text())
        except ValueError:
            continue
    return found


def _errors(out: Path) -> str:
    """Each distinct error line of the agents' logs, with how often it came."""
    marks = (
        "Error:",
        "Error ",
        "what():",
        "Fatal Python error",
        "Timed out",
        "timeout",
        "exception",
    )
    found: dict[str, int] = {}
    for path in sorted(out.glob("agent*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if any(m in line for m in marks) and "lspci" not in line:
                key = line.split("] ", 1)[-1][:300] if line.startswith("[rank") else line[:300]
                found[key] = found.get(key, 0) + 1
    return "\n".join(f"{n:4} x {line}" for line, n in found.items())


def _tally(out: Path) -> str:
    """Per replica group (its rank 0, every incarnation): the commits by participants."""
    tally: dict[int, dict[str, int]] = {}
    for (r, c, _), rec in sorted(_records(out).items()):
        if c == 0:
            for _, _, n, ok in rec["commits"]:
                key = f"{n} participants" if ok else "not committed"
                tally.setdefault(r, {})[key] = tally.setdefault(r, {}).get(key, 0) + 1
    return f"steps per replica group: {tally}"


def _stop(agents: list[subprocess.Popen[bytes]], out: Path) -> None:
    """End every agent and every worker: SIGTERM (an agent stops its workers), then SIGKILL
    for what is left (workers run in sessions of their own: by the pids they recorded)."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    for _, _, pid in _records(out):
        try:  # only a worker of this run: a pid may have been reused since
            if str(out) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def run(
    steps: int, bound: float, rng: random.Random, lighthouse_ms: dict[str, int], flags: list[str]
) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    from scopedmesh.interop.titan_assets import write_assets

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, **lighthouse_ms)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_assets(folder / "assets")
        out = folder / "out"
        out.mkdir()
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=address, OMP_NUM_THREADS="1")
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as examples/grow_replicas.py
        root = Path(__file__).resolve().parents[1]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        agents = []
        for replica in range(REPLICAS):
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command += ["--nproc-per-node", str(LOCAL), "--max-restarts", "3"]
            command += ["--monitor-interval", "0.1", "-m", "benchmarks.grow_titan_torchft"]
            command += ["--worker", str(replica), "--steps", str(steps)]
            command += ["--assets", str(folder / "assets"), "--out", str(out), *flags]
            with open(out / f"agent{replica}.log", "w") as log:  # the agent keeps its copy
                agent = subprocess.Popen(
                    command, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            agents.append(agent)
        deadline = time.monotonic() + bound
        killed: tuple[int, int, int, float] | None = None
        try:

            def full_commits(r: int) -> int:
                return sum(
                    n == REPLICAS and ok
                    for (rr, _, _), rec in _records(out).items()
                    if rr == r
                    for _, _, n, ok in rec["commits"]
                )

            while not all(full_commits(r) >= 3 for r in range(REPLICAS)):
                failed = any(m in _errors(out) for m in FATAL)
                if (
                    failed
                    or time.monotonic() > deadline
                    or any(a.poll() is not None for a in agents)
                ):
                    codes = [a.poll() for a in agents]
                    raise RuntimeError(
                        f"no 3 commits with all {REPLICAS} replica groups in every group "
                        f"(agents' exit codes {codes}, None: running); {_tally(out)}"
                    )
                time.sleep(0.5)  # each look reads the agents' logs
            time.sleep(rng.uniform(0.0, 1.0))
            victim = (rng.randrange(1, REPLICAS), rng.randrange(LOCAL))
            pid = max(p for (r, c, p) in _records(out) if (r, c) == victim)
            os.kill(pid, signal.SIGKILL)
            killed = (*victim, pid, time.time())
            for agent in agents:
                agent.wait(max(1.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, RuntimeError) as error:
            raise RuntimeError(f"{error}; the agents' errors:\n{_errors(out)}") from error
        finally:
            _stop(agents, out)
            lighthouse.shutdown()
        return {"records": _records(out), "killed": killed, "codes": [a.returncode for a in agents]}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The kill's figures, as ``benchmarks.grow`` reports them."""
    records, (vr, vc, vpid, killed) = result["records"], result["killed"]
    survivor = next(rec for (r, c, _), rec in records.items() if (r, c) == (0, 0))
    commits = [(t, step, n) for t, step, n, ok in survivor["commits"] if ok]
    times = [t for t, _, _ in commits]
    steps = [b - a for a, b in itertools.pairwise(times)]
    reduced = next((t for t, _, n in commits if t > killed and n < REPLICAS), None)
    joiner = [rec for (r, c, p), rec in records.items() if (r, c) == (vr, vc) and p != vpid]
    restarted = min(rec["started"] for rec in joiner)
    mine = next(rec for rec in joiner if rec["started"] == restarted)
    first_full = next(t for t, _, n, ok in mine["commits"] if ok and n == REPLICAS)
    around = [b - a for a, b in itertools.pairwise(times) if b > restarted and a < first_full]
    digests: dict[int, set[str]] = {}
    for (_, c, _), rec in records.items():
        if "digest" in rec:
            digests.setdefault(c, set()).add(rec["digest"])
    return {
        "victim": (vr, vc),
        "death_to_reduced": None if reduced is None else reduced - killed,
        "start_to_full": first_full - restarted,
        "built_to_full": first_full - mine["built"],
        "stall": (max(around) if around else float("nan")) - statistics.median(steps),
        "median_step": statistics.median(steps),
        "equal": all(len(d) == 1 for d in digests.values()) and len(digests) == LOCAL,
        "digests": {c: sorted(d) for c, d in digests.items()},
        "ended": sorted({rec.get("final_step") for rec in records.values() if "digest" in rec}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--assets", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=1, help="runs, one kill each")
    parser.add_argument("--bound", type=float, default=600.0, help="seconds for one run")
    parser.add_argument(
        "--sync-quorum",
        action="store_true",
        help="torchft's quorum waited for (not in the background)",
    )
    parser.add_argument("--no-init-sync", action="store_true", help="no heal at step 0")
    parser.add_argument("--join-timeout-ms", type=int, default=LIGHTHOUSE["join_timeout_ms"])
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=LIGHTHOUSE["heartbeat_timeout_ms"]
    )
    args = parser.parse_args()
    if args.worker is not None:
        worker(
            args.worker, args.steps, args.assets, args.out, args.sync_quorum, not args.no_init_sync
        )
        return
    flags = ["--sync-quorum"] * args.sync_quorum + ["--no-init-sync"] * args.no_init_sync
    lighthouse_ms = dict(
        LIGHTHOUSE,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    load = os.getloadavg()
    print(
        f"torchtitan's torchft trainer: {REPLICAS} replica groups x {LOCAL} ranks (FSDP2), "
        f"llama3 debug model, gloo, {args.steps} steps, Lighthouse {lighthouse_ms}, "
        f"quorum {'sync' if args.sync_quorum else 'async'}, init_sync {not args.no_init_sync}; "
        f"load {load[0]:.1f}/{load[1]:.1f}"
    )
    rng = random.Random()
    for i in range(1, args.kills + 1):
        try:
            row = figures(run(args.steps, args.bound, rng, lighthouse_ms, flags))
        except RuntimeError as error:  # the job never trained whole: say why, and stop
            print(f"kill {i}: no figures: {error}")
            sys.exit(1)
        print(
            f"kill {i} {row['victim']}: death->reduced {row['death_to_reduced']}, "
            f"start->full {row['start_to_full']:.3f} s (trainer built->full "
            f"{row['built_to_full']:.3f} s), stall {row['stall']:.3f} s (median step "
            f"{row['median_step']:.3f} s), equal state {row['equal']}, ended at {row['ended']}"
        )
    load = os.getloadavg()
    print(f"load {load[0]:.1f}/{load[1]:.1f} after")


if __name__ == "__main__":
    main()
