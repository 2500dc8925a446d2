"""Activation recomputation as a choice of the solve.

A group of repeated layers (`layers.*`) may drop the activations its layers save for backward and
run each layer's forward again during backward (the runtime wraps each layer in
`torch.utils.checkpoint`). That costs the forward compute and the forward resharding moves a
second time, and saves each layer's internal activations and the resharded copies it holds
(all-gathered ZeRO/FSDP parameters included) — except for one layer at a time, rematerialised
while its backward runs. The solver weighs this per group against every other way of fitting the
memory budget (`solver.Recompute` holds the exact linearisation).

A tensor a layer hands to another layer (or to the output) is not saved by recomputation: the next
layer's checkpoint keeps it as its input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from meshplan.ir.graph import Graph
from meshplan.ir.units import POST, PRE
from meshplan.planner.solver import Recompute
from meshplan.plans.plan import Plan

log = logging.getLogger(__name__)

RECOMPUTE = ("auto", "never", "always")
"""PlanOptions.recompute: let the solve decide; never; every eligible group."""


@dataclass(frozen=True, slots=True)
class RecomputeGroup:
    name: str
    """The layer pattern, `layers.*`."""
    layers: tuple[str, ...]
    """Its layers in order: `layers.0`, `layers.1`, ..."""


def recompute_groups(graph: Graph) -> list[RecomputeGroup]:
    """Repeated-layer groups the runtime can checkpoint: each layer's ops form one contiguous run in
    program order (so one checkpointed call can replace them)."""
    ops = [n for n in graph.nodes if n.kind == "op"]
    runs: dict[str, list[int]] = {}
    for i, n in enumerate(ops):
        if n.layer is not None:
            runs.setdefault(n.layer, []).append(i)
    groups = []
    for pattern, layers in graph.layer_groups().items():
        broken = [lay for lay in layers if lay in runs and runs[lay][-1] - runs[lay][0] + 1 != len(runs[lay])]
        if broken:
            log.info("%s cannot be recomputed: the ops of %s are interleaved with other ops", pattern, broken[0])
            continue
        if any(lay in runs for lay in layers):
            groups.append(RecomputeGroup(pattern, tuple(layers)))
    return groups


def internal_outputs(graph: Graph) -> set[str]:
    """Op nodes inside a layer whose outputs only that layer reads: what recomputation stops holding."""
    consumers = graph.consumers()
    out = set()
    for n in graph.nodes:
        if n.kind != "op" or n.layer is None:
            continue
        if all(graph[c].kind == "op" and graph[c].layer == n.layer for c, _ in consumers[n.name]):
            out.add(n.name)
    return out


def check_recompute(value: str) -> str:
    if value not in RECOMPUTE:
        raise ValueError(f"recompute={value!r} is not supported; allowed: {', '.join(RECOMPUTE)}")
    return value


class RecomputeTerms:
    """Collects each group's `solver.Recompute` while `problem.build_tables` prices nodes and edges
    (per class representative when layers are tied; values already multiplied by class size)."""

    def __init__(self, graph: Graph, groups: list[RecomputeGroup], rep: dict[str, str], count: dict[str, int], *, force: bool) -> None:
        self.groups = groups
        group_of = {layer: g.name for g in groups for layer in g.layers}
        self.unit = {n.name: group_of.get(n.layer) for n in graph.nodes if n.kind == "op" and n.layer is not None}
        self.internal = internal_outputs(graph) if groups else set()
        self.count = count
        self.units = {g.name: Recompute(g.name, {}, {}, {}, [], force=force) for g in groups}
        self.member_layers: dict[str, set[str]] = {}  # class -> layers of its members
        for n in graph.nodes:
            if n.layer is not None:
                self.member_layers.setdefault(rep[n.name], set()).add(n.layer)
        self.term_layers: dict[str, dict[str, set[str]]] = {g.name: {} for g in groups}

    def unit_of(self, node: str) -> str | None:
        return self.unit.get(node)

    def _lists(self, node: str, k: int) -> tuple[list[float], list[float]]:
        u = self.units[self.unit[node]]
        if node not in u.extra:
            u.extra[node], u.saved[node] = [0.0] * k, [0.0] * k
        return u.extra[node], u.saved[node]

    def add_node(self, node: str, forward_s: list[float], activations: list[float]) -> None:
        """One member's forward seconds and saved activations per strategy."""
        held = activations if node in self.internal else [0.0] * len(activations)
        if not any(forward_s) and not any(held):
            return
        extra, saved = self._lists(node, len(forward_s))
        for i, (f, h) in enumerate(zip(forward_s, held)):
            extra[i] += f * self.count[node]
            saved[i] += h * self.count[node]
        if any(held):
            self._term(node, node, list(held), self.member_layers[node])

    def add_self_edge(self, node: str, key: str, forward_s: list[float], held: list[float], layers: list[str]) -> None:
        """A move between two members of one class (layer k feeds layer k+1), per strategy and occurrence."""
        if not any(forward_s) and not any(held):
            return
        extra, saved = self._lists(node, len(forward_s))
        for i, (f, h) in enumerate(zip(forward_s, held)):
            extra[i] += f * len(layers)
            saved[i] += h * len(layers)
        if any(held):
            self._term(f"{node}<{key}", node, list(held), set(layers))

    def add_edge(self, name: str, unit: str, layers: list[str]) -> None:
        """An edge into a unit whose `recompute_peak` is per occurrence, in these layers."""
        self.term_layers[unit].setdefault(name, set()).update(layers)

    def _term(self, term: str, node: str, peak: list[float], layers: set[str]) -> None:
        unit = self.unit[node]
        self.units[unit].peak[term] = (node, peak)
        self.term_layers[unit].setdefault(term, set()).update(layers)

    def finish(self) -> list[Recompute]:
        out = []
        for g in self.groups:
            u, terms = self.units[g.name], self.term_layers[g.name]
            u.layers = [frozenset(t for t, layers in terms.items() if layer in layers) for layer in g.layers]
            out.append(u)
        return out


def with_stage_recompute(plan: Plan, graph: Graph) -> Plan:
    """`plan` with the layers of its recomputing stages in `Plan.recompute` (the runtime runs each under a checkpoint)
    and the moves feeding them marked to run again in backward, as the intra-op solve marks its own recomputed layers."""
    layers = tuple(u for s in plan.pipeline.stages if s.recompute for u in s.units if u not in (PRE, POST))
    if not layers:
        return plan
    again = set(layers) | set(plan.recompute)
    transfers = tuple(replace(t, recompute=True) if t.consumer in graph and graph[t.consumer].kind == "op" and graph[t.consumer].layer in again
                      else t for t in plan.transfers)
    return replace(plan, recompute=tuple(dict.fromkeys(plan.recompute + layers)), transfers=transfers)
