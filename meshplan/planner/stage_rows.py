"""A pipeline's stage plan solved under the memory budget: one memory row per pipeline rank, tightened by its walk.

A stage plan is one solve of the whole model (or of the model cut to a few blocks, stretched to every stage) on the
stage sub-mesh, and every pipeline rank holds a different part of it: its stages' parameters, their gradients and
optimizer state once, and what their ops save for backward once per microbatch its schedule keeps in flight. The
solver's own memory row sums one microbatch of every stage, which bounds no rank; so each rank gets its own row
(`RowWeights`: how many copies of each node the rank holds), and the solve keeps all of them.

A row is a sum, not the rank's peak: the walk (`cost_model/pipeline_memory.py`) frees what is dead, adds the
receive buffers of every microbatch, the gradient buckets and the optimizer step's temporaries. So, as
`planner._keep_budget` does for one device: solve (first with no row), walk every rank, and while a rank is over the
budget, bound its row by what the walk says it is over and solve again (`within_budget`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from meshplan.cost_model.memory import format_bytes
from meshplan.cost_model.schedules import in_flight
from meshplan.ir.graph import Graph
from meshplan.ir.units import POST, PRE, unit_names, unit_of_nodes
from meshplan.planner.problem import RowWeights, node_memory, transfer_memory
from meshplan.planner.solver import InfeasiblePlan
from meshplan.plans.strategy import Strategy

log = logging.getLogger(__name__)

TIGHTENINGS = 4
"""Solves with rows after the first (unbounded) one, before a configuration counts as not fitting."""


def rank_weights(graph: Graph, pipe) -> list[tuple[dict[str, float], dict[str, float]]]:
    """Per pipeline rank of `pipe` (a `PipelinePlan`), the copies of each node of `graph` it holds: (resident,
    activations), as `RowWeights` counts them. `graph` is the whole model, or the model cut to a few of its stack's
    blocks: then each cut block stands for its share of every stage's blocks (a stage of k blocks holds k / n of each
    of the n cut blocks)."""
    units = unit_names(graph)
    blocks = [u for u in units if u not in (PRE, POST)]
    cut = any(u not in units for s in pipe.stages for u in s.units)
    unit = unit_of_nodes(graph)
    ops = [n for n in graph.nodes if n.kind == "op"]
    out = []
    for rank in range(pipe.degree):
        share: dict[str, float] = {}  # unit -> copies the rank holds
        saved: dict[str, float] = {}  # unit -> copies of its saved activations
        for s in pipe.stages:
            if s.device != rank:
                continue
            held = 1.0 if s.recompute or pipe.degree == 1 else in_flight(pipe.schedule, pipe.degree, pipe.microbatches, s.device,
                                                                            virtual=pipe.chunks)
            stack = [u for u in s.units if u not in (PRE, POST)]
            for u in units:
                if u in (PRE, POST):
                    copies = float(u in s.units)
                else:
                    copies = len(stack) / len(blocks) if cut else float(u in s.units)
                if copies:
                    share[u] = share.get(u, 0.0) + copies
                    saved[u] = saved.get(u, 0.0) + copies * held
        resident = {n.name: share[unit[n.name]] for n in ops if unit[n.name] in share}
        activations = {n.name: saved[unit[n.name]] for n in ops if unit[n.name] in saved}
        for n in ops:  # a parameter is held once by a rank that reads it (the tied embedding by both ends)
            for ref in n.inputs:
                if graph[ref.node].kind in ("param", "buffer") and n.name in resident:
                    resident[ref.node] = max(resident.get(ref.node, 0.0), resident[n.name])
        out.append((resident, activations))
    return out


def row_value(graph: Graph, plan, resident: dict[str, float], activations: dict[str, float], optimizer: str) -> float:
    """The row of `plan` (a stage plan of `graph`) weighed by `resident` and `activations`: what the solver's row sums."""
    shape, strategy = plan.mesh.shape, {n.name: n.strategy for n in plan.nodes}
    strategy.update((p.node, Strategy(inputs=(), outputs=(p.layout,))) for p in plan.params)
    total = 0.0
    for n in graph.nodes:
        if n.name not in strategy or n.name not in resident and n.name not in activations:
            continue
        m = node_memory(n, strategy[n.name], shape, optimizer, weight_cast=n.name in graph.weight_casts)
        total += resident.get(n.name, 0.0) * (m.total - m.activations) + activations.get(n.name, 0.0) * m.activations
    for t in plan.transfers:
        if t.consumer in activations and not t.recompute:
            consumer = graph[t.consumer]
            total += activations[t.consumer] * transfer_memory(graph.meta(consumer.inputs[t.position]), t.src, t.dst, consumer, shape)
    return total


def within_budget(solve: Callable[[tuple[RowWeights, ...]], object], peaks: Callable[[object], Sequence[float]],
                  value: Callable[[object, dict, dict], float], weights: list[tuple[dict, dict]], budget: float,
                  over: Callable[[float], Exception]):
    """The stage plan `solve(rows)` gives whose every rank's walked peak (`peaks(plan)`, per pipeline rank) keeps
    `budget`: first solved with no row; while a rank is over, its row (`weights[rank]`) is bounded by the row's value
    at the last plan (`value(plan, resident, activations)`) less the overshoot (by ratio, and at least by the bytes),
    every other rank's by its headroom, and solved again. `over(peak)` is the error raised when no solve within
    `TIGHTENINGS` fits, or when no plan keeps the rows (with the smallest fullest rank seen)."""
    plan = solve(())
    fullest = float("inf")
    for attempt in range(TIGHTENINGS + 1):
        per_rank = list(peaks(plan))
        fullest = min(fullest, max(per_rank))
        if max(per_rank) <= budget:
            return plan
        if attempt == TIGHTENINGS:
            break
        rows = []
        for k, ((resident, activations), peak) in enumerate(zip(weights, per_rank)):
            summed = value(plan, resident, activations)
            bound = summed - (peak - budget)
            if peak > budget:
                bound = min(bound, summed * budget / peak)
            rows.append(RowWeights(f"pipeline rank {k}", bound, resident, activations))
        log.info("stage plan: fullest rank %s over the budget %s; solving again with a row per rank", format_bytes(max(per_rank)),
                 format_bytes(budget))
        try:
            plan = solve(tuple(rows))
        except InfeasiblePlan:
            break
    raise over(fullest)
