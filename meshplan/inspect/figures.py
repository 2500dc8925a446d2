"""The figures a plan is judged by, worded once: step time, peak per device, MFU, and how sure the solver is.

The summary, `explain`, `diff`, the HTML report and the `--json` outputs all print them from here, so one plan
reads the same everywhere, pipelined or not. A pipelined plan's `compute_s` and `comm_s` are one microbatch of the
whole model on one stage's sub-mesh; its step is the schedule's (`Plan.step_time_s`) and its peak the fullest
pipeline rank's (`Plan.peak_memory`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.cost_model.memory import format_bytes

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan, SolverInfo

LP_BACKEND = "GLOP"
"""The LP solver the planner tries first (planner/solver.py): an integral LP optimum is the exact answer."""


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def step_parts(plan: Plan) -> list[tuple[str, float]]:
    """(part, seconds) adding up to `plan.step_time_s`: compute, communication, optimizer step, host and bubble; with a
    pipeline, the schedule's working time (its gradient all-reduce included) and its bubble."""
    if plan.pipeline is not None:
        return [("working", plan.step_time_s - plan.bubble_s), ("bubble", plan.bubble_s)]
    parts = [("compute", plan.compute_s), ("communication", plan.comm_s), ("optimizer step", plan.optimizer_s)]
    if plan.host_s:
        parts.append(("host", plan.host_s))
    return parts + [("bubble", 0.0)]


def figures(plan: Plan) -> dict:
    """Step seconds, peak bytes per device, MFU (None when the plan records no FLOPs) and devices: the headline as data."""
    return {"step_time_s": plan.step_time_s, "peak_bytes": plan.peak_memory.total, "mfu": plan.mfu, "devices": plan.devices}


def headline(plan: Plan) -> str:
    """`step 2.447 ms, peak 2.3 MiB per device, MFU 12.8% (4 devices)`."""
    return worded(figures(plan))


def worded(f: dict) -> str:
    """`figures(plan)` as the headline reads."""
    mfu = "" if f["mfu"] is None else f", MFU {f['mfu']:.1%}"
    return f"step {ms(f['step_time_s'])}, peak {format_bytes(f['peak_bytes'])} per device{mfu} ({f['devices']} devices)"


def solver_words(solver: SolverInfo) -> str:
    """What the solve proved, in words, with the back-end that did it."""
    lp = f"{solver.backend}'s LP relaxation, whose optimum was integral" if solver.backend == LP_BACKEND else solver.backend
    if solver.status == "optimal":
        return f"optimal (proven, by {lp})"
    if solver.status == "feasible":
        return f"best found by {solver.backend} in the time limit, gap {solver.gap:.2%} to the best bound (not proven optimal)"
    if solver.status == "local":
        return (f"local optimum of a search one mesh axis at a time, each axis solved exactly with the others held (the last by "
                f"{lp}); not proven optimal for the whole mesh")
    if solver.status == "heuristic":
        return f"greedy propagation of layouts, no solver: gap {solver.gap:.2%} to a simple lower bound (not proven optimal)"
    return f"{solver.status} by {solver.backend}, gap {solver.gap:.2%} (not proven optimal)"
