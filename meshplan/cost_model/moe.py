"""Cost of the mixture-of-experts op (`meshplan::moe`, see ir/moe.py) under its strategies.

Compute: the router matmul on the local tokens, plus every routed (token, expert) pair's gated
MLP, spread evenly over the devices that split the work (balanced routing: the plan cannot know
the real distribution, which is data). Expert parallelism over an axis adds the op's own
collectives on that axis: one all-to-all of the per-expert token counts, one to dispatch the
routed tokens and one to return them, and in backward the two token exchanges again.
"""

from __future__ import annotations

import math

from meshplan.cost_model.compute import BACKWARD_FACTOR, roofline_time
from meshplan.cost_model.estimate import steps_time
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost, register_region_cost
from meshplan.ir.moe import MOE_TARGET
from meshplan.ir.placement import Replicate, Shard, local_shape, shard_factor

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


@register_region_cost(MOE_TARGET)
def moe_cost(node, in_metas, in_layouts, out_layouts, mesh_shape, cluster, *, backward: bool) -> RegionCost:
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


def node_flops(node, in_metas) -> float:
    """Forward FLOPs of a moe node on whole tensors (for FLOP shares; `op_flops` cannot see top_k)."""
    x, _, gate_up, down = in_metas
    return moe_flops(math.prod(x.shape[:-1]), x.shape[-1], down.shape[2], gate_up.shape[0], int(node.attrs[0]))
