"""The exact search: pick one strategy per node minimising node costs plus edge (resharding) costs.

The only module that imports OR-Tools. The model is the standard MIP of auto-sharding (Alpa,
autoparallel) with one refinement: edge variables are indexed by the *layouts* the two ends see,
not by strategy pairs, since many strategies share a layout. With the marginal (transport)
constraints the LP relaxation is tight on chains and trees, so branch-and-bound stays small.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

BACKENDS = ("HIGHS", "SCIP", "CBC")


@dataclass(slots=True)
class Edge:
    """A tensor flowing from node `src` to node `dst`."""

    src: str
    dst: str
    src_layouts: list[Hashable]
    """For each strategy of `src`, the layout it gives the tensor."""
    dst_layouts: list[Hashable]
    """For each strategy of `dst`, the layout it needs the tensor in."""
    cost: dict[tuple[Hashable, Hashable], float]
    """Cost of each (given, needed) layout pair; a missing pair is impossible."""
    memory: dict[tuple[Hashable, Hashable], float] = field(default_factory=dict)
    """Bytes per device the move leaves resident (a resharded copy saved for backward); absent = 0."""


@dataclass(slots=True)
class Problem:
    node_costs: dict[str, list[float]]
    """node -> cost of each of its strategies (seconds)."""
    edges: list[Edge] = field(default_factory=list)
    fixed: dict[str, int] = field(default_factory=dict)
    """Nodes whose strategy is decided already (annotations, forced plans)."""
    node_memory: dict[str, list[float]] = field(default_factory=dict)
    """node -> bytes per device each strategy keeps resident at the peak; absent = 0."""
    memory_budget: float | None = None
    """Bytes per device: the sum of node and edge memory of the chosen strategies may not exceed it."""


@dataclass(frozen=True, slots=True)
class Solution:
    choice: dict[str, int]
    objective: float
    """Seconds (or bytes, when the solve minimised memory)."""
    memory: float
    """Predicted bytes per device of the chosen strategies (node + edge memory)."""
    status: str
    """'optimal', or 'feasible' with `gap` > 0 when the time limit was hit."""
    gap: float
    seconds: float
    backend: str
    variables: int


class InfeasiblePlan(ValueError):
    """No combination of candidate strategies is consistent (for example, conflicting forced layouts)."""


def solve(
    problem: Problem, *, time_limit_s: float = 60.0, backend: str = "HIGHS", merge: bool = True, minimize: str = "time"
) -> Solution:
    """Optimal strategies for `problem`; with `merge`, single-input followers are folded first.

    `minimize="memory"` finds the smallest peak any choice reaches (the budget is then ignored):
    what an infeasible budget's error message reports.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if minimize not in ("time", "memory"):
        raise ValueError(f"minimize={minimize!r}; allowed: time, memory")
    start = time.perf_counter()
    if merge:
        problem, merged = merge_followers(problem)
        sol = _solve(problem, time_limit_s, backend, start, minimize)
        choice = dict(sol.choice)
        for node, (root, pick) in merged.items():
            choice[node] = pick[choice[root]]
        return Solution(choice, sol.objective, sol.memory, sol.status, sol.gap, time.perf_counter() - start, sol.backend, sol.variables)
    return _solve(problem, time_limit_s, backend, start, minimize)


def merge_followers(problem: Problem) -> tuple[Problem, dict[str, tuple[str, list[int]]]]:
    """Fold every node with a single input edge into its producer when it can take each layout the
    producer gives without resharding (views, transposes, pointwise ops): the follower's choice
    becomes a function of its producer's, and the follower and that edge leave the MIP.

    Returns the smaller problem and, per folded node (in fold order), its root and the strategy
    it takes for each strategy of the root.

    A follower takes its cheapest option per root strategy (ties to the smaller one). Under a
    binding memory budget this can drop a slower but smaller option of a follower; followers are
    views and pointwise ops, whose options for one input layout rarely differ in memory.
    """
    node_costs = {k: list(v) for k, v in problem.node_costs.items()}
    node_memory = {k: list(problem.node_memory.get(k) or [0.0] * len(v)) for k, v in node_costs.items()}
    edges = [Edge(e.src, e.dst, list(e.src_layouts), e.dst_layouts, e.cost, e.memory) for e in problem.edges]
    incoming: dict[str, list[Edge]] = {}
    outgoing: dict[str, list[Edge]] = {}
    for e in edges:
        incoming.setdefault(e.dst, []).append(e)
        outgoing.setdefault(e.src, []).append(e)
    merged: dict[str, tuple[str, list[int]]] = {}
    for v in list(node_costs):
        ins = incoming.get(v, [])
        if v in problem.fixed or len(ins) != 1 or ins[0].src in problem.fixed:
            continue
        e = ins[0]
        pick: list[int] = []
        for layout in e.src_layouts:
            options = [t for t, need in enumerate(e.dst_layouts) if need == layout]
            if not options or e.cost.get((layout, layout)) != 0.0 or e.memory.get((layout, layout), 0.0) != 0.0:
                break
            pick.append(min(options, key=lambda t: (node_costs[v][t], node_memory[v][t])))
        else:
            u = e.src
            node_costs[u] = [c + node_costs[v][pick[s]] for s, c in enumerate(node_costs[u])]
            node_memory[u] = [m + node_memory[v][pick[s]] for s, m in enumerate(node_memory[u])]
            del node_costs[v], node_memory[v]
            outgoing[u].remove(e)
            edges.remove(e)
            for out in outgoing.pop(v, []):
                out.src = u
                out.src_layouts = [out.src_layouts[pick[s]] for s in range(len(pick))]
                outgoing[u].append(out)
            merged[v] = (u, pick)
    # a node folded into a node that was itself folded later: re-express against the final root
    for v, (u, pick) in list(merged.items()):
        while u in merged:
            u2, pick2 = merged[u]
            pick = [pick[pick2[s]] for s in range(len(pick2))]
            u = u2
        merged[v] = (u, pick)
    return Problem(node_costs, edges, dict(problem.fixed), node_memory, problem.memory_budget), merged


def _solve(problem: Problem, time_limit_s: float, backend: str, start: float, minimize: str) -> Solution:
    solver = pywraplp.Solver.CreateSolver(backend)
    assert solver is not None, f"OR-Tools has no {backend} backend"
    solver.SetNumThreads(1)  # deterministic: every rank must get the identical plan
    if backend == "HIGHS":
        solver.SetSolverSpecificParametersAsString("output_flag=false\n")
    solver.SetTimeLimit(int(time_limit_s * 1000))
    inf = solver.infinity()

    x: dict[str, list] = {}
    objective = solver.Objective()
    const = 0.0
    # memory = mem_const + sum(coefficient * variable); constrained by the budget, or minimised
    mem_terms: list[tuple] = []
    mem_const = 0.0
    by_memory = minimize == "memory"
    for node, costs in problem.node_costs.items():
        if not costs:
            raise InfeasiblePlan(f"node {node} has no candidate strategy")
        mems = problem.node_memory.get(node) or [0.0] * len(costs)
        if node in problem.fixed or len(costs) == 1:
            k = problem.fixed.get(node, 0)
            x[node] = [1.0 if i == k else 0.0 for i in range(len(costs))]
            const += mems[k] if by_memory else costs[k]
            mem_const += mems[k]
            continue
        x[node] = [solver.BoolVar(f"x[{node},{i}]") for i in range(len(costs))]
        one = solver.Constraint(1.0, 1.0)
        for v in x[node]:
            one.SetCoefficient(v, 1.0)
        for v, c, m in zip(x[node], costs, mems):
            objective.SetCoefficient(v, m if by_memory else c)
            if m:
                mem_terms.append((v, m))

    for e in problem.edges:
        src_mass = _layout_mass(x[e.src], e.src_layouts)
        dst_mass = _layout_mass(x[e.dst], e.dst_layouts)
        flows: dict[Hashable, list] = {}
        into: dict[Hashable, list] = {}
        for a in src_mass:
            for b in dst_mass:
                c = e.cost.get((a, b))
                if c is None:
                    continue
                m = e.memory.get((a, b), 0.0)
                if _is_const(src_mass[a]) and _is_const(dst_mass[b]):
                    # both ends decided: the edge is a constant if both layouts are the chosen ones
                    if _value(src_mass[a]) and _value(dst_mass[b]):
                        const += m if by_memory else c
                        mem_const += m
                        flows.setdefault(a, []).append(1.0)
                        into.setdefault(b, []).append(1.0)
                    continue
                y = solver.NumVar(0.0, inf, "")
                objective.SetCoefficient(y, m if by_memory else c)
                if m:
                    mem_terms.append((y, m))
                flows.setdefault(a, []).append(y)
                into.setdefault(b, []).append(y)
        for a, mass in src_mass.items():
            _add_equal(solver, flows.get(a, []), mass, f"{e.src}->{e.dst}")
        for b, mass in dst_mass.items():
            _add_equal(solver, into.get(b, []), mass, f"{e.src}->{e.dst}")

    if problem.memory_budget is not None and not by_memory:
        budget = solver.Constraint(-inf, problem.memory_budget - mem_const)
        for v, m in mem_terms:
            budget.SetCoefficient(v, budget.GetCoefficient(v) + m)
    objective.SetMinimization()
    status = solver.Solve()
    seconds = time.perf_counter() - start
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise InfeasiblePlan(
            "no consistent choice of strategies exists (solver status "
            f"{status}); check forced layouts, divisibility of the sharded dims and the memory budget"
        )
    choice = {}
    for node, vs in x.items():
        vals = [v if isinstance(v, float) else v.solution_value() for v in vs]
        choice[node] = max(range(len(vals)), key=lambda i: vals[i])
    obj = objective.Value() + const
    bound = objective.BestBound() + const if status == pywraplp.Solver.FEASIBLE else obj
    gap = 0.0 if status == pywraplp.Solver.OPTIMAL else abs(obj - bound) / max(abs(obj), 1e-30)
    memory = mem_const + sum(m * v.solution_value() for v, m in mem_terms)
    return Solution(
        choice, obj, memory, "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible", gap, seconds, backend, solver.NumVariables()
    )


def _layout_mass(xs: list, layouts: list[Hashable]) -> dict[Hashable, list]:
    """layout -> the strategy variables (or fixed 0/1 values) that produce it."""
    mass: dict[Hashable, list] = {}
    for v, lay in zip(xs, layouts):
        mass.setdefault(lay, []).append(v)
    return mass


def _is_const(terms: list) -> bool:
    return all(isinstance(t, float) for t in terms)


def _value(terms: list) -> float:
    return sum(terms)


def _add_equal(solver, lhs: list, rhs: list, where: str) -> None:
    """sum(lhs) == sum(rhs), terms being variables or fixed 0/1 values (built coefficient by coefficient:
    OR-Tools' expression API was half of the model-building time)."""
    lhs_c = sum(t for t in lhs if isinstance(t, float))
    rhs_c = sum(t for t in rhs if isinstance(t, float))
    coeffs: dict = {}
    for t in lhs:
        if not isinstance(t, float):
            coeffs[t] = coeffs.get(t, 0.0) + 1.0
    for t in rhs:
        if not isinstance(t, float):
            coeffs[t] = coeffs.get(t, 0.0) - 1.0
    if not coeffs:
        if not math.isclose(lhs_c, rhs_c):
            raise InfeasiblePlan(f"fixed layouts on edge {where} cannot be connected")
        return
    ct = solver.Constraint(rhs_c - lhs_c, rhs_c - lhs_c)
    for v, k in coeffs.items():
        ct.SetCoefficient(v, k)
