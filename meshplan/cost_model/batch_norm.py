"""Cost of training-mode batch norm under its strategies (planner/rules/batch_norm.py): the op's
compute, plus, where the batch is sharded, one all-reduce of the per-channel sums, sums of squares
and count per axis in forward and one of the two gradient sums in backward (SyncBN)."""

from __future__ import annotations

from meshplan.cost_model.estimate import compute_time, steps_time
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost, register_region_cost
from meshplan.ir.placement import Shard, local_shape

BATCH_NORM_TARGET = "aten._native_batch_norm_legit_functional.default"


def sync_axes(x_layout) -> tuple[int, ...]:
    """Mesh axes that split the batch of a batch norm's input: its statistics are summed over them."""
    return tuple(a for a, p in enumerate(x_layout) if p == Shard(0))


@register_region_cost(BATCH_NORM_TARGET)
def batch_norm_cost(node, in_metas, in_layouts, out_layouts, mesh_shape, cluster, *, backward: bool) -> RegionCost:
    compute = compute_time(node.target, in_metas, node.outputs, out_layouts, mesh_shape, cluster, backward=backward, in_layouts=in_layouts)
    x = in_metas[0]
    channels = local_shape(x.shape, in_layouts[0], mesh_shape)[1]
    forward = tuple(CommStep("all_reduce", a, nbytes=(2 * channels + 1) * x.itemsize) for a in sync_axes(in_layouts[0]))
    back = tuple(CommStep("all_reduce", a, nbytes=2 * channels * x.itemsize) for a in sync_axes(in_layouts[0])) if backward else ()
    comm = steps_time(forward, mesh_shape, cluster) + steps_time(back, mesh_shape, cluster)
    return RegionCost(compute_s=compute, forward=forward, backward=back, comm_s=comm)
