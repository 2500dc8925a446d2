"""Optimizer-state offload as a choice of the solve.

A trainable parameter's optimizer state (with its fp32 master copy) may live in host memory: its
device memory drops by the state's bytes and its step costs the host round trip
(`cost_model/offload.py`). Each parameter class gets a second copy of its strategies, identical in
layout, with those costs: edges see the same layouts, so the choice adds no edge variables, and
the solve weighs it against sharding and recomputation under the memory budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from meshplan.cost_model.estimate import local_bytes
from meshplan.cost_model.memory import optimizer_state_bytes
from meshplan.cost_model.offload import can_offload, offload_step_time
from meshplan.cost_model.presets import ClusterPreset
from meshplan.ir.graph import Graph
from meshplan.plans.strategy import Strategy

log = logging.getLogger(__name__)

OFFLOAD = ("never", "auto", "always")
"""PlanOptions.offload: keep optimizer state on the device; let the solve decide; offload every trainable parameter's."""


def check_offload(value: str, cluster: ClusterPreset) -> str:
    if value not in OFFLOAD:
        raise ValueError(f"offload={value!r} is not supported; allowed: {', '.join(OFFLOAD)}")
    if value == "always" and not can_offload(cluster.device):
        raise ValueError(
            f"offload='always' but cluster {cluster.name!r} ({cluster.device.name}) has no separate host memory to offload to; "
            "allowed: offload='never' or 'auto' there, or a GPU cluster preset"
        )
    return value


@dataclass(frozen=True, slots=True)
class OffloadOptions:
    """Where each parameter class's offloaded strategies start in the cost tables, and what they add."""

    start: dict[str, int] = field(default_factory=dict)
    """Choice `i` is strategy `i - start` offloaded when `i >= start`, else strategy `i` on the device."""
    host_s: dict[str, list[float]] = field(default_factory=dict)
    """Seconds per step one member's offloaded state adds, per strategy."""

    def decode(self, cls: str, i: int) -> tuple[int, bool]:
        """(strategy index, offloaded) of choice `i` of class `cls`."""
        if cls in self.start and i >= self.start[cls]:
            return i - self.start[cls], True
        return i, False


def add_offload_options(tables, graph: Graph, by_node: dict[str, list[Strategy]], cluster: ClusterPreset, *, optimizer: str, mode: str) -> OffloadOptions:
    """Give each trainable parameter class host-offloaded strategies (all of them with `mode="always"`)."""
    out = OffloadOptions()
    if mode == "never" or not can_offload(cluster.device):
        if mode == "auto":
            log.info("offload='auto': cluster %s has no separate host memory; optimizer state stays on the device", cluster.name)
        return out
    problem, shape = tables.problem, tables.mesh_shape
    start, extra = out.start, out.host_s
    for name in list(problem.node_costs):
        node = graph[name]
        if node.kind != "param" or not node.grad(0) or (mode == "auto" and name in problem.fixed):
            continue
        members = tables.tying.count[name]
        host_s, host_mem = [], []
        for s in by_node[name]:
            numel = local_bytes(node.out, s.outputs[0], shape) // node.out.itemsize
            host_s.append(offload_step_time(numel, cluster.device, optimizer=optimizer, itemsize=node.out.itemsize))
            host_mem.append(float(optimizer_state_bytes(numel, optimizer)))
        k = len(by_node[name])
        extra[name] = host_s
        # the host steps instead of the device: the device's optimizer step leaves the cost
        delta = [t - d for t, d in zip(host_s, tables.optimizer_s[name])]
        costs = [c + t * members for c, t in zip(problem.node_costs[name], delta)]
        mems = [m - b * members for m, b in zip(problem.node_memory[name], host_mem)]
        units = [c + t for c, t in zip(tables.unit_costs[name], delta)]
        if mode == "always":
            problem.node_costs[name], problem.node_memory[name], tables.unit_costs[name] = costs, mems, units
            start[name] = 0
            continue
        problem.node_costs[name] = problem.node_costs[name] + costs
        problem.node_memory[name] = problem.node_memory[name] + mems
        tables.unit_costs[name] = tables.unit_costs[name] + units
        start[name] = k
    for e in problem.edges:
        if start.get(e.src):
            e.src_layouts = e.src_layouts + e.src_layouts  # the offloaded copies give the same layouts
    return out
