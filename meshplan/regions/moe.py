"""Mixture of experts as one region op, `meshplan::moe`: the op, the Hugging Face block it traces,
its sharding rule, its cost and its per-rank module.

`moe(x [..., H], router_weight [E, H], gate_up [E, 2I, H], down [E, H, I], top_k, normalize, act)`:
each token picks its `top_k` experts by softmax(x @ router_weight.T) (weights renormalised to sum
to 1 when `normalize`); each expert is a gated MLP `down @ (act(gate) * up)`; a token's output is
the weighted sum of its experts' outputs. Nothing is dropped (no capacity limit), as in Mixtral.
Which tokens reach which expert is data, so Hugging Face's `MixtralSparseMoeBlock` is traced as
one call of the op.

Strategies, per mesh axis:
- data parallel: tokens split (along any dim of x but the last), every expert on every device;
- expert parallel: tokens and experts split; each rank routes its tokens, sorts the (token,
  expert) pairs by expert, exchanges the per-expert counts all-to-all (the uneven sizes every rank
  must know), sends each pair's token to the rank holding its expert, applies its experts to what
  arrived and returns the results (two more all-to-alls; backward reverses the two token
  exchanges). Buffers are sized by the exchanged counts, so no token is dropped;
- experts split, tokens replicated: each device applies its experts to every token and the output
  is a partial sum (no all-to-all; the output's consumer pays the reduction).
Experts are split over at most one mesh axis: the runtime exchanges tokens within one axis' group.

The cost: the router matmul on the local tokens, plus every routed (token, expert) pair's gated
MLP, spread evenly over the devices that split the work (balanced routing: the plan cannot know
the real distribution, which is data), plus the all-to-alls, each counted as the plan lists them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from meshplan.cost_model.compute import BACKWARD_FACTOR, roofline_time
from meshplan.cost_model.estimate import steps_time
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost
from meshplan.ir.placement import Partial, Replicate, Shard, local_shape, shard_factor
from meshplan.ir.regions import RegionOp, Row
from meshplan.runtime.collectives import MeshComm, collective, forward_phase, wait

# ---------------------------------------------------------------- the op on one device

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
"""Expert activations the op supports, by the name its `act` argument takes."""


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) of every token, as Mixtral's router computes them."""
    probs = F.softmax(F.linear(x, router_weight).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mlp(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One expert's gated MLP on the rows `h` it received."""
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(ACTIVATIONS[act](gate) * up, down)


def experts_local(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str, first: int
) -> torch.Tensor:
    """Sum over the experts held here (global ids first .. first+len(gate_up)-1) of weight x expert(x):
    the whole output when every expert is here, a partial sum otherwise."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == first + e)
        if token.numel() == 0:
            continue
        y = expert_mlp(x[token], gate_up[e], down[e], act) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def moe_reference(x, router_weight, gate_up, down, top_k: int, normalize: bool, act: str) -> torch.Tensor:
    """The op on one device (differentiable with ordinary autograd)."""
    _check(x, router_weight, gate_up, down, top_k, act)
    tokens = x.reshape(-1, x.shape[-1])
    weights, ids = route(tokens, router_weight, top_k, normalize)
    return experts_local(tokens, weights, ids, gate_up, down, act, 0).reshape(x.shape)


def _check(x, router_weight, gate_up, down, top_k, act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"moe activation {act!r} is not supported; allowed: {', '.join(ACTIVATIONS)}")
    e, h = router_weight.shape
    if x.ndim < 2 or x.shape[-1] != h or gate_up.shape[0] != down.shape[0] or gate_up.shape[2] != h or down.shape[1] != h:
        raise ValueError(
            f"moe shapes do not fit: x {list(x.shape)} (want [..., {h}]), router {list(router_weight.shape)}, "
            f"gate_up {list(gate_up.shape)} (want [E, 2I, {h}]), down {list(down.shape)} (want [E, {h}, I])"
        )
    if not 1 <= top_k <= e:
        raise ValueError(f"moe top_k={top_k} must be between 1 and the number of experts ({e})")


@torch.library.custom_op("meshplan::moe", mutates_args=())
def moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, normalize: bool, act: str) -> torch.Tensor:
    with torch.no_grad():
        return moe_reference(x, router_weight, gate_up, down, top_k, normalize, act)


@moe.register_fake
def _moe_fake(x, router_weight, gate_up, down, top_k, normalize, act):
    _check(x, router_weight, gate_up, down, top_k, act)
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.static = inputs[4:]


def _backward(ctx, grad):
    # recompute with autograd: the routing is cheap next to the experts, and this keeps one definition
    tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = moe_reference(*tensors, *ctx.static)
        wanted = [t for t in tensors if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in tensors) + (None, None, None)


moe.register_autograd(_backward, setup_context=_setup)

MOE_OP = torch.ops.meshplan.moe.default
MOE_TARGET = str(MOE_OP)
"""The op's name as graph nodes and plans spell it."""


# ---------------------------------------------------------------- strategies and cost

COUNT_ITEMSIZE = 8
"""Token counts travel as int64."""


def moe_axes(in_layouts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(expert-parallel axes, expert-sharded axes with replicated tokens) of a strategy's input layouts
    (x, router, gate_up, down): where the experts are sharded and the tokens are / are not."""
    x, _, gate_up, _ = in_layouts
    ep = tuple(a for a, (px, pe) in enumerate(zip(x, gate_up)) if pe == Shard(0) and isinstance(px, Shard))
    es = tuple(a for a, (px, pe) in enumerate(zip(x, gate_up)) if pe == Shard(0) and px == Replicate())
    return ep, es


def moe_flops(tokens: int, hidden: int, inter: int, experts: int, top_k: int) -> float:
    """Forward FLOPs: router [T,H]x[H,E], and per routed pair gate_up [H -> 2I] and down [I -> H]."""
    return 2.0 * tokens * hidden * experts + tokens * top_k * (2.0 * hidden * 2 * inter + 2.0 * inter * hidden + 3.0 * inter)


# ---------------------------------------------------------------- this rank's part

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
        return _all_to_all(x, out_splits, in_splits, comm, axis, forward_phase())

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, comm, axis = ctx.args
        return _all_to_all(grad, in_splits, out_splits, comm, axis, "backward"), None, None, None, None


class MoEShard(nn.Module):
    """This rank's part of one moe node."""

    def __init__(self, strategy, comm: MeshComm, top_k: int, normalize: bool, act: str) -> None:
        super().__init__()
        ep, es = moe_axes(strategy.inputs)
        if len(ep) + len(es) > 1:
            raise AssertionError(f"moe experts split over more than one mesh axis: {strategy}")
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
        recv_counts = collective(comm, forward_phase(), "all_to_all",
                                 lambda: f"exchanging moe token counts over mesh axis {comm.mesh.axis_names[axis]}",
                                 _exchange, counts, None, None, comm.group_name(axis))
        send = counts.view(n, local).sum(1).tolist()
        recv = recv_counts.view(n, local).sum(1).tolist()
        rows = TokenExchange.apply(x[token], recv, send, comm, axis)
        # rows arrive source by source, each source's rows grouped by local expert
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), recv_counts)
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


# ---------------------------------------------------------------- the region op: Hugging Face's block traced as the op

def _activation_name(fn: object) -> str:
    kind = type(fn).__name__.lower()
    for name, known in (("silu", ("silu", "swish")), ("gelu", ("gelu",)), ("relu", ("relu",))):
        if any(k in kind for k in known):
            return name
    raise ValueError(f"expert activation {type(fn).__name__} is not supported by meshplan's moe op; allowed: {', '.join(ACTIVATIONS)}")


class MoE(RegionOp):
    name = "moe"
    ops = (MOE_OP,)

    def matches(self, module: nn.Module) -> bool:
        return type(module).__name__ == "MixtralSparseMoeBlock"

    def traced_forward(self, module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if module.training and module.jitter_noise > 0:
            raise ValueError(f"router_jitter_noise={module.jitter_noise}: random router noise is not supported by meshplan's moe op; set it to 0")
        # the op reads the block's input itself, so annotations on the block's input land on it
        return MOE_OP(
            hidden_states, module.gate.weight, module.experts.gate_up_proj, module.experts.down_proj, module.top_k, True,
            _activation_name(module.experts.act_fn),
        )

    def rule(self, args, kwargs) -> list[Row]:
        r, s0 = Replicate(), Shard(0)
        rows: list[Row] = []
        for d in range(args[0].ndim - 1):  # tokens: batch, sequence, ...
            rows.append([Shard(d), Shard(d), r, r, r])  # data parallel: [out, x, router, gate_up, down]
            rows.append([Shard(d), Shard(d), r, s0, s0])  # expert parallel
        rows.append([Partial(), r, r, s0, s0])  # experts split, tokens replicated
        return rows

    def keep(self, strategy) -> bool:
        return sum(p == Shard(0) for p in strategy.inputs[2]) <= 1  # experts split over one mesh axis at most

    def cost(self, node, in_metas, strategy, mesh_shape, cluster, *, backward: bool) -> RegionCost:
        in_layouts = strategy.inputs
        x, router, gate_up, down = in_metas
        top_k = int(node.attrs[0])
        tokens, hidden = math.prod(x.shape[:-1]), x.shape[-1]
        experts, inter = gate_up.shape[0], down.shape[2]
        ep, es = moe_axes(in_layouts)
        local_tokens = math.prod(local_shape(x.shape, in_layouts[0], mesh_shape)[:-1])
        # the work splits over the axes that shard tokens and those that shard experts
        split = tokens // local_tokens * math.prod(mesh_shape[a] for a in es)
        flops = moe_flops(tokens, hidden, inter, experts, top_k) / split
        local_experts = experts // shard_factor(in_layouts[2], mesh_shape, 0)
        nbytes = (local_tokens * x.itemsize * (hidden * (2 + top_k * 2)) + local_experts * (gate_up.nbytes + down.nbytes) // experts
                  + router.nbytes)
        fwd = roofline_time(flops, nbytes, cluster.device, x.dtype)
        compute = fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd
        forward: list[CommStep] = []
        back: list[CommStep] = []
        for a in ep:
            n = mesh_shape[a]
            routed = local_tokens * top_k * hidden * x.itemsize
            forward += [
                CommStep("all_to_all", a, nbytes=n * (experts // n) * COUNT_ITEMSIZE),
                CommStep("all_to_all", a, nbytes=routed),
                CommStep("all_to_all", a, nbytes=routed),
            ]
            if backward:
                back += [CommStep("all_to_all", a, nbytes=routed), CommStep("all_to_all", a, nbytes=routed)]
        comm = steps_time(forward, mesh_shape, cluster) + steps_time(back, mesh_shape, cluster)
        return RegionCost(compute_s=compute, forward=tuple(forward), backward=tuple(back), comm_s=comm)

    def flops(self, node, in_metas) -> float:
        x, _, gate_up, down = in_metas
        return moe_flops(math.prod(x.shape[:-1]), x.shape[-1], down.shape[2], gate_up.shape[0], int(node.attrs[0]))

    def local_module(self, strategy, comm: MeshComm, args) -> MoEShard:
        top_k, normalize, act = args[4:7]
        return MoEShard(strategy, comm, top_k, normalize, act)


MOE_REGION = MoE()
