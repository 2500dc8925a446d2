"""`str(plan)` / `Plan.summary()`: the plan per layer, with its collectives, time and memory.

Repeated blocks (`layers.0`, `layers.1`, ...) that were planned identically are shown once with a
count; a block planned differently from its neighbours gets its own row. Everything here is read
from the Plan alone, so a plan loaded from JSON prints the same as the one just made.
"""

from __future__ import annotations

import io
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.cost_model.memory import format_bytes
from meshplan.inspect.figures import figures, headline, ms, solver_words, step_parts
from meshplan.ir.placement import fmt, local_shape
from meshplan.plans.axes import AxisView, axis_view, devices_split, step_batch, wasted

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan

TOP = "(top)"
OUTPUT = "(output)"
LEGEND = "placements, one per mesh axis shown: R replicated, S(d) split along tensor dim d, P partial sums still to be added up"
SIGNIFICANT = 0.01
"""Ops whose compute is at least this share of the largest op's are listed with their activation layout."""


@dataclass(frozen=True, slots=True)
class CommVolume:
    """Collectives of one kind on one mesh axis (or set of axes) per step."""

    axes: str
    """Axis names, `dp` or `dp,tp` for one collective over several axes."""
    phase: str
    """'forward', 'backward' or 'grad_sync'."""
    kind: str
    count: int
    nbytes: int


def format_seconds(s: float) -> str:
    """Three significant digits in ms, or in µs below 0.1 ms (per-layer figures are often tiny)."""
    return f"{s * 1e3:.3g} ms" if s >= 1e-4 or s == 0 else f"{s * 1e6:.3g} µs"


def layer_of(path: str) -> str:
    """The unit a module path belongs to: its repeated layer (`layers.3`) or its top-level module."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", path)
    if m:
        return m.group(1)
    return path.split(".", 1)[0] if path else TOP


def grad_sync_bytes(plan: Plan, p) -> int:
    itemsize = _ITEMSIZE.get(getattr(p, "dtype", "float32"), 4)
    return math.prod(local_shape(p.shape, p.layout, plan.mesh.shape)) * itemsize


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}


def comm_volume(plan: Plan) -> list[CommVolume]:
    """Every communicating collective of one step, grouped by axes, phase and kind."""
    acc: dict[tuple[str, str, str], list[int]] = {}
    names = axis_view(plan).names

    def add(axes: str, phase: str, kind: str, nbytes: int) -> None:
        slot = acc.setdefault((axes, phase, kind), [0, 0])
        slot[0] += 1
        slot[1] += nbytes

    for t in plan.transfers:
        for phase, steps in (("forward", t.forward), ("backward", t.backward)):
            for s in steps:
                if s.communicates:
                    add(names[s.axis], phase, s.kind, s.nbytes)
    for b in plan.buckets:  # gradients are all-reduced in buckets, one collective each
        add(",".join(names[a] for a in b.axes), "grad_sync", "all_reduce", b.nbytes)
    return [CommVolume(a, ph, k, c, b) for (a, ph, k), (c, b) in sorted(acc.items())]


@dataclass(slots=True)
class _Unit:
    name: str
    params: list[str]
    acts: list[str]
    comm: Counter
    comm_bytes: Counter
    compute_s: float = 0.0
    signature: tuple = ()


def layer_units(plan: Plan) -> list[_Unit]:
    """One unit per top-level module or repeated layer, in plan order. A unit's signature lists its
    parameters (relative name, shape, layout), ops (relative path, op, strategy) and collectives (with
    bytes): two layers with equal signatures were planned identically."""
    units: dict[str, _Unit] = {}

    def unit(name: str) -> _Unit:
        return units.setdefault(name, _Unit(name, [], [], Counter(), Counter()))

    def rel(path: str, name: str) -> str:
        # inside a repeated layer, paths are relative (they read the same for every copy)
        if re.search(r"\.\d+$", name) is None:
            return path
        return "" if path == name else path[len(name) + 1 :] if path.startswith(name + ".") else path

    view = axis_view(plan)
    names = view.names
    where = {n.name: n.module_path for n in plan.nodes}
    sig: dict[str, list] = {}
    for p in plan.params:
        u = unit(layer_of(p.fqns[0]))
        label = " = ".join(rel(f, u.name) for f in p.fqns)
        u.params.append(f"{label} {view.layout(p.layout)}")
        sig.setdefault(u.name, []).append(("p", label, p.shape, fmt(p.layout)))
        if p.grad_sync_axes:  # per-parameter share of the bucketed gradient all-reduces
            key = f"grad sync({','.join(names[a] for a in p.grad_sync_axes)})"
            u.comm[key] += 1
            u.comm_bytes[key] += grad_sync_bytes(plan, p)
    top = max((n.time_s for n in plan.nodes), default=0.0)
    for n in plan.nodes:
        u = unit(layer_of(n.module_path))
        u.compute_s += n.time_s
        sig.setdefault(u.name, []).append(("o", rel(n.module_path, u.name), n.target, str(n.strategy)))
        if top > 0 and n.time_s >= SIGNIFICANT * top and n.strategy.outputs and n.strategy.outputs[0] is not None:
            u.acts.append(f"{rel(n.module_path, u.name) or '-'} {n.target.removeprefix('aten.').split('.')[0]} {view.layout(n.strategy.outputs[0])}")
    for t in plan.transfers:
        u = unit(OUTPUT if t.consumer == "output" else layer_of(where.get(t.consumer, "")))
        for phase, steps in (("fwd", t.forward), ("bwd", t.backward)):
            for s in steps:
                if s.communicates:
                    key = f"{phase} {s.kind}({names[s.axis]})"
                    u.comm[key] += 1
                    u.comm_bytes[key] += s.nbytes
                    sig.setdefault(u.name, []).append(("t", rel(where.get(t.consumer, ""), u.name), t.position, str(s), s.nbytes))
    for u in units.values():
        u.signature = tuple(sig.get(u.name, ()))
    return list(units.values())


def grouped_units(plan: Plan) -> list[tuple[str, int, _Unit]]:
    """(label, count, unit): consecutive layers of one group with the same signature merged."""
    out: list[tuple[str, int, _Unit]] = []
    for u in layer_units(plan):
        m = re.match(r"^(.*\.)(\d+)$", u.name)
        if out and m:
            label, count, prev = out[-1]
            pm = re.match(r"^(.*\.)(\d+)$", prev.name)
            if pm and pm.group(1) == m.group(1) and prev.signature == u.signature and int(m.group(2)) == int(pm.group(2)) + count:
                first = label.split(" ")[0].split("-")[0]
                out[-1] = (f"{first}-{m.group(2)}", count + 1, prev)
                continue
        out.append((u.name, 1, u))
    return out


def format_summary(plan: Plan, *, ops: bool = False) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=140, no_color=True, highlight=False)
    view = axis_view(plan)
    for line in _header(plan, view):
        con.print(line, soft_wrap=True)  # whole lines: a wrapped sentence no longer greps
    table = Table(title="per layer (identical repeated layers shown once)", title_justify="left")
    for col in ("layer", "parameters", "activations (significant ops)", "collectives: kind(axis) count bytes", "compute"):
        table.add_column(col)
    for label, count, u in grouped_units(plan):
        comm = "\n".join(
            f"{k} {u.comm[k]} grads {format_bytes(u.comm_bytes[k])} (bucketed)" if k.startswith("grad ")
            else f"{k} x{u.comm[k]} {format_bytes(u.comm_bytes[k])}"
            for k in sorted(u.comm)
        ) or "-"
        took = format_seconds(u.compute_s) + (" each" if count > 1 else "")
        table.add_row(label + (f" (x{count})" if count > 1 else ""), "\n".join(u.params) or "-", "\n".join(u.acts) or "-", comm, took)
    con.print(table)
    if ops:
        con.print(_ops_table(plan, view))
    return buf.getvalue().rstrip()


def _header(plan: Plan, view: AxisView) -> list[str]:
    """The lines above the per-layer table."""
    pipe = plan.pipeline
    count = f"{plan.devices} device{'s' if plan.devices > 1 else ''}"
    where = f"mesh {view.mesh} ({count}; cluster {plan.cluster})" if pipe is None else f"{devices_split(plan, view)} (cluster {plan.cluster})"
    lines = [f"meshplan plan for {plan.model} on {where}, mode {plan.mode}, inputs {plan.inputs_mode}"]
    if view.names != plan.mesh.axis_names:
        lines.append(f"mesh axes named by use (the plan file and the runtime's DeviceMesh call them {', '.join(plan.mesh.axis_names)})")
    lines.append(f"predicted: {headline(plan)}")
    parts = " + ".join(f"{name} {ms(s)}" for name, s in step_parts(plan))
    if pipe is None:
        lines.append(f"step {ms(plan.step_time_s)} = {parts} (no pipeline stages)")
        lines.append(f"memory per device at the peak: {plan.peak_memory}")
    else:
        searched = "" if pipe.searched_step_s is None else \
            f"; the stage plans' own figures (the search's profile priced this configuration at {ms(pipe.searched_step_s)})"
        lines.append(f"step {ms(plan.step_time_s)} = {parts} ({pipe.bubble_fraction:.1%}, schedule {pipe.schedule}){searched}")
        lines.append(f"memory of the fullest pipeline rank at its peak: {plan.peak_memory}")
        lines.append(pipe.summary())
        lines.append(f"one microbatch, whole model, on one stage's sub-mesh: compute {ms(plan.compute_s)} + communication {ms(plan.comm_s)}")
    precision = plan.precision.describe() if plan.precision else "fp32: the model's own dtypes, no casts"
    lines.append(f"precision: {precision}")
    if plan.mfu is not None:
        lines.append(f"MFU {plan.mfu:.1%}: model FLOPs {plan.model_flops:.3g} per step / ({plan.devices} devices x peak "
                     f"{plan.peak_flops:.3g} FLOP/s x predicted step)")
    if plan.token_order:
        lines.append("token order: every tensor split over the cp axis is held as chunks r and 2P-1-r of 2P (head-tail), "
                     "the inputs sliced so")
    if plan.recompute:
        lines.append(f"recomputed in backward: {', '.join(plan.recompute)}")
    offloaded = [p.fqns[0] for p in plan.params if p.offload]
    if offloaded:
        lines.append(f"optimizer state in host memory for {len(offloaded)} parameters: {', '.join(offloaded[:6])}"
                     + (", ..." if len(offloaded) > 6 else ""))
    took = "" if plan.solver.seconds is None else f" in {plan.solver.seconds:.2f} s"
    lines.append(f"solver: {solver_words(plan.solver)}{took}")
    lines += [f"skipped {reason}" for reason in plan.solver.skipped]
    lines += [f"wasted: {line}" for line in wasted(plan, view)]
    per = "per step" if pipe is None else "of one microbatch on one stage's sub-mesh (gradient all-reduces: per step)"
    coll = plan.collectives()
    lines.append(f"collectives {per}: " + (", ".join(f"{k} x{v}" for k, v in sorted(coll.items())) or "none"))
    per_axis: dict[str, int] = {}
    for v in comm_volume(plan):
        per_axis[v.axes] = per_axis.get(v.axes, 0) + v.nbytes
    if per_axis:
        per = "per step and device" if pipe is None else "per device (one microbatch's transfers, the step's gradient all-reduces)"
        lines.append(f"bytes moved {per}, by mesh axis: "
                     + ", ".join(f"{a} {format_bytes(b)}" for a, b in per_axis.items()))
    if plan.fallbacks:
        lines.append("replicated for lack of a rule: " + "; ".join(plan.fallbacks))
    given = ", ".join(f"{i.name}{list(i.shape)} {view.layout(i.layout)}" for i in plan.inputs)
    if pipe is None:
        lines.append(f"inputs: {given}")
    else:
        whole = ", ".join(f"{name}{list(shape)}" for name, shape in step_batch(plan))
        lines.append(f"inputs of one microbatch ({pipe.microbatches} per step, the step's batch {whole} split along dim 0): {given}")
    lines.append(LEGEND)
    return lines


def summary_dict(plan: Plan) -> dict:
    """`meshplan show --json`: the summary's figures and facts as data (layouts in the plan file's form, one placement
    per stored mesh axis)."""
    view = axis_view(plan)
    pipe = plan.pipeline
    return {
        "model": plan.model, "hash": plan.hash(), **figures(plan), "devices_split": devices_split(plan, view),
        "mesh": {"shape": list(plan.mesh.shape), "axis_names": list(plan.mesh.axis_names), "named_by_use": list(view.names),
                 "roles": list(view.roles)},
        "step": dict(step_parts(plan)), "memory_at_peak": plan.peak_memory.to_dict(),
        "pipeline": None if pipe is None else {
            "degree": pipe.degree, "schedule": pipe.schedule, "microbatches": pipe.microbatches, "chunks": pipe.chunks,
            "bubble_s": pipe.bubble_s, "bubble_fraction": pipe.bubble_fraction, "searched_step_s": pipe.searched_step_s,
            "microbatch": {"compute_s": plan.compute_s, "comm_s": plan.comm_s},
            "stages": [{"index": s.index, "pipeline_rank": s.device, "units": list(s.units), "time_s": s.time_s, "recompute": s.recompute,
                        "peak_bytes": s.memory.total} for s in pipe.stages],
        },
        "solver": {"backend": plan.solver.backend, "status": plan.solver.status, "gap": plan.solver.gap,
                   "proven_optimal": plan.solver.proven_optimal, "says": solver_words(plan.solver), "skipped": list(plan.solver.skipped)},
        "wasted": wasted(plan, view),
        "collectives": dict(sorted(plan.collectives().items())),
        "inputs": [{"name": i.name, "shape": list(i.shape), "layout": fmt(i.layout)} for i in plan.inputs],
        "step_inputs": [{"name": n, "shape": list(shape)} for n, shape in step_batch(plan)],
        "fallbacks": list(plan.fallbacks), "recompute": list(plan.recompute), "precision": plan.precision.describe() if plan.precision else None,
        "token_order": plan.token_order,
    }


def _ops_table(plan: Plan, view: AxisView):
    from rich.table import Table

    moves: dict[str, list] = {}
    for t in plan.transfers:
        moves.setdefault(t.consumer, []).append(t)
    table = Table(title="ops (compute ops and every op whose inputs move)", title_justify="left")
    for col in ("module", "op", "strategy", "collectives fwd | bwd", "ms"):
        table.add_column(col)
    for n in plan.nodes:
        ts = moves.get(n.name, [])
        if not ts and n.time_s < 0.01 * max(plan.compute_s, 1e-12):
            continue
        fwd = " ".join(view.step(s) for t in ts for s in t.forward)
        bwd = " ".join(view.step(s) for t in ts for s in t.backward)
        table.add_row(n.module_path or "-", n.target.removeprefix("aten."), view.strategy(n.strategy), f"{fwd or '-'} | {bwd or '-'}",
                      f"{n.time_s * 1e3:.3f}")
    if moves.get("output"):
        table.add_row(OUTPUT, "gather to user", "", " ".join(view.step(s) for t in moves["output"] for s in t.forward), "")
    return table
