"""Vocabulary-parallel log-softmax as a region op: `_log_softmax` with its softmax dim split.

The rows: DTensor's (any layout that keeps the softmax dim whole, the plain op) plus the softmax
dim split, run as the kernel `log_softmax(dim=d)` (as `torch.distributed.tensor.parallel.
loss_parallel` does): the row max and the sum of exponentials are all-reduced over the splitting
axes, so the whole logits never exist on one device. Backward is `grad - softmax * sum(grad)`, the
sum all-reduced. Per splitting axis: forward all-reduces (MAX, then SUM), backward one (SUM), each
of a tensor of the input's local shape with `d` of size 1. Those are the op's own collectives:
priced here, listed in the plan, executed by `ShardedLogSoftmax`.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from meshplan.cost_model.estimate import compute_time, steps_time
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost
from meshplan.ir.placement import Shard, local_shape
from meshplan.ir.regions import KernelRow, RegionOp, Row
from meshplan.runtime.collectives import MeshComm, all_reduce_axes, forward_phase

LOG_SOFTMAX = torch.ops.aten._log_softmax.default


def kernel_dim(kernel: str) -> int:
    """`'log_softmax(dim=1)'` -> 1."""
    m = re.fullmatch(r"log_softmax\(dim=(-?\d+)\)", kernel)
    if not m:
        raise AssertionError(f"not a log_softmax kernel: {kernel!r}")
    return int(m.group(1))


def split_axes(strategy) -> tuple[int, ...]:
    """Mesh axes that split the softmax dim: the kernel's all-reduces run over them."""
    dim = kernel_dim(strategy.kernel)
    return tuple(a for a, p in enumerate(strategy.outputs[0]) if p == Shard(dim))


def _all_reduce(t: torch.Tensor, axes: tuple[int, ...], comm: MeshComm, phase: str, op: str = "sum") -> torch.Tensor:
    return all_reduce_axes(t, comm, axes, phase, "all_reduce inside a sharded log_softmax", op)


class _ShardedLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axes: tuple[int, ...], comm: MeshComm) -> torch.Tensor:
        ctx.dim, ctx.axes, ctx.comm = dim, axes, comm
        phase = forward_phase()
        m = _all_reduce(x.detach().amax(dim, keepdim=True), axes, comm, phase, "max")
        z = x - m
        s = _all_reduce(z.exp().sum(dim, keepdim=True), axes, comm, phase)
        out = z - s.log()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        total = _all_reduce(grad.sum(ctx.dim, keepdim=True), ctx.axes, ctx.comm, "backward")
        # grad - exp(out) * total, in one buffer: the logits' gradient is the largest tensor of a language model's
        # step, and the expression as written held two more of its size at once (the peak walk counts the result alone)
        return out.exp().mul_(total).neg_().add_(grad), None, None, None


class ShardedLogSoftmax(nn.Module):
    """`_log_softmax(x, dim)` with `dim` split over mesh `axes`."""

    def __init__(self, dim: int, axes: tuple[int, ...], comm: MeshComm) -> None:
        super().__init__()
        self.dim, self.axes, self.comm = dim, axes, comm

    def forward(self, x, dim=None, half_to_float=False):
        return _ShardedLogSoftmax.apply(x, self.dim, self.axes, self.comm)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, all-reduces over mesh axes {self.axes}"


class VocabParallelLogSoftmax(RegionOp):
    name = "log_softmax"
    ops = (LOG_SOFTMAX,)

    def reads_block_positions(self, strategy, args, axis: int) -> bool:
        """Its max and sum reduce over the softmax dim and every other index is computed on its own: no block's place
        is read, in any token order."""
        return False

    def rule(self, args, kwargs) -> list[Row]:
        x = args[0]
        dim = args[1] % x.ndim
        rows: list[Row] = [[Shard(d), Shard(d)] for d in range(x.ndim) if d != dim]
        if x.dtype in (torch.float32, torch.float64):  # the kernel keeps the input's dtype (no half_to_float)
            rows.append(KernelRow([Shard(dim), Shard(dim)], f"log_softmax(dim={dim})"))
        return rows

    def cost(self, node, in_metas, strategy, mesh_shape, cluster, *, backward: bool) -> RegionCost | None:
        if not strategy.kernel:
            return None
        axes = split_axes(strategy)
        shape = list(local_shape(node.outputs[0].shape, strategy.outputs[0], mesh_shape))
        shape[kernel_dim(strategy.kernel)] = 1
        nbytes = node.outputs[0].itemsize * math.prod(shape)
        forward = tuple(CommStep("all_reduce", a, reduce=r, nbytes=nbytes) for a in axes for r in ("max", "sum"))
        back = tuple(CommStep("all_reduce", a, nbytes=nbytes) for a in axes) if backward else ()
        compute = compute_time(node.target, in_metas, node.outputs, strategy.outputs, mesh_shape, cluster, backward=backward,
                               in_layouts=strategy.inputs)
        return RegionCost(compute_s=compute, forward=forward, backward=back,
                          comm_s=steps_time(forward, mesh_shape, cluster) + steps_time(back, mesh_shape, cluster))

    def local_module(self, strategy, comm: MeshComm, args) -> ShardedLogSoftmax | None:
        if not strategy.kernel:
            return None
        return ShardedLogSoftmax(kernel_dim(strategy.kernel), split_axes(strategy), comm)


LOG_SOFTMAX_REGION = VocabParallelLogSoftmax()
