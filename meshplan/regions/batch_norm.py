"""Batch norm in training (`_native_batch_norm_legit_functional`) as a region op: shard the
channels, or the batch with synchronised statistics (SyncBN).

- Channels: every statistic is per channel, so each device normalises its channels exactly.
- Batch: each device holds part of the batch. The per-channel sum, sum of squares and count are
  all-reduced over the batch-split axes, so every rank normalises with the whole batch's
  statistics and updates the running statistics exactly as one device would (unbiased variance
  over the whole batch). Backward all-reduces the two per-channel gradient sums the input
  gradient needs; the weight and bias gradients stay this rank's partial sums, which the
  gradient sync adds up like any replicated parameter's. These all-reduces are the op's own
  collectives: priced here, listed in the plan, executed by `BatchNormShard`.
Outputs: out, saved mean, saved inverse std, new running mean, new running var.
"""

from __future__ import annotations

import torch
from torch import nn

from meshplan.cost_model.estimate import compute_time, steps_time
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost
from meshplan.ir.placement import Replicate, Shard, local_shape
from meshplan.ir.regions import RegionOp, Row
from meshplan.runtime.collectives import MeshComm, all_reduce_axes, forward_phase

BATCH_NORM = torch.ops.aten._native_batch_norm_legit_functional.default


def sync_axes(x_layout) -> tuple[int, ...]:
    """Mesh axes that split the batch of a batch norm's input: its statistics are summed over them."""
    return tuple(a for a, p in enumerate(x_layout) if p == Shard(0))


def _all_reduce(t: torch.Tensor, comm: MeshComm, axes: tuple[int, ...], phase: str) -> torch.Tensor:
    return all_reduce_axes(t, comm, axes, phase, "batch-norm statistics all_reduce")


class SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, axes):
        c = x.shape[1]
        dims = [0] + list(range(2, x.ndim))
        shape = [1, c] + [1] * (x.ndim - 2)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_tensor([x.numel() / c])])
        total = _all_reduce(local, comm, axes, forward_phase())
        n = total[-1]
        mean = total[:c] / n
        var = total[c : 2 * c] / n - mean * mean
        rstd = torch.rsqrt(var + eps)
        xhat = (x - mean.view(shape)) * rstd.view(shape)
        out = xhat * (weight.view(shape) if weight is not None else 1) + (bias.view(shape) if bias is not None else 0)
        new_mean = running_mean * (1 - momentum) + mean * momentum
        new_var = running_var * (1 - momentum) + var * (n / (n - 1)) * momentum
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.comm, ctx.axes, ctx.n, ctx.has = comm, axes, n, (weight is not None, bias is not None)
        ctx.mark_non_differentiable(mean, rstd, new_mean, new_var)
        return out, mean, rstd, new_mean, new_var

    @staticmethod
    def backward(ctx, grad, *_):
        xhat, rstd, weight = ctx.saved_tensors
        c = grad.shape[1]
        dims = [0] + list(range(2, grad.ndim))
        shape = [1, c] + [1] * (grad.ndim - 2)
        sum_dy, sum_dy_xhat = grad.sum(dims), (grad * xhat).sum(dims)
        total = _all_reduce(torch.cat([sum_dy, sum_dy_xhat]), ctx.comm, ctx.axes, "backward")
        scale = rstd * (weight if weight is not None else 1)
        dx = scale.view(shape) * (grad - total[:c].view(shape) / ctx.n - xhat * total[c:].view(shape) / ctx.n)
        dw = sum_dy_xhat if ctx.has[0] else None  # this rank's part: summed by the gradient sync
        db = sum_dy if ctx.has[1] else None
        return dx, dw, db, None, None, None, None, None, None


class BatchNormShard(nn.Module):
    def __init__(self, strategy, comm: MeshComm) -> None:
        super().__init__()
        self.axes = tuple(a for a in sync_axes(strategy.inputs[0]) if comm.mesh.shape[a] > 1)
        self.comm = comm

    def forward(self, x, weight, bias, running_mean, running_var, training, momentum, eps):
        if not self.axes or not training:
            return BATCH_NORM(x, weight, bias, running_mean, running_var, training, momentum, eps)
        return SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, self.comm, self.axes)

    def extra_repr(self) -> str:
        return f"statistics all-reduced over mesh axes {self.axes}" if self.axes else "local channels"


class BatchNorm(RegionOp):
    name = "batch_norm"
    ops = (BATCH_NORM,)

    def rule(self, args, kwargs) -> list[Row]:
        x, weight, bias, running_mean, running_var = args[:5]
        present = [isinstance(t, torch.Tensor) for t in (weight, bias, running_mean, running_var)]
        r, c = Replicate(), Shard(0)
        rows: list[Row] = []
        for out, stats, inp, per_channel in ((Shard(0), r, Shard(0), r), (Shard(1), c, Shard(1), c)):
            rows.append([out, stats, stats, stats, stats, inp] + [per_channel for p in present if p])
        return rows

    def cost(self, node, in_metas, strategy, mesh_shape, cluster, *, backward: bool) -> RegionCost:
        compute = compute_time(node.target, in_metas, node.outputs, strategy.outputs, mesh_shape, cluster, backward=backward,
                               in_layouts=strategy.inputs)
        x, axes = in_metas[0], sync_axes(strategy.inputs[0])
        channels = local_shape(x.shape, strategy.inputs[0], mesh_shape)[1]
        forward = tuple(CommStep("all_reduce", a, nbytes=(2 * channels + 1) * x.itemsize) for a in axes)
        back = tuple(CommStep("all_reduce", a, nbytes=2 * channels * x.itemsize) for a in axes) if backward else ()
        comm = steps_time(forward, mesh_shape, cluster) + steps_time(back, mesh_shape, cluster)
        return RegionCost(compute_s=compute, forward=forward, backward=back, comm_s=comm)

    def local_module(self, strategy, comm: MeshComm, args) -> BatchNormShard:
        return BatchNormShard(strategy, comm)


BATCH_NORM_REGION = BatchNorm()
