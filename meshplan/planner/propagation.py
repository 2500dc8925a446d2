"""search="propagation": spread decided layouts along edges, greedily, with no solver.

MindSpore's sharding propagation in the shape of meshplan's `Problem`: nodes with one candidate
(annotated leaves, fully pinned ops, the output) are decided from the start. Then, in
topological order, every node with a decided producer takes the candidate of least cost given
its decided neighbours; then, in reverse
order, every node with a decided consumer does the same, which settles parameters and inputs
nobody annotated. The two sweeps repeat until every node is decided; a node with no decided
neighbour at all is decided last, by its own cost. "Least cost" is, in order: the resharding on
the edges to decided neighbours, then how many of those edges change layout at all (keeping a
layout beats a free chunk that later consumers pay for), then the node's own cost, then the
lower candidate index, so the result is deterministic.

It is fast (linear in edges x candidates) and never better than the ILP, which minimises the same
objective exactly; the plan reports status 'heuristic' and its gap to a simple lower bound (every
node at its cheapest candidate, every edge free).
"""

from __future__ import annotations

import math
import time

from meshplan.cost_model.memory import format_bytes
from meshplan.planner.solver import Edge, InfeasiblePlan, Problem, Solution, evaluate, trivial_bound

ICM_ROUNDS = 8
"""Sweeps of single-node improvement after propagation (each sweep only lowers the objective)."""


def propagate(problem: Problem) -> Solution:
    start = time.perf_counter()
    order = list(problem.node_costs)
    costs = problem.node_costs
    into: dict[str, list[Edge]] = {v: [] for v in order}
    out_of: dict[str, list[Edge]] = {v: [] for v in order}
    for e in problem.edges:
        into[e.dst].append(e)
        out_of[e.src].append(e)
    choice: dict[str, int] = dict(problem.fixed)
    for v in order:
        if not costs[v]:
            raise InfeasiblePlan(f"node {v} has no candidate strategy")
        if len(costs[v]) == 1:
            choice[v] = 0

    def local(v: str, k: int) -> tuple[float, int, float]:
        """(resharding cost to decided neighbours, how many of those edges change layout, own cost) of candidate k.

        Resharding decides; a layout kept as is beats a free change (a chunk costs nothing now but
        shards the tensor for every later consumer); the node's own cost breaks the remaining ties.
        """
        move, changes = 0.0, 0
        for e in into[v]:
            if e.src in choice:
                pair = (e.src_layouts[choice[e.src]], e.dst_layouts[k])
                move += e.cost.get(pair, math.inf)
                changes += pair[0] != pair[1]
        for e in out_of[v]:
            if e.dst in choice:
                pair = (e.src_layouts[k], e.dst_layouts[choice[e.dst]])
                move += e.cost.get(pair, math.inf)
                changes += pair[0] != pair[1]
        return move, changes, costs[v][k]

    def decide(v: str) -> None:
        scores = [local(v, k) for k in range(len(costs[v]))]
        best = min(range(len(scores)), key=lambda k: (scores[k], k))
        if math.isinf(scores[best][0]):
            fixed = [e.src for e in into[v] if e.src in choice] + [e.dst for e in out_of[v] if e.dst in choice]
            raise InfeasiblePlan(
                f"propagation found no strategy of {v} that its decided neighbours ({', '.join(fixed)}) can reach; "
                "check the annotations, or use search='ilp'"
            )
        choice[v] = best

    while len(choice) < len(order):
        before = len(choice)
        for v in order:
            if v not in choice and any(e.src in choice for e in into[v]):
                decide(v)
        for v in reversed(order):
            if v not in choice and any(e.dst in choice for e in out_of[v]):
                decide(v)
        if len(choice) == before:  # an island with nothing decided around it: seed it by its own cost
            decide(next(v for v in order if v not in choice))

    # polish: move single nodes to the candidate of least total cost given all neighbours (never worse)
    for _ in range(ICM_ROUNDS):
        changed = False
        for v in order:
            if len(costs[v]) == 1 or v in problem.fixed:
                continue
            total = [sum(local(v, k)[::2]) for k in range(len(costs[v]))]
            best = min(range(len(total)), key=lambda k: (total[k], k))
            if total[best] < total[choice[v]] - 1e-15:
                choice[v], changed = best, True
        if not changed:
            break

    objective, memory = evaluate(problem, choice)
    if problem.memory_budget is not None and memory > problem.memory_budget:
        raise InfeasiblePlan(
            f"the propagated plan needs {format_bytes(memory)} per device, over the memory budget "
            f"{format_bytes(problem.memory_budget)}; propagation does not search under the budget, search='ilp' does"
        )
    bound = trivial_bound(problem)
    gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
    return Solution(choice, objective, memory, "heuristic", gap, time.perf_counter() - start, "propagation", 0)
