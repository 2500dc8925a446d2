"""Training-mode batch norm on one rank (planner/rules/batch_norm.py).

With the batch split over some mesh axes this is SyncBN: the per-channel sum, sum of squares and
count are all-reduced over those axes, so every rank normalises with the whole batch's statistics
and updates the running statistics exactly as one device would (unbiased variance over the whole
batch). Backward all-reduces the two per-channel gradient sums the input gradient needs; the
weight and bias gradients stay this rank's partial sums, which the gradient sync adds up like any
replicated parameter's. Without batch-split axes the plain op runs on the local channels.
"""

from __future__ import annotations

import torch
from torch import nn

from meshplan.cost_model.batch_norm import sync_axes
from meshplan.ir.op_kinds import BATCH_NORM
from meshplan.runtime.collectives import MeshComm, all_reduce, collective
from meshplan.runtime.regions import register_region_runtime


def _all_reduce(t: torch.Tensor, comm: MeshComm, axes: tuple[int, ...], phase: str) -> torch.Tensor:
    for a in axes:
        t = collective(comm, phase, "all_reduce",
                       lambda: f"{phase} batch-norm statistics all_reduce over mesh axis {comm.mesh.axis_names[a]}",
                       all_reduce, t, comm.group_name(a))
    return t


class SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, axes):
        c = x.shape[1]
        dims = [0] + list(range(2, x.ndim))
        shape = [1, c] + [1] * (x.ndim - 2)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_tensor([x.numel() / c])])
        total = _all_reduce(local, comm, axes, "forward")
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


@register_region_runtime(BATCH_NORM)
def batch_norm_shard(strategy, comm: MeshComm, static: tuple) -> BatchNormShard:
    return BatchNormShard(strategy, comm)
