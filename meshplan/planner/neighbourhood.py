"""Meshes too large for one exact MIP: an exact solve per mesh axis, around the best plan so far.

The MIP has a variable for every (given, needed) layout pair of every edge. A tensor's layouts
grow as (placements per axis) ** axes, so the pairs grow with its square: the demo Llama on a
(2, 2, 2) mesh has 1,402,895 pairs (49,219 on (2, 4)); building its tables took 59 s and HiGHS had
no incumbent after 120 s. `layout_pairs` counts them before any table is built, and above
`PAIR_LIMIT` the planner searches here instead:

1. **Start.** The problem restricted to a coarser mesh embedded in this one: a plan of (4, 2) is a
   plan of (2, 2, 2) whose first two axes carry the same placements (DTensor shards over mesh
   axes left to right, so `S(0)` on both equals `S(0)` on the merged axis). The mesh search hands
   in the plans it already has (`embedded`): of coarser meshes, and of the same sizes in another
   order with the axes permuted. Without one, the outer axes are merged and that smaller problem
   is solved exactly (`merged`). The best start is kept.
2. **Rounds.** For each mesh axis in turn, every node may change its placements on that axis
   while the other axes keep the incumbent's; that one-axis problem is solved exactly and
   replaces the incumbent when it is faster. Rounds repeat until one improves nothing (or the
   time limit passes).

The result is the best plan of that neighbourhood, never worse than the start, and labelled
'local' (not proven optimal). `explain` lists the alternatives of the last neighbourhood solved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshplan.ir.graph import Graph
from meshplan.ir.placement import Placements
from meshplan.planner.solver import InfeasiblePlan, SolveTimeout
from meshplan.plans.strategy import Strategy

log = logging.getLogger(__name__)

PAIR_LIMIT = 100_000
"""Layout pairs above which a mesh is searched by neighbourhoods. Exact solves measured here
(`benchmarks/mesh_search.py`, tables and solve): 49,219 pairs in 3-5 s, 129,754 in 9-10 s, 146,846
on (2, 2, 2) in 24 s, 192,486 (HF RWKV on (2, 4)) not proven optimal in 60 s; 1,402,895 found no
plan in 120 s."""

Subset = dict[str, list[int]]
"""node -> indexes into its candidate list that a sub-problem keeps."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Solved(Generic[T]):
    """One sub-problem's outcome, as the caller's `solve_subset` reports it."""

    objective: float
    choice: dict[str, int]
    """node -> index into its full candidate list."""
    result: T
    """Whatever the caller needs to build its plan from this solve."""


def layout_pairs(graph: Graph, by_node: dict[str, list[Strategy]], rep: dict[str, str]) -> int:
    """Layout pairs the exact MIP would hold: distinct given x needed layouts per edge between tied classes."""
    seen: set[tuple] = set()
    total = 0
    for node in graph.nodes:
        for pos, ref in enumerate(node.inputs):
            key = (rep[ref.node], ref.index, rep[node.name], pos)
            if key in seen or key[0] == key[2]:
                continue
            seen.add(key)
            given = {s.outputs[ref.index] for s in by_node[ref.node]}
            needed = {s.inputs[pos] for s in by_node[node.name]}
            total += len(given) * len(needed)
    return total


def coarsening(fine: tuple[int, ...], coarse: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """How a plan on `coarse` maps onto `fine`: per axis of `coarse`, the axes of `fine` that carry
    its placement. Adjacent axes merged into one ((2, 2, 2) -> (4, 2): [(0, 1), (2,)]), or, for a
    mesh of the same sizes in another order, the axes permuted ((4, 2) -> (2, 4): [(1,), (0,)]: a
    close start, not an equal cost, since the ranks of an axis are then other ranks). None if neither."""
    groups: list[tuple[int, ...]] = []
    axis = 0
    for size in coarse:
        group, prod = [], 1
        while axis < len(fine) and prod < size:
            group.append(axis)
            prod *= fine[axis]
            axis += 1
        if prod != size or not group:
            break
        groups.append(tuple(group))
    else:
        if axis == len(fine) and len(groups) < len(fine):
            return groups
    if len(fine) != len(coarse) or sorted(fine) != sorted(coarse) or tuple(fine) == tuple(coarse):
        return None
    unused = list(range(len(fine)))
    perm = []
    for size in coarse:
        a = next(a for a in unused if fine[a] == size)
        unused.remove(a)
        perm.append((a,))
    return perm


def _coarse(p: Placements | None, groups: list[tuple[int, ...]]) -> Placements | None | bool:
    """`p` on the coarser mesh; False when a group's axes disagree (no coarse equivalent)."""
    if p is None:
        return None
    out = []
    for group in groups:
        first = p[group[0]]
        if any(p[a] != first for a in group[1:]):
            return False
        out.append(first)
    return tuple(out)


def _coarse_strategy(s: Strategy, groups: list[tuple[int, ...]]) -> tuple | None:
    layouts = tuple(_coarse(p, groups) for p in s.inputs + s.outputs)
    return None if any(x is False for x in layouts) else (layouts, s.kernel)


def merged(by_node: dict[str, list[Strategy]], groups: list[tuple[int, ...]]) -> Subset:
    """Candidates whose placements agree within every group of axes (the coarser mesh's problem). A node with no such
    candidate (a parameter given a layout that differs within a group) keeps every candidate: the solve places the rest
    around it."""
    out: Subset = {}
    for name, ss in by_node.items():
        out[name] = [i for i, s in enumerate(ss) if _coarse_strategy(s, groups) is not None] or list(range(len(ss)))
    return out


def embedded(by_node: dict[str, list[Strategy]], groups: list[tuple[int, ...]], coarse: dict[str, Hashable]) -> Subset:
    """Candidates that equal, merged by `groups`, the coarse plan's choice (`coarse[node]`: a
    strategy's (layouts, kernel), or a leaf's one layout). A node the coarse plan does not name, or
    names with no equivalent here, keeps every candidate: the exact solve completes it."""
    out: Subset = {}
    for name, ss in by_node.items():
        want = coarse.get(name)
        keep = []
        if want is not None:
            for i, s in enumerate(ss):
                c = _coarse_strategy(s, groups)
                if c is not None and (c == want or (s.source == "leaf" and c[0] == (want,))):
                    keep.append(i)
        out[name] = keep or list(range(len(ss)))
    return out


def around(by_node: dict[str, list[Strategy]], incumbent: dict[str, int], free_axis: int) -> Subset:
    """Candidates that keep the incumbent's placements on every axis but `free_axis`."""
    return {name: [i for i, s in enumerate(ss) if _agrees(s, ss[incumbent[name]], free_axis)] for name, ss in by_node.items()}


def _agrees(s: Strategy, mine: Strategy, free_axis: int) -> bool:
    if s.kernel != mine.kernel:
        return False
    for a, b in zip(s.inputs + s.outputs, mine.inputs + mine.outputs):
        if a is None or b is None:
            if a is not b:
                return False
        elif any(a[k] != b[k] for k in range(len(a)) if k != free_axis):
            return False
    return True


def search(
    solve_subset: Callable[[Subset], Solved[T]],
    by_node: dict[str, list[Strategy]],
    ndim: int,
    starts: list[Subset],
    *,
    time_limit_s: float,
) -> Solved[T]:
    """The best plan found from `starts` by one-axis rounds (module docstring). `solve_subset`
    raises `InfeasiblePlan` or `SolveTimeout` for a subset with no plan: a start that fails is
    passed over (if all fail, the last error is raised), a neighbourhood that fails is logged and
    leaves the incumbent."""
    began = time.perf_counter()
    best: Solved[T] | None = None
    error: Exception | None = None
    solves = 0
    for subset in starts:
        solves += 1
        try:
            found = solve_subset(subset)
        except (InfeasiblePlan, SolveTimeout) as e:
            error = e
            continue
        if best is None or found.objective < best.objective:
            best = found
    if best is None:
        if error is None:
            raise AssertionError("a neighbourhood search needs at least one start")
        raise error
    since, axis = 0, 0  # one-axis problems solved around the incumbent without improving it
    while since < ndim and time.perf_counter() - began < time_limit_s:
        try:
            found = solve_subset(around(by_node, best.choice, axis))
        except (InfeasiblePlan, SolveTimeout) as e:
            log.info("neighbourhood on axis %d: %s", axis, e)
            found = None
        solves += 1
        if found is not None and found.objective < best.objective * (1 - 1e-9):
            # the new incumbent differs from the old one on this axis only: this axis is done for it
            best, since = found, 1
        else:
            since += 1
        axis = (axis + 1) % ndim
    log.info("neighbourhood search: %d solves, %.3f ms predicted, %.1f s", solves, best.objective * 1e3, time.perf_counter() - began)
    return best
