"""Costs of meshplan's region ops (ops that stand for a whole block, see ir/regions.py).

A region op may run collectives of its own under some strategies (the moe op's all-to-all token
exchange under expert parallelism). Its cost function returns the compute seconds and those
steps; the planner adds their time to the node's cost and lists them in the plan, and the
runtime executes exactly them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.graph import Node, TensorMeta
from meshplan.ir.placement import Placements


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionCost:
    """One device's cost of a region op under one strategy, per training step."""

    compute_s: float
    """Forward (+ backward when gradients flow) compute seconds."""
    forward: tuple[CommStep, ...] = ()
    """The op's own collectives in forward."""
    backward: tuple[CommStep, ...] = ()
    """Its own collectives in backward (empty when no gradient flows)."""
    comm_s: float = 0.0
    """Seconds of those collectives."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


RegionCostFn = Callable[..., RegionCost]
"""(node, in_metas, in_layouts, out_layouts, mesh_shape, cluster, *, backward) -> RegionCost."""

REGION_COSTS: dict[str, RegionCostFn] = {}


def register_region_cost(target: str) -> Callable[[RegionCostFn], RegionCostFn]:
    def wrap(fn: RegionCostFn) -> RegionCostFn:
        assert target not in REGION_COSTS, f"two region costs for {target}"
        REGION_COSTS[target] = fn
        return fn

    return wrap


def region_cost(
    node: Node,
    in_metas: Sequence[TensorMeta],
    in_layouts: Sequence[Placements],
    out_layouts: Sequence[Placements | None],
    mesh_shape: tuple[int, ...],
    cluster: ClusterPreset,
    *,
    backward: bool,
) -> RegionCost | None:
    """The region op's cost, or None when `node` is an ordinary op."""
    fn = REGION_COSTS.get(node.target)
    if fn is None:
        return None
    return fn(node, in_metas, in_layouts, out_layouts, mesh_shape, cluster, backward=backward)
