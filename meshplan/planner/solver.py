"""The exact search: pick one strategy per node minimising node costs plus edge (resharding) costs.

The only module that imports OR-Tools. The model is the standard MIP of auto-sharding (Alpa,
autoparallel) with one refinement: edge variables are indexed by the *layouts* the two ends see,
not by strategy pairs, since many strategies share a layout. With the marginal (transport)
constraints the LP relaxation is tight on chains and trees, so branch-and-bound stays small; the
LP is solved first (GLOP), and when its optimum is integral it is the answer, proven optimal.

Every solve ends in a plan or an honest error: a time limit with no incumbent returns the caller's
consistent start (with its gap), or raises `SolveTimeout`; only a proven contradiction raises
`InfeasiblePlan`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from meshplan.progress import timed

BACKENDS = ("HIGHS", "SCIP", "CBC")
LP_BACKEND = "GLOP"
"""Solves the LP relaxation (deterministic, single-threaded, like the MIP back-ends)."""
MEMORY_RANGE = 2**10
"""The largest memory term in the MIP's rows and objective, in its memory unit (`memory_unit`)."""


def memory_unit(problem: Problem) -> float:
    """Bytes per unit of memory in the MIP: a power of two putting the largest node's bytes near `MEMORY_RANGE` (1 for
    problems of small numbers). In bytes, a 65,536-token Llama's terms (up to 1e11) beside its seconds (down to 1e-9)
    made GLOP and HiGHS declare a feasible problem infeasible."""
    largest = max((m for mems in problem.node_memory.values() for m in mems), default=0.0)
    return 2.0 ** max(0, math.floor(math.log2(largest / MEMORY_RANGE))) if largest > 0 else 1.0


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
    unit: str | None = None
    """The recompute unit `dst` belongs to: if it recomputes, the move runs again and its copy is not held."""
    name: str = ""
    """Names the edge in `Recompute.layers`."""
    recompute_cost: dict[tuple[Hashable, Hashable], float] = field(default_factory=dict)
    """Seconds of the forward move run again during backward, per layout pair."""
    recompute_saved: dict[tuple[Hashable, Hashable], float] = field(default_factory=dict)
    """Bytes no longer held until backward, per layout pair (all occurrences)."""
    recompute_peak: dict[tuple[Hashable, Hashable], float] = field(default_factory=dict)
    """Bytes held again while the backward of a layer it occurs in runs, per layout pair."""


@dataclass(slots=True)
class Recompute:
    """A group of layers that may drop what it saves for backward and run its forward again.

    One boolean decides the group. The linearisation is exact: `z[v,i] = x[v,i] and r` through
    `sum_i z[v,i] = r, z[v,i] <= x[v,i]` (one strategy per node is chosen), and the extra time,
    the memory saved and the rematerialised peak are linear in z. A forced unit (r = 1) is not linearised: z is x.
    """

    name: str
    extra: dict[str, list[float]]
    """node -> seconds added per strategy (the forward run again, all members)."""
    saved: dict[str, list[float]]
    """node -> bytes of activations no longer held per strategy (all members)."""
    peak: dict[str, tuple[str, list[float]]]
    """term -> (node, bytes per strategy of that node) held again while the backward of a layer listing the term runs."""
    layers: list[frozenset[str]]
    """Per layer, the peak terms and edge names it holds again (identical sets for tied layers): the peak is the largest."""
    force: bool = False
    """Recompute regardless of cost (`recompute="always"`)."""


@dataclass(slots=True)
class Switch:
    """A cost paid once when any node takes one of the listed strategies: the runtime makes every
    parameter a DTensor as soon as one is sharded, so the optimizer step of all of them pays DTensor's
    dispatch (runtime/parallel_module.py), a cost of the plan as a whole, not of one parameter's choice.
    Exact in the MIP: a binary `on` with `on >= sum of the node's listed x` for every listed node."""

    name: str
    cost: float
    """Seconds added when the switch is on."""
    members: dict[str, frozenset[int]]
    """node -> the indexes of its strategies that turn the switch on."""


@dataclass(slots=True)
class MemoryRow:
    """A memory row beside the problem's own: bytes one device holds of a part of the problem, each node and edge
    weighed as that device holds it (one pipeline rank of a stage plan: its stages' nodes, their activations once per
    microbatch in flight; `planner/stage_rows.py`)."""

    name: str
    bound: float
    """Bytes the row may not exceed."""
    node_memory: dict[str, list[float]]
    """node -> bytes per strategy this row counts; absent = 0."""
    edge_weight: dict[str, float]
    """edge name -> the factor this row puts on the edge's `memory`; absent = 0."""


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
    recompute: list[Recompute] = field(default_factory=list)
    """Groups of layers the solve may recompute (see `Recompute`)."""
    switches: list[Switch] = field(default_factory=list)
    """Costs of the plan as a whole (see `Switch`)."""
    rows: list[MemoryRow] = field(default_factory=list)
    """More memory rows, each bounded like `memory_budget` (see `MemoryRow`); a memory-minimising solve ignores them."""


@dataclass(frozen=True, slots=True)
class Solution:
    choice: dict[str, int]
    objective: float
    """Seconds (or bytes, when the solve minimised memory)."""
    memory: float
    """Predicted bytes per device of the chosen strategies (node + edge memory)."""
    status: str
    """'optimal'; 'feasible' when the time limit was hit (`gap` to the best bound); 'local' for the
    best plan of a neighbourhood search (`planner/neighbourhood.py`); 'heuristic' for propagation."""
    gap: float
    seconds: float
    backend: str
    variables: int
    recompute: tuple[str, ...] = ()
    """The recompute units chosen."""
    constraints: int = 0


class InfeasiblePlan(ValueError):
    """No combination of candidate strategies is consistent (for example, conflicting forced layouts)."""


class SolveTimeout(RuntimeError):
    """The solve ran out of time before it found any plan, and no feasible start was given."""


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
    """(seconds, bytes per device) of a complete choice with nothing recomputed; an edge whose
    layout pair is impossible is an `InfeasiblePlan` naming it."""
    objective = sum(problem.node_costs[v][k] for v, k in choice.items())
    memory = sum(problem.node_memory[v][k] for v, k in choice.items() if v in problem.node_memory)
    for e in problem.edges:
        pair = (e.src_layouts[choice[e.src]], e.dst_layouts[choice[e.dst]])
        if pair not in e.cost:
            raise InfeasiblePlan(f"the choice moves {e.src}->{e.dst} from {pair[0]} to {pair[1]}, which no redistribution does")
        objective += e.cost[pair]
        memory += e.memory.get(pair, 0.0)
    objective += sum(sw.cost for sw in problem.switches if switched_on(sw, choice))
    return objective, memory


def row_held(problem: Problem, row: MemoryRow, choice: dict[str, int]) -> float:
    """Bytes `row` (one of `problem.rows`) counts for a complete choice."""
    held = sum(row.node_memory[v][k] for v, k in choice.items() if v in row.node_memory)
    for e in problem.edges:
        if e.name in row.edge_weight:
            held += e.memory.get((e.src_layouts[choice[e.src]], e.dst_layouts[choice[e.dst]]), 0.0) * row.edge_weight[e.name]
    return held


def rows_kept(problem: Problem, choice: dict[str, int]) -> bool:
    """Whether a complete choice keeps every row of `problem.rows`."""
    return all(row_held(problem, row, choice) <= row.bound for row in problem.rows)


def switched_on(switch: Switch, choice: dict[str, int]) -> bool:
    return any(choice[v] in ks for v, ks in switch.members.items())


def trivial_bound(problem: Problem) -> float:
    """A lower bound on the time objective: every node at its cheapest strategy, every move free."""
    return sum(min(c) for c in problem.node_costs.values() if c)


@timed("solve")
def solve(
    problem: Problem,
    *,
    time_limit_s: float = 60.0,
    backend: str = "HIGHS",
    merge: bool = True,
    minimize: str = "time",
    start: dict[str, int] | None = None,
) -> Solution:
    """Optimal strategies for `problem`; with `merge`, single-input followers are folded first.

    `minimize="memory"` finds the smallest peak any choice reaches (the budget is then ignored):
    what an infeasible budget's error message reports.

    `start`: a complete choice known to be consistent (the propagation plan, a plan of a smaller
    mesh). When the time limit ends the solve with no incumbent, or with a worse one, the start is
    returned as 'feasible', with its gap to the best bound known. Without a start, a solve that
    finds nothing in time raises `SolveTimeout`; only a proven infeasibility raises `InfeasiblePlan`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if minimize not in ("time", "memory"):
        raise ValueError(f"minimize={minimize!r}; allowed: time, memory")
    if start is not None and minimize != "time":
        raise ValueError("a start choice is only used when minimising time")
    began = time.perf_counter()
    reduced, merged = merge_followers(problem) if merge else (problem, {})
    # the LP relaxation first: it is tight on chains and trees, and an integral LP optimum is the MIP's
    # (llama_small on (2, 4): 0.9 s against 2.8 s); a fractional one is only the bound the MIP starts from
    sol, bound = _solve(reduced, time_limit_s, LP_BACKEND, began, minimize, relax=True)
    if sol is None:
        sol, mip_bound = _solve(reduced, max(time_limit_s - (time.perf_counter() - began), 0.001), backend, began, minimize)
        bound = max(bound, mip_bound)
    if sol is not None:
        choice = dict(sol.choice)
        for node, (root, pick) in merged.items():
            choice[node] = pick[choice[root]]
        sol = dataclasses.replace(sol, choice=choice, seconds=time.perf_counter() - began)
        if sol.status == "optimal" or start is None:
            return sol
    fallback = _start_solution(problem, start, bound, backend, began) if start is not None else None
    if fallback is not None and (sol is None or fallback.objective < sol.objective):
        return fallback
    if sol is not None:
        return sol
    raise SolveTimeout(
        f"the {backend} solve found no plan within its time limit of {time_limit_s:g} s "
        f"({time.perf_counter() - began:.1f} s spent); give a larger time_limit_s"
    )


def _start_solution(problem: Problem, start: dict[str, int], bound: float, backend: str, began: float) -> Solution | None:
    """The start as a 'feasible' solution, or None if it breaks the memory budget or a forced recompute."""
    if any(unit.force for unit in problem.recompute):
        return None
    objective, memory = evaluate(problem, start)
    if problem.memory_budget is not None and memory > problem.memory_budget or not rows_kept(problem, start):
        return None
    bound = max(bound, trivial_bound(problem))
    gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
    return Solution(dict(start), objective, memory, "feasible", gap, time.perf_counter() - began, backend, 0)


def merge_followers(problem: Problem) -> tuple[Problem, dict[str, tuple[str, list[int]]]]:
    """Fold every node with a single input edge into its producer when it can take each layout the
    producer gives without resharding (views, transposes, pointwise ops): the follower's choice
    becomes a function of its producer's, and the follower and that edge leave the MIP.

    Returns the smaller problem and, per folded node (in fold order), its root and the strategy
    it takes for each strategy of the root.

    A follower takes its cheapest option per root strategy, and is folded only when that option is
    also the smallest in memory: otherwise a binding budget might need the slower, smaller one, and
    the follower stays in the MIP. Folding is therefore exact.
    """
    node_costs = {k: list(v) for k, v in problem.node_costs.items()}
    node_memory = {k: list(problem.node_memory.get(k) or [0.0] * len(v)) for k, v in node_costs.items()}
    # every row's node memory, folded alike (a node a row does not count is 0 there)
    rows = [dataclasses.replace(r, node_memory={k: list(r.node_memory.get(k) or [0.0] * len(v)) for k, v in node_costs.items()})
            for r in problem.rows]
    memories = [node_memory] + [r.node_memory for r in rows]
    edges = [dataclasses.replace(e, src_layouts=list(e.src_layouts)) for e in problem.edges]
    # a node of a recompute unit keeps its own variables: its recompute terms are per strategy
    in_unit = {v for r in problem.recompute for v in r.extra}
    incoming: dict[str, list[Edge]] = {}
    outgoing: dict[str, list[Edge]] = {}
    for e in edges:
        incoming.setdefault(e.dst, []).append(e)
        outgoing.setdefault(e.src, []).append(e)
    merged: dict[str, tuple[str, list[int]]] = {}
    for v in list(node_costs):
        ins = incoming.get(v, [])
        if v in problem.fixed or v in in_unit or len(ins) != 1 or ins[0].src in problem.fixed:
            continue
        e = ins[0]
        pick: list[int] = []
        for layout in e.src_layouts:
            options = [t for t, need in enumerate(e.dst_layouts) if need == layout]
            if not options or e.cost.get((layout, layout)) != 0.0 or e.memory.get((layout, layout), 0.0) != 0.0:
                break
            best = min(options, key=lambda t: (node_costs[v][t], node_memory[v][t]))
            if any(mem[v][t] < mem[v][best] for mem in memories for t in options):
                break  # no option dominates: the solver must see them all
            pick.append(best)
        else:
            u = e.src
            node_costs[u] = [c + node_costs[v][pick[s]] for s, c in enumerate(node_costs[u])]
            for mem in memories:
                mem[u] = [m + mem[v][pick[s]] for s, m in enumerate(mem[u])]
                del mem[v]
            del node_costs[v]
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
    switches = [_switch_on_roots(sw, merged) for sw in problem.switches]
    return Problem(node_costs, edges, dict(problem.fixed), node_memory, problem.memory_budget, problem.recompute, switches, rows), merged


def _switch_on_roots(switch: Switch, merged: dict[str, tuple[str, list[int]]]) -> Switch:
    """A folded member turns the switch on through the root strategies that pick one of its own."""
    members: dict[str, set[int]] = {}
    for v, ks in switch.members.items():
        if v in merged:
            root, pick = merged[v]
            members.setdefault(root, set()).update(s for s, k in enumerate(pick) if k in ks)
        else:
            members.setdefault(v, set()).update(ks)
    return dataclasses.replace(switch, members={v: frozenset(ks) for v, ks in members.items() if ks})


def _solve(problem: Problem, time_limit_s: float, backend: str, start: float, minimize: str, *, relax: bool = False) -> tuple[Solution | None, float]:
    """The MIP's solution (None when it stopped with no incumbent) and its best bound (-inf if none).
    With `relax`, the LP relaxation: a solution only when it is integral (then it is the MIP's
    optimum), else None and the LP optimum as the bound."""
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise AssertionError(f"OR-Tools has no {backend} backend")
    solver.SetNumThreads(1)  # deterministic: every rank must get the identical plan
    if backend == "HIGHS":
        solver.SetSolverSpecificParametersAsString("output_flag=false\n")
    solver.SetTimeLimit(int(time_limit_s * 1000))
    inf = solver.infinity()
    binary = (lambda name: solver.NumVar(0.0, 1.0, name)) if relax else solver.BoolVar

    x: dict[str, list] = {}
    objective = solver.Objective()
    const = 0.0
    # memory = mem_const + sum(coefficient * variable); constrained by the budget, or minimised
    mem_terms: list[tuple] = []
    mem_const = 0.0
    by_memory = minimize == "memory"
    unit = memory_unit(problem)
    objective_unit = unit if by_memory else 1.0  # what one unit of the objective is, as the problem states it
    rows = [] if by_memory else problem.rows
    row_terms: list[list[tuple]] = [[] for _ in rows]
    row_const = [0.0] * len(rows)
    for node, costs in problem.node_costs.items():
        if not costs:
            raise InfeasiblePlan(f"node {node} has no candidate strategy")
        mems = problem.node_memory.get(node) or [0.0] * len(costs)
        if node in problem.fixed or len(costs) == 1:
            k = problem.fixed.get(node, 0)
            x[node] = [1.0 if i == k else 0.0 for i in range(len(costs))]
            const += mems[k] / unit if by_memory else costs[k]
            mem_const += mems[k]
            for j, row in enumerate(rows):
                row_const[j] += row.node_memory[node][k] if node in row.node_memory else 0.0
            continue
        x[node] = [binary(f"x[{node},{i}]") for i in range(len(costs))]
        one = solver.Constraint(1.0, 1.0)
        for v in x[node]:
            one.SetCoefficient(v, 1.0)
        for v, c, m in zip(x[node], costs, mems):
            objective.SetCoefficient(v, m / unit if by_memory else c)
            if m:
                mem_terms.append((v, m))
        for j, row in enumerate(rows):
            row_terms[j] += [(v, m) for v, m in zip(x[node], row.node_memory.get(node, ())) if m]

    r = {u.name: _recompute_var(solver, u, binary) for u in problem.recompute}
    # (unit, edge name, y: the pair's flow or 1.0, extra seconds, bytes saved, bytes held again)
    edge_recompute: list[tuple] = []
    for e in problem.edges:
        src_mass = _layout_mass(x[e.src], e.src_layouts)
        dst_mass = _layout_mass(x[e.dst], e.dst_layouts)
        flows: dict[Hashable, list] = {}
        into: dict[Hashable, list] = {}
        weights = [(j, row.edge_weight[e.name]) for j, row in enumerate(rows) if e.name in row.edge_weight]
        src_const = {a: _is_const(mass) for a, mass in src_mass.items()}
        dst_const = {b: _is_const(mass) for b, mass in dst_mass.items()}
        for a in src_mass:
            for b in dst_mass:
                c = e.cost.get((a, b))
                if c is None:
                    continue
                m = e.memory.get((a, b), 0.0)
                if src_const[a] and dst_const[b]:
                    # both ends decided: the edge is a constant if both layouts are the chosen ones
                    if _value(src_mass[a]) and _value(dst_mass[b]):
                        const += m / unit if by_memory else c
                        mem_const += m
                        for j, w in weights:
                            row_const[j] += m * w
                        flows.setdefault(a, []).append(1.0)
                        into.setdefault(b, []).append(1.0)
                        if e.unit is not None and (a, b) in e.recompute_cost:
                            edge_recompute.append((e.unit, e.name, 1.0, e.recompute_cost[(a, b)], e.recompute_saved.get((a, b), 0.0), e.recompute_peak.get((a, b), 0.0)))
                    continue
                y = solver.NumVar(0.0, inf, "")
                objective.SetCoefficient(y, m / unit if by_memory else c)
                if m:
                    mem_terms.append((y, m))
                    for j, w in weights:
                        row_terms[j].append((y, m * w))
                flows.setdefault(a, []).append(y)
                into.setdefault(b, []).append(y)
                if e.unit is not None and (a, b) in e.recompute_cost:
                    edge_recompute.append((e.unit, e.name, y, e.recompute_cost[(a, b)], e.recompute_saved.get((a, b), 0.0), e.recompute_peak.get((a, b), 0.0)))
        for a, mass in src_mass.items():
            _add_equal(solver, flows.get(a, []), mass, f"{e.src}->{e.dst}")
        for b, mass in dst_mass.items():
            _add_equal(solver, into.get(b, []), mass, f"{e.src}->{e.dst}")

    for sw in problem.switches:
        const += _add_switch(solver, objective, sw, x, binary, by_memory)

    units = [
        _add_recompute(solver, objective, group, r[group.name], x, [t for t in edge_recompute if t[0] == group.name], mem_terms, by_memory,
                       unit)
        for group in problem.recompute
    ]
    const += sum(c for _, _, c, _ in units)
    mem_const += sum(b for _, _, _, b in units)

    if problem.memory_budget is not None and not by_memory:
        budget = solver.Constraint(-inf, (problem.memory_budget - mem_const) / unit)
        for v, m in mem_terms:
            budget.SetCoefficient(v, budget.GetCoefficient(v) + m / unit)
    for row, terms, held_const in zip(rows, row_terms, row_const):
        bounded = solver.Constraint(-inf, (row.bound - held_const) / unit)
        for v, m in terms:
            bounded.SetCoefficient(v, bounded.GetCoefficient(v) + m / unit)
    objective.SetMinimization()
    status = solver.Solve()
    seconds = time.perf_counter() - start
    if status == pywraplp.Solver.INFEASIBLE:
        raise InfeasiblePlan(
            "no consistent choice of strategies exists; check forced layouts, divisibility of the sharded dims and the memory budget"
        )
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        # a time-out with no incumbent (HiGHS reports it as NOT_SOLVED or an unmapped code): not infeasibility
        bound = (objective.BestBound() + const) * objective_unit
        return None, bound if math.isfinite(bound) and not relax else -math.inf
    if relax:
        binaries = [v for vs in x.values() for v in vs if not isinstance(v, float)] + list(r.values())
        if status != pywraplp.Solver.OPTIMAL or any(min(v.solution_value(), 1.0 - v.solution_value()) > 1e-6 for v in binaries):
            return None, (objective.Value() + const) * objective_unit if status == pywraplp.Solver.OPTIMAL else -math.inf
    choice = {}
    for node, vs in x.items():
        vals = [v if isinstance(v, float) else v.solution_value() for v in vs]
        choice[node] = max(range(len(vals)), key=lambda i: vals[i])
    obj = (objective.Value() + const) * objective_unit
    bound = (objective.BestBound() + const) * objective_unit if status == pywraplp.Solver.FEASIBLE else obj
    gap = 0.0 if status == pywraplp.Solver.OPTIMAL else abs(obj - bound) / max(abs(obj), 1e-30)
    memory = mem_const + sum(m * v.solution_value() for v, m in mem_terms)
    memory += sum(value() - unit * var.solution_value() for var, value, _, _ in units)  # a slack `held` is not memory
    chosen_units = tuple(name for name, v in r.items() if v.solution_value() > 0.5)
    solution = Solution(
        choice, obj, memory, "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible", gap, seconds, backend, solver.NumVariables(),
        chosen_units, solver.NumConstraints(),
    )
    return solution, bound


def _add_switch(solver, objective, switch: Switch, x: dict, binary, by_memory: bool) -> float:
    """The switch's variable and rows; returns its cost when a fixed node turns it on (a constant)."""
    cost = 0.0 if by_memory else switch.cost
    if any(isinstance(x[v][k], float) and x[v][k] == 1.0 for v, ks in switch.members.items() for k in ks):
        return cost
    on = binary(f"switch[{switch.name}]")
    objective.SetCoefficient(on, cost)
    for v, ks in switch.members.items():
        terms = [x[v][k] for k in ks if not isinstance(x[v][k], float)]
        if terms:  # on >= the node's mass on its listed strategies
            row = solver.Constraint(0.0, solver.infinity())
            row.SetCoefficient(on, 1.0)
            for t in terms:
                row.SetCoefficient(t, -1.0)
    return 0.0


# a tie-breaker: with nothing to gain, do not recompute
_RECOMPUTE_EPS_S = 1e-12


def _recompute_var(solver, unit: Recompute, binary):
    v = binary(f"recompute[{unit.name}]")
    if unit.force:
        solver.Add(v == 1)
    return v


def _add_recompute(solver, objective, unit: Recompute, r, x: dict, edges: list[tuple], mem_terms: list, by_memory: bool,
                   memory_unit: float) -> tuple:
    """Terms of one recompute unit: extra time, memory saved, and the largest layer held again (variable `held`).
    Returns `held`, a function giving its true value (the largest layer) after the solve, and the constant objective
    and memory terms (of nodes and edges whose strategy is fixed). A forced unit (r = 1) needs no linearisation:
    its z is x itself and its q is y (the one-node Llama-3-8B at 65k tokens on (2, 4): the linearised
    LP took 5.1 s and 61,542 rows, this one 0.6 s and 3,055)."""
    objective.SetCoefficient(r, objective.GetCoefficient(r) + (0.0 if by_memory else _RECOMPUTE_EPS_S))
    held = solver.NumVar(0.0, solver.infinity(), f"held[{unit.name}]")  # in memory units
    mem_terms.append((held, memory_unit))
    # only the budget pushes `held` down when minimising time; reported memory uses the true maximum (`held_value`)
    objective.SetCoefficient(held, 1.0 if by_memory else 0.0)
    constant = [0.0, 0.0]  # objective, bytes

    def add(v, extra: float, saved: float) -> None:
        """The objective and memory terms of v (a z or q: the unit recomputes this strategy or pair)."""
        cost = -saved / memory_unit if by_memory else extra
        if isinstance(v, float):
            constant[0] += v * cost
            constant[1] -= v * saved
            return
        objective.SetCoefficient(v, objective.GetCoefficient(v) + cost)
        if saved:
            mem_terms.append((v, -saved))

    z_of: dict[str, list] = {}  # node -> its z per strategy (None where the strategy is ruled out)
    for node, extra in unit.extra.items():
        saved = unit.saved[node]
        if unit.force:
            z_of[node] = [None if isinstance(xi, float) and xi == 0.0 else xi for xi in x[node]]
        else:
            z_of[node] = []
            one = solver.Constraint(0.0, 0.0)  # sum_i z_i - r == 0
            one.SetCoefficient(r, -1.0)
            for xi in x[node]:
                if isinstance(xi, float) and xi == 0.0:
                    z_of[node].append(None)
                    continue
                z = solver.NumVar(0.0, 1.0, "")
                z_of[node].append(z)
                one.SetCoefficient(z, 1.0)
                if not isinstance(xi, float):
                    solver.Add(z <= xi)
        for i, z in enumerate(z_of[node]):
            if z is not None:
                add(z, extra[i], saved[i])
    peak_terms: dict[str, list[tuple]] = {}  # term -> [(variable or 1.0, bytes)]
    for term, (node, peak) in unit.peak.items():
        peak_terms[term] = [(z, b) for z, b in zip(z_of[node], peak) if z is not None and b]
    for _, name, y, extra, saved, peak in edges:
        if unit.force:
            q = y
        else:
            q = solver.NumVar(0.0, 1.0, "")  # q = y and r (y is 0/1 at integral x)
            solver.Add(q <= r)
            if isinstance(y, float):
                solver.Add(q >= r)
            else:
                solver.Add(q <= y)
                solver.Add(q >= y + r - 1)
        add(q, extra, saved)
        if peak:
            peak_terms.setdefault(name, []).append((q, peak))
    sums = []
    for layer in dict.fromkeys(unit.layers):  # tied layers repeat one set: one constraint
        terms = [t for term in layer for t in peak_terms.get(term, ())]
        fixed = sum(b * v for v, b in terms if isinstance(v, float))
        ct = solver.Constraint(-solver.infinity(), -fixed / memory_unit)  # sum(peak) - held <= 0
        ct.SetCoefficient(held, -1.0)
        for v, b in terms:
            if not isinstance(v, float):
                ct.SetCoefficient(v, ct.GetCoefficient(v) + b / memory_unit)
        sums.append(terms)

    def value(v) -> float:
        return v if isinstance(v, float) else v.solution_value()

    return held, lambda: max((sum(b * value(v) for v, b in terms) for terms in sums), default=0.0), *constant


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
