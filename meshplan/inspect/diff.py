"""`Plan.diff(other)`: what changed between two plans, and what it costs.

Plans are compared by the figures every reading prints (`figures.py`): the step, the peak per device and MFU, so a
pipelined plan compares with a flat one by its whole step and its fullest rank, never by its one-microbatch parts.
A pipeline section lists what differs in stages, schedule and microbatches.

Nodes and parameters are matched by name. That is meaningful for the same graph, and for a pipelined plan against
another plan of the same model: its graph is one microbatch (the same ops at a smaller batch), so its fingerprint
differs but its nodes are the same. Layouts are compared by what they do (how many ways each tensor dim is split,
and whether a gradient is summed over every copy), so `RR` on one mesh and `RRR` on another are no change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from meshplan.cost_model.memory import format_bytes
from meshplan.inspect.figures import figures, ms, step_parts
from meshplan.ir.placement import Partial, Placements, Replicate, Shard
from meshplan.plans.axes import AxisView, axis_view, devices_split, step_batch

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan

MAX_LISTED = 20
"""Changed ops and parameters printed by `str(diff)` (all are kept in the object)."""


@dataclass(frozen=True, slots=True)
class Change:
    """One node or parameter planned differently."""

    name: str
    """Node name, or the parameter's FQNs."""
    where: str
    """Module path (ops) or '' (parameters)."""
    before: str
    after: str


@dataclass(frozen=True, slots=True)
class PlanDiff:
    """Differences from plan `a` to plan `b`; every delta is b - a."""

    graphs: str
    """'same' (equal fingerprints), 'microbatch' (the same ops, one plan pipelined and traced at its microbatch) or
    'different'."""
    settings: tuple[tuple[str, str, str], ...]
    """(what, a, b) for differing model, devices (and how they split), cluster, mode, inputs mode."""
    ops: tuple[Change, ...]
    params: tuple[Change, ...]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    collectives: tuple[tuple[str, int, int], ...]
    """(phase:kind, count in a, count in b) where the counts differ; empty when one plan is pipelined (its list is one
    microbatch's)."""
    step_time_s: tuple[float, float]
    peak_bytes: tuple[int, int]
    mfu: tuple[float | None, float | None]
    step_parts: tuple[tuple[str, float, float], ...]
    """(part, seconds in a, seconds in b): compute, communication, optimizer step, host and bubble when neither plan is
    pipelined; otherwise working time and bubble (a flat plan's working time is its whole step)."""
    memory: tuple[tuple[str, int, int], ...]
    """(category, bytes in a, bytes in b) of the fullest device at its peak: params, grads, optimizer, activations, total."""
    pipeline: tuple[tuple[str, str, str], ...]
    """(what, a, b) for differing pipeline stages, schedule, microbatches, chunks per rank, bubble, devices per stage
    and stage cuts; empty when neither plan is pipelined or both pipelines are the same."""

    @property
    def same_graph(self) -> bool:
        """Nodes matched by name mean the same op in both plans."""
        return self.graphs != "different"

    @property
    def identical(self) -> bool:
        return not (self.settings or self.ops or self.params or self.only_in_a or self.only_in_b or self.collectives
                    or self.pipeline) and self.step_time_s[0] == self.step_time_s[1]

    @property
    def delta_step_time_s(self) -> float:
        return self.step_time_s[1] - self.step_time_s[0]

    @property
    def delta_memory(self) -> int:
        """Peak bytes per device, b - a."""
        return self.peak_bytes[1] - self.peak_bytes[0]

    def to_dict(self) -> dict:
        """`meshplan diff --json`."""
        return {
            "identical": self.identical, "graphs": self.graphs, "settings": [list(s) for s in self.settings],
            "step_time_s": list(self.step_time_s), "peak_bytes": list(self.peak_bytes), "mfu": list(self.mfu),
            "step_parts": [list(p) for p in self.step_parts], "memory": [list(m) for m in self.memory],
            "pipeline": [list(p) for p in self.pipeline], "collectives": [list(c) for c in self.collectives],
            "params": [{"name": c.name, "before": c.before, "after": c.after} for c in self.params],
            "ops": [{"name": c.name, "where": c.where, "before": c.before, "after": c.after} for c in self.ops],
            "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b),
        }

    def __str__(self) -> str:
        if self.identical:
            return "the plans are identical"
        lines = []
        if self.graphs == "different":
            lines.append("the plans were made for different graphs (fingerprints differ): nodes are matched by name only")
        elif self.graphs == "microbatch":
            lines.append("the pipelined plan's graph is one microbatch of the same model (same ops, smaller batch): nodes are "
                         "matched by name; the plans are compared by their whole step and their fullest device")
        lines += [f"{what}: {a} -> {b}" for what, a, b in self.settings]
        a, b = self.step_time_s
        lines.append(f"predicted step: {ms(a)} -> {ms(b)} ({_pct(a, b)})")
        lines += [f"  {part}: {ms(x)} -> {ms(y)} ({(y - x) * 1e3:+.3f} ms)" for part, x, y in self.step_parts if x or y]
        x, y = self.peak_bytes
        lines.append(f"peak memory per device: {format_bytes(x)} -> {format_bytes(y)} ({_sign_bytes(y - x)})")
        lines += [f"  {cat}: {format_bytes(x)} -> {format_bytes(y)} ({_sign_bytes(y - x)})" for cat, x, y in self.memory[:-1]]
        if self.mfu != (None, None):
            lines.append("MFU: " + " -> ".join("-" if m is None else f"{m:.1%}" for m in self.mfu))
        if self.pipeline:
            lines.append("pipeline:")
            lines += [f"  {what}: {x} -> {y}" for what, x, y in self.pipeline]
        if self.collectives:
            lines.append("collectives per step:")
            lines += [f"  {k}: {x} -> {y}" for k, x, y in self.collectives]
        for title, changes in (("parameters", self.params), ("ops", self.ops)):
            if changes:
                lines.append(f"{title} planned differently ({len(changes)}):")
                for c in changes[:MAX_LISTED]:
                    where = f" at {c.where}" if c.where else ""
                    lines.append(f"  {c.name}{where}: {c.before} -> {c.after}")
                if len(changes) > MAX_LISTED:
                    lines.append(f"  ... {len(changes) - MAX_LISTED} more")
        for title, names in (("only in the first plan", self.only_in_a), ("only in the second plan", self.only_in_b)):
            if names:
                lines.append(f"{title}: {', '.join(names[:MAX_LISTED])}" + (" ..." if len(names) > MAX_LISTED else ""))
        return "\n".join(lines)


def _pct(a: float, b: float) -> str:
    delta = f"{(b - a) * 1e3:+.3f} ms"
    return f"{delta}, {(b - a) / a:+.1%}" if a > 0 else delta


def _sign_bytes(n: int) -> str:
    return ("+" if n >= 0 else "") + format_bytes(n)


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    va, vb = axis_view(a), axis_view(b)
    settings = []
    for what, x, y in (
        ("model", a.model, b.model),
        ("devices", devices_split(a, va), devices_split(b, vb)),
        ("cluster", a.cluster, b.cluster),
        ("mode", a.mode, b.mode),
        ("inputs", a.inputs_mode, b.inputs_mode),
    ):
        if x != y:
            settings.append((what, x, y))
    a_ops, b_ops = {n.name: n for n in a.nodes}, {n.name: n for n in b.nodes}
    ops = tuple(
        Change(name, n.module_path, va.strategy(n.strategy), vb.strategy(b_ops[name].strategy))
        for name, n in a_ops.items()
        if name in b_ops and _strategy_use(a, n.strategy) != _strategy_use(b, b_ops[name].strategy)
    )
    a_par, b_par = {p.node: p for p in a.params}, {p.node: p for p in b.params}
    params = tuple(
        Change(" = ".join(p.fqns), "", _param_form(va, p), _param_form(vb, b_par[name]))
        for name, p in a_par.items()
        if name in b_par and _param_use(a, p) != _param_use(b, b_par[name])
    )
    only_a = tuple(n for n in list(a_ops) + list(a_par) if n not in b_ops and n not in b_par)
    only_b = tuple(n for n in list(b_ops) + list(b_par) if n not in a_ops and n not in a_par)
    coll: tuple = ()
    if (a.pipeline is None) == (b.pipeline is None):
        ca, cb = a.collectives(), b.collectives()
        coll = tuple((k, ca.get(k, 0), cb.get(k, 0)) for k in sorted(set(ca) | set(cb)) if ca.get(k, 0) != cb.get(k, 0))
    ma, mb = a.peak_memory, b.peak_memory
    mem = tuple((f.name, getattr(ma, f.name), getattr(mb, f.name)) for f in fields(ma)) + (("total", ma.total, mb.total),)
    fa, fb = figures(a), figures(b)
    return PlanDiff(
        graphs=_graphs(a, b), settings=tuple(settings), ops=ops, params=params, only_in_a=only_a, only_in_b=only_b,
        collectives=coll, step_time_s=(a.step_time_s, b.step_time_s), peak_bytes=(fa["peak_bytes"], fb["peak_bytes"]),
        mfu=(fa["mfu"], fb["mfu"]), step_parts=_step_parts(a, b), memory=mem, pipeline=_pipeline(a, b, va, vb),
    )


def _graphs(a: Plan, b: Plan) -> str:
    if a.graph_fingerprint == b.graph_fingerprint:
        return "same"
    ops = [(n.name, n.target, n.module_path) for n in a.nodes] == [(n.name, n.target, n.module_path) for n in b.nodes]
    if ops and (a.pipeline or b.pipeline) and step_batch(a) == step_batch(b):
        return "microbatch"
    return "different"


def _step_parts(a: Plan, b: Plan) -> tuple[tuple[str, float, float], ...]:
    if a.pipeline is None and b.pipeline is None:
        pa, pb = dict(step_parts(a)), dict(step_parts(b))
        return tuple((k, pa.get(k, 0.0), pb.get(k, 0.0)) for k in dict.fromkeys([*pa, *pb]))
    return (("working", a.step_time_s - a.bubble_s, b.step_time_s - b.bubble_s), ("bubble", a.bubble_s, b.bubble_s))


def _pipeline(a: Plan, b: Plan, va: AxisView, vb: AxisView) -> tuple[tuple[str, str, str], ...]:
    if a.pipeline is None and b.pipeline is None:
        return ()

    def facts(plan: Plan, view: AxisView) -> dict[str, str]:
        pipe = plan.pipeline
        if pipe is None:
            return {"stages": "1 (no pipeline)", "schedule": "-", "microbatches": "1", "chunks per rank": "-",
                    "bubble": f"{ms(0.0)} (0.0%)", "devices per stage": f"{plan.devices} ({view.grid})", "stage cuts": "-"}
        cuts = "; ".join(f"{s.units[0]}..{s.units[-1]}" if len(s.units) > 1 else s.units[0] for s in pipe.stages)
        batch = ", ".join(f"{i.name}{list(i.shape)}" for i in plan.inputs)
        return {"stages": str(pipe.degree), "schedule": pipe.schedule, "microbatches": f"{pipe.microbatches} ({batch} each)",
                "chunks per rank": str(pipe.chunks), "bubble": f"{ms(pipe.bubble_s)} ({pipe.bubble_fraction:.1%})",
                "devices per stage": f"{plan.mesh.size} ({view.grid})", "stage cuts": cuts}

    x, y = facts(a, va), facts(b, vb)
    return tuple((k, x[k], y[k]) for k in x if x[k] != y[k])


def _use(layout: Placements, shape: tuple[int, ...]) -> tuple:
    """What a layout does, whatever the mesh: the number of ways each tensor dim is split, and the partial sums."""
    split: dict[int, int] = {}
    partial = 1
    for p, n in zip(layout, shape):
        if isinstance(p, Shard):
            split[p.dim] = split.get(p.dim, 1) * n
        elif isinstance(p, Partial):
            partial *= n
    return tuple(sorted((d, k) for d, k in split.items() if k > 1)), partial


def _strategy_use(plan: Plan, s) -> tuple:
    shape = plan.mesh.shape
    return (tuple(None if p is None else _use(p, shape) for p in s.inputs), tuple(None if p is None else _use(p, shape) for p in s.outputs),
            s.kernel)


def _param_use(plan: Plan, p) -> tuple:
    """Its layout's use, and whether its gradient is summed over every copy (the mesh axes it is replicated on) or
    over a part of them."""
    copies = {a for a, (q, n) in enumerate(zip(p.layout, plan.mesh.shape)) if isinstance(q, Replicate) and n > 1}
    synced = {a for a in p.grad_sync_axes if plan.mesh.shape[a] > 1}
    return _use(p.layout, plan.mesh.shape), "every copy" if synced == copies else tuple(plan.mesh.shape[a] for a in sorted(synced))


def _param_form(view: AxisView, p) -> str:
    sync = view.axes(a for a in p.grad_sync_axes if view.sizes[a] > 1)
    return view.layout(p.layout) + (f" (grad all_reduce over {sync})" if sync else "")


__all__ = ["Change", "PlanDiff", "diff_plans"]
