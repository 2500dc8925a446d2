"""What a region op (ir/regions.py) costs under one strategy.

A region op may run collectives of its own under some strategies (the moe op's all-to-all token
exchange under expert parallelism). Its `cost` returns the compute seconds and those steps; the
planner adds their time to the node's cost and lists them in the plan, and the runtime executes
exactly them.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost_model.redistribution import CommStep


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
