"""Model FLOPs of one training step, the numerator of MFU (model FLOPs utilisation).

MFU = model FLOPs / (devices x peak FLOP/s of the compute dtype x step time). Model FLOPs count the
matmuls, convolutions and attention of the forward, three times where a gradient flows (the
backward runs two matmuls of each forward one), as Megatron-LM does (Narayanan et al. 2021, which
counts attention and the logits; the 6 N tokens rule of thumb leaves attention out), plus what a
region op reports (the moe op's router and routed experts; causal attention at the query-key pairs its mask keeps,
as the step prices it and FlashAttention's benchmarks count it, where Megatron's formula counts the whole rectangle).
Recomputation and everything elementwise are left out: MFU measures useful work, not work done.
"""

from __future__ import annotations

from collections import Counter

from meshplan.cost_model.compute import BACKWARD_FACTOR, is_dense, op_flops
from meshplan.ir.graph import Graph
from meshplan.ir.regions import region_op


def node_flops(node, in_metas, *, dense_only: bool = False) -> float:
    """Forward FLOPs of an op node: what its region op reports (`op_flops` cannot see the moe op's top_k),
    else `op_flops`; with `dense_only`, 0 for ops that are not matmul-like."""
    region = region_op(node.target)
    flops = region.flops(node, in_metas) if region is not None else None
    if flops is not None:
        return flops
    if dense_only and not is_dense(node.target):
        return 0.0
    return op_flops(node.target, in_metas, list(node.outputs))


def model_flops(graph: Graph) -> tuple[float, str]:
    """(model FLOPs of one training step of `graph`, the dtype most of them run in)."""
    total = 0.0
    by_dtype: Counter = Counter()
    for node in graph.nodes:
        if node.kind != "op":
            continue
        flops = node_flops(node, [graph.meta(r) for r in node.inputs], dense_only=True)
        if not flops:
            continue
        flops *= 1.0 + (BACKWARD_FACTOR if any(node.requires_grad) else 0.0)
        total += flops
        by_dtype[node.outputs[0].dtype if node.outputs and node.outputs[0] is not None else "float32"] += flops
    return total, (by_dtype.most_common(1)[0][0] if by_dtype else "float32")
