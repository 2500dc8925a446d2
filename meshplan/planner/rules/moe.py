"""The mixture-of-experts op (`meshplan::moe`, ir/moe.py): replicated, tokens sharded, experts sharded.

Inputs: x [..., H], router [E, H], gate_up [E, 2I, H], down [E, H, I]; output like x. Per mesh axis:
- data parallel: tokens split (along any dim of x but the last), every expert on every device;
- expert parallel: tokens and experts split; routed tokens travel all-to-all to the device holding
  their expert and back (the op's own collectives, see cost_model/moe.py);
- experts split, tokens replicated: each device applies its experts to every token and the output
  is a partial sum (no all-to-all; the output's consumer pays the reduction).
Experts are split over at most one mesh axis: the runtime exchanges tokens within one axis' group.
"""

from __future__ import annotations

from meshplan.ir.moe import MOE_OP
from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.planner.rules.registry import Row, register_rule


def _one_expert_axis(strategy) -> bool:
    return sum(p == Shard(0) for p in strategy.inputs[2]) <= 1


@register_rule(MOE_OP, keep=_one_expert_axis)
def moe_rule(args, kwargs) -> list[Row]:
    r, s0 = Replicate(), Shard(0)
    rows: list[Row] = []
    for d in range(args[0].ndim - 1):  # tokens: batch, sequence, ...
        rows.append([Shard(d), Shard(d), r, r, r])  # data parallel: [out, x, router, gate_up, down]
        rows.append([Shard(d), Shard(d), r, s0, s0])  # expert parallel
    rows.append([Partial(), r, r, s0, s0])  # experts split, tokens replicated
    return rows
