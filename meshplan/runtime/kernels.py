"""Sharded kernels: ops whose strategy (`Strategy.kernel`) does not run as the plain local op.

- `masked` (embedding, gather; DTensor's MaskPartial): the table is split along the looked-up dim,
  the ids arrive whole; each device shifts the ids into its own block, looks up those it holds and
  zeroes the rest, so the outputs are partial sums over the axes that split the table.
- `log_softmax(dim=d)`: the input is split along the softmax dim (vocabulary-parallel
  cross-entropy, as `torch.distributed.tensor.parallel.loss_parallel` does): the row max and the
  sum of exponentials are all-reduced over the splitting axes, so the whole row never exists on
  one device. Backward: `grad - softmax * sum(grad)`, the sum all-reduced. The collectives are
  the ones `cost_model/kernels.py` lists for the plan.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from meshplan.cost_model.kernels import kernel_axes, parse_kernel
from meshplan.ir.placement import Placements, Shard
from meshplan.plans.strategy import Strategy
from meshplan.runtime.collectives import MeshComm, all_reduce, collective, forward_phase

aten = torch.ops.aten


def block_range(layout: Placements, dim: int, size: int, mesh_shape: tuple[int, ...], coord: tuple[int, ...]) -> tuple[int, int]:
    """[start, stop) of this device's block of a dim of `size` split by `layout` (outer axes take the outer blocks)."""
    index, parts = 0, 1
    for a, p in enumerate(layout):
        if p == Shard(dim):
            index = index * mesh_shape[a] + coord[a]
            parts *= mesh_shape[a]
    rows = size // parts
    return index * rows, (index + 1) * rows


class MaskedLookup(nn.Module):
    """embedding / gather on this device's block [start, stop) of the looked-up dim; other ids give zeros."""

    def __init__(self, op, start: int, stop: int) -> None:
        super().__init__()
        self.op, self.start, self.stop = op, start, stop

    def forward(self, *args, **kwargs):
        if self.op is aten.embedding.default:
            weight, ids, *rest = args
            padding_idx = rest.pop(0) if rest else kwargs.pop("padding_idx", -1)
            outside = (ids < self.start) | (ids >= self.stop)
            local = (ids - self.start).masked_fill(outside, 0)
            # the padding row gets no gradient: it is a row of this block only if it falls inside it
            pad = padding_idx - self.start if self.start <= padding_idx < self.stop else -1
            return aten.embedding.default(weight, local, pad, *rest, **kwargs).masked_fill(outside.unsqueeze(-1), 0.0)
        x, dim, index, *rest = args
        outside = (index < self.start) | (index >= self.stop)
        local = (index - self.start).masked_fill(outside, 0)
        return aten.gather.default(x, dim, local, *rest, **kwargs).masked_fill(outside, 0.0)

    def extra_repr(self) -> str:
        return f"{self.op}, rows [{self.start}, {self.stop})"


def _all_reduce(t: torch.Tensor, axes: tuple[int, ...], comm: MeshComm, phase: str, op: str = "sum") -> torch.Tensor:
    """`t` reduced over each mesh axis in `axes` in turn (a new tensor)."""
    for a in axes:
        t = collective(comm, phase, "all_reduce",
                       lambda: f"{phase} all_reduce inside a sharded log_softmax over mesh axis {comm.mesh.axis_names[a]}",
                       all_reduce, t, comm.group_name(a), op)
    return t


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
        return grad - out.exp() * total, None, None, None


class ShardedLogSoftmax(nn.Module):
    """`_log_softmax(x, dim)` with `dim` split over mesh `axes`."""

    def __init__(self, dim: int, axes: tuple[int, ...], comm: MeshComm) -> None:
        super().__init__()
        self.dim, self.axes, self.comm = dim, axes, comm

    def forward(self, x, dim=None, half_to_float=False):
        return _ShardedLogSoftmax.apply(x, self.dim, self.axes, self.comm)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, all-reduces over mesh axes {self.axes}"


def local_kernel(n: fx.Node, strategy: Strategy | None, comm: MeshComm) -> nn.Module | None:
    """The module that runs fx node `n` under `strategy` on this rank, or None for the plain op."""
    if strategy is None or not strategy.kernel:
        return None
    name, dim = parse_kernel(strategy.kernel)
    mesh = comm.mesh
    if name == "masked" and n.target is aten.embedding.default:
        weight = n.args[0].meta["val"]
        return MaskedLookup(n.target, *block_range(strategy.inputs[0], 0, weight.shape[0], mesh.shape, comm.coord))
    if name == "masked" and n.target is aten.gather.default:
        x, gdim = n.args[0].meta["val"], n.args[1] % n.args[0].meta["val"].ndim
        return MaskedLookup(n.target, *block_range(strategy.inputs[0], gdim, x.shape[gdim], mesh.shape, comm.coord))
    if name == "log_softmax" and n.target is aten._log_softmax.default:
        return ShardedLogSoftmax(dim, kernel_axes(strategy.kernel, strategy.outputs[0]), comm)
    raise AssertionError(f"no sharded kernel {strategy.kernel!r} for {n.target} ({n.name})")
