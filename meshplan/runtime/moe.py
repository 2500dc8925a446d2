"""The moe op on one rank (ir/moe.py), as its strategy says (planner/rules/moe.py).

- Experts all here (replicated or data parallel): route the local tokens, apply every expert.
- Experts split over an axis, tokens replicated there: apply the local experts to every token;
  the output is this rank's partial sum.
- Expert parallel over an axis (tokens and experts split there): route the local tokens, sort
  the (token, expert) pairs by expert, exchange the per-expert counts all-to-all (the uneven
  sizes every rank must know), send each pair's token to the rank holding its expert
  (all-to-all), apply the local experts to what arrived, return the results (all-to-all) and sum
  each token's weighted results. No token is dropped: buffers are sized by the exchanged counts,
  so there is no capacity limit (Mixtral has none either).

The two token exchanges are autograd Functions whose backward is the reverse exchange, so
gradients reach the experts' owners and come back; every exchange is counted as an
`all_to_all`, which is what the plan lists for this node (cost_model/moe.py).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from meshplan.cost_model.moe import moe_axes
from meshplan.ir.moe import MOE_OP, expert_mlp, experts_local, route
from meshplan.runtime.collectives import MeshComm, collective, wait
from meshplan.runtime.regions import register_region_runtime


def _exchange(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: str) -> torch.Tensor:
    return wait(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group))


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: MeshComm, axis: int, phase: str) -> torch.Tensor:
    return collective(comm, phase, "all_to_all", lambda: f"{phase} moe all_to_all over mesh axis {comm.mesh.axis_names[axis]}",
                      _exchange, x, out_splits, in_splits, comm.group_name(axis))


class TokenExchange(torch.autograd.Function):
    """Uneven all-to-all of rows; backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, comm, axis):
        ctx.args = (out_splits, in_splits, comm, axis)
        return _all_to_all(x, out_splits, in_splits, comm, axis, "forward")

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, comm, axis = ctx.args
        return _all_to_all(grad, in_splits, out_splits, comm, axis, "backward"), None, None, None, None


class MoEShard(nn.Module):
    """This rank's part of one moe node."""

    def __init__(self, strategy, comm: MeshComm, top_k: int, normalize: bool, act: str) -> None:
        super().__init__()
        ep, es = moe_axes(strategy.inputs)
        assert len(ep) + len(es) <= 1, f"moe experts split over more than one mesh axis: {strategy}"
        self.ep_axis = ep[0] if ep else None
        self.expert_axis = (ep + es)[0] if ep + es else None
        self.comm, self.top_k, self.normalize, self.act = comm, top_k, normalize, act

    def forward(self, x, router, gate_up, down, *static):
        tokens = x.reshape(-1, x.shape[-1])
        weights, ids = route(tokens, router, self.top_k, self.normalize)
        first = 0 if self.expert_axis is None else self.comm.coord[self.expert_axis] * gate_up.shape[0]
        if self.ep_axis is None:
            return experts_local(tokens, weights, ids, gate_up, down, self.act, first).reshape(x.shape)
        return self._expert_parallel(tokens, weights, ids, gate_up, down).reshape(x.shape)

    def _expert_parallel(self, x, weights, ids, gate_up, down):
        axis, comm = self.ep_axis, self.comm
        n, local = comm.mesh.shape[axis], gate_up.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, hence by owner rank
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=n * local)
        recv_counts = collective(comm, "forward", "all_to_all",
                                 lambda: f"exchanging moe token counts over mesh axis {comm.mesh.axis_names[axis]}",
                                 _exchange, counts, None, None, comm.group_name(axis))
        send = counts.view(n, local).sum(1).tolist()
        recv = recv_counts.view(n, local).sum(1).tolist()
        rows = TokenExchange.apply(x[token], recv, send, comm, axis)
        # rows arrive source by source, each source's rows grouped by local expert
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(n), recv_counts)
        done = torch.zeros_like(rows)
        for e in range(local):
            idx = torch.where(expert_of_row == e)[0]
            if idx.numel():
                done = done.index_copy(0, idx, expert_mlp(rows[idx], gate_up[e], down[e], self.act).to(rows.dtype))
        back = TokenExchange.apply(done, send, recv, comm, axis)
        weighted = back * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, token, weighted.to(x.dtype))

    def extra_repr(self) -> str:
        kind = "expert parallel" if self.ep_axis is not None else ("experts split" if self.expert_axis is not None else "experts whole")
        axis = self.expert_axis if self.expert_axis is not None else "-"
        return f"{kind} (axis {axis}), top_k={self.top_k}, act={self.act}"


@register_region_runtime(MOE_OP)
def moe_shard(strategy, comm: MeshComm, static: tuple) -> MoEShard:
    top_k, normalize, act = static
    return MoEShard(strategy, comm, top_k, normalize, act)
