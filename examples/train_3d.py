"""Train a small MLP with data x pipeline x tensor parallelism over one mesh.

    torchrun --standalone --nproc_per_node=8 examples/train_3d.py --steps 5
    python examples/train_3d.py --reference --steps 5    # the same run, one process

The mesh is (dp=2, pp=2, tp=2). The model is `pp` residual MLP blocks and a
linear head; pipeline stage s holds block s (the last stage also the head):

- tp: each block's first linear layer is column-parallel and its second
  row-parallel, so a block costs one all_reduce over tp forward and one backward;
- pp: stage s sends its activations to stage s+1 and receives their gradient back;
- dp: each replica trains on a slice of the batch; gradients are averaged over dp.

Weights are initialised in full from one seed on every rank, then sharded, so in
float64 the losses match the single-process run to ~1e-12.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scopedmesh import ProcessGroupMesh

# ---------------------------------------------------------------- the model


class Block(nn.Module):
    """x -> x + down(tanh(up(x)))"""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def build_model(args: argparse.Namespace) -> nn.Sequential:
    """The full model, identical on every rank: `pp` blocks, then a linear head."""
    torch.manual_seed(args.seed)
    blocks = [Block(args.dim, args.hidden) for _ in range(args.pp)]
    return nn.Sequential(*blocks, nn.Linear(args.dim, 1)).double()


def get_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`, identical on every rank: y = sin(x @ teacher)."""
    teacher = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed + 1 + step)
    x = torch.randn(args.batch, args.dim, generator=g)
    return x.double(), torch.sin(x @ teacher / args.dim**0.5).double()


# ------------------------------------------------------- tensor parallelism


class CopyToTP(torch.autograd.Function):
    """Identity forward; all_reduce the gradient over tp backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """all_reduce over tp forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelBlock(nn.Module):
    """A Block split over tp: this rank keeps `hidden / tp` of the hidden units."""

    def __init__(self, full: Block, tp: dist.ProcessGroup, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp = tp
        share = full.up.out_features // tp_size
        units = slice(tp_rank * share, (tp_rank + 1) * share)
        self.up_weight = nn.Parameter(full.up.weight[units].detach().clone())  # column-parallel
        self.up_bias = nn.Parameter(full.up.bias[units].detach().clone())
        self.down_weight = nn.Parameter(full.down.weight[:, units].detach().clone())  # row-parallel
        self.down_bias = nn.Parameter(full.down.bias.detach().clone())  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(CopyToTP.apply(x, self.tp), self.up_weight, self.up_bias))
        partial = F.linear(h, self.down_weight)  # this rank's share of down(h)
        return x + ReduceFromTP.apply(partial, self.tp) + self.down_bias


# ----------------------------------------------------------------- training


def train_3d(args: argparse.Namespace) -> list[float]:
    """Train on the (dp, pp, tp) mesh; return the global loss of each step (on every rank)."""
    losses = []
    with ProcessGroupMesh(args.dp, args.pp, args.tp, names=("dp", "pp", "tp")) as mesh:
        # Every rank asks for its groups in the same order.
        dp = mesh.get_group_along_axis("dp")
        pp = mesh.get_group_along_axis("pp")
        tp = mesh.get_group_along_axis("tp")
        stage = mesh.local_rank("pp")  # this rank's stage: its rank in the pp group
        dp_rank, tp_rank = mesh.local_rank("dp"), mesh.local_rank("tp")
        first, last = mesh.is_first("pp"), mesh.is_last("pp")

        full = build_model(args)
        block = ParallelBlock(full[stage], tp, tp_rank, args.tp)
        head = full[-1] if last else None
        params = list(block.parameters()) + (list(head.parameters()) if head else [])
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)

        for step in range(args.steps):
            x, y = get_batch(step, args)
            x, y = x.chunk(args.dp)[dp_rank], y.chunk(args.dp)[dp_rank]  # this replica's slice

            # Forward: receive activations from the previous stage (or take the data).
            if first:
                inputs = x
            else:
                inputs = torch.empty_like(x)
                dist.recv(inputs, group=pp, group_src=stage - 1)
                inputs.requires_grad_()
            outputs = block(inputs)

            # Backward: the last stage starts it; the others wait for their gradient.
            loss = torch.zeros((), dtype=torch.float64)
            if last:
                loss = F.mse_loss(head(outputs), y)
                loss.backward()
            else:
                dist.send(outputs.detach(), group=pp, group_dst=stage + 1)
                grad = torch.empty_like(outputs)
                dist.recv(grad, group=pp, group_src=stage + 1)
                outputs.backward(grad)
            if not first:
                dist.send(inputs.grad, group=pp, group_dst=stage - 1)

            # Data parallelism: average the gradients over dp, then step.
            for p in params:
                dist.all_reduce(p.grad, group=dp)
                p.grad /= args.dp
            optimizer.step()
            optimizer.zero_grad()

            # The global loss: average over dp on the last stage, then share it along pp.
            loss = loss.detach()
            if last:
                dist.all_reduce(loss, group=dp)
                loss /= args.dp
            dist.broadcast(loss, group=pp, group_src=args.pp - 1)
            losses.append(loss.item())
    return losses


def train_reference(args: argparse.Namespace) -> list[float]:
    """The same model, data and optimizer in one process: the losses train_3d must match."""
    model = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = get_batch(step, args)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true", help="run in one process")
    args = parser.parse_args(argv)
    if args.batch % args.dp or args.hidden % args.tp:
        parser.error("--batch must divide by --dp and --hidden by --tp")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.reference:
        losses, printer = train_reference(args), True
    else:
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
        losses, printer = train_3d(args), dist.get_rank() == 0
        dist.destroy_process_group()
    if printer:
        for step, loss in enumerate(losses, 1):
            print(f"step {step:3d}  loss {loss:.12f}")
        print(f"final_loss={losses[-1]:.17g}")


if __name__ == "__main__":
    main()
