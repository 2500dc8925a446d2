"""Context parallelism in the mesh search: the best mesh planned again with one axis named `cp`.

A mesh axis named `cp` offers attention split along the sequence (regions/context_parallel.py). Every other
layout is the same as on the mesh it renames, so such a mesh can only win through those kernels. After the
default search over unnamed meshes, the best mesh is planned once more with the axis just outside the innermost
renamed `cp` (torchtitan's order dp, cp, tp; a 1-axis mesh becomes cp), in each token order asked for (the
contiguous split, and head-tail token order: `PlanOptions.token_order`). When no mesh gave a plan (memory), every
mesh is. The cheapest such plan is kept when it runs attention context-parallel and is priced below the best.
Otherwise the plan notes why each was not kept (`plan.solver.skipped`, printed by `summary` and `explain`).
Renaming every searched mesh would double the solves of every model with attention.
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.ir.graph import Graph
from meshplan.ir.mesh import CP_AXIS, MeshSpec
from meshplan.ir.regions import region_op
from meshplan.planner.planner import PlanOptions
from meshplan.plans.plan import Plan

ATTENTION = "aten.scaled_dot_product_attention.default"
CP_REGION = "context_parallel_attention"
"""The region op (regions/context_parallel.py) whose kernels a `cp` axis offers."""


def with_cp_axis(mesh: MeshSpec) -> MeshSpec:
    """`mesh` with its second-innermost axis (its only one, on one axis) named `cp`."""
    names = list(mesh.axis_names)
    names[max(0, mesh.ndim - 2)] = CP_AXIS
    return MeshSpec(mesh.shape, tuple(names))


def uses_context_parallel(plan: Plan) -> bool:
    """Some attention node of `plan` runs as a context-parallel kernel."""
    return any(n.strategy.kernel and getattr(region_op(n.target), "name", "") == CP_REGION for n in plan.nodes)


def searches_context_parallel(graph: Graph, options: PlanOptions) -> bool:
    """A model with attention, planned in auto mode with nothing annotated (annotations name the axes they land on)."""
    annotated = bool(options.annotations or options.param_layouts or options.input_layouts)
    return options.mode == "auto" and not annotated and any(n.target == ATTENTION for n in graph.nodes)


def context_parallel_plans(meshes: list[MeshSpec], found: list[Plan], solve: Callable[[MeshSpec, bool], Plan],
                           errors: tuple[type[Exception], ...], token_orders: tuple[bool, ...] = (False,)
                           ) -> tuple[list[Plan], list[str]]:
    """(Plans with a `cp` axis worth returning, a note for each one priced and not kept). `solve(mesh, token_order)`
    plans a mesh in one order; `errors` are the exceptions that mean it gave no plan."""
    best = min(found, key=lambda p: p.step_time_s) if found else None
    kept, notes = [], []
    for mesh in [best.mesh] if best is not None else meshes:
        cp = with_cp_axis(mesh)

        def named(ordered: bool) -> str:
            return f"mesh {cp} (context parallel{', token order' if ordered else ''})"

        tried: list[Plan] = []
        for ordered in token_orders:
            what = named(ordered)
            try:
                plan = solve(cp, ordered)
            except errors as e:
                notes.append(f"{what}: {type(e).__name__}: {e}")
                continue
            if not uses_context_parallel(plan):
                notes.append(f"{what}: no attention op was priced cheaper split along the sequence")
            elif best is not None and plan.step_time_s >= best.step_time_s:
                notes.append(f"{what}: priced {plan.step_time_s * 1e3:.3f} ms per step, not below "
                             f"{best.step_time_s * 1e3:.3f} ms on {best.mesh}")
            else:
                tried.append(plan)
        if tried:  # the cheaper order; the other is noted
            chosen = min(tried, key=lambda p: p.step_time_s)
            kept.append(chosen)
            notes += [f"{named(p.token_order)}: priced {p.step_time_s * 1e3:.3f} ms per step, not below "
                      f"{chosen.step_time_s * 1e3:.3f} ms in the {'head-tail token' if chosen.token_order else 'contiguous'} order"
                      for p in tried if p is not chosen]
    return kept, notes
