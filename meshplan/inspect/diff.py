"""`Plan.diff(other)`: what changed between two plans, and what it costs.

Nodes and parameters are matched by name, which is meaningful when both plans were made for the same
graph (same fingerprint); for different graphs the diff says so and still compares what matches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from meshplan.cost_model.memory import format_bytes
from meshplan.ir.placement import fmt

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

    same_graph: bool
    settings: tuple[tuple[str, str, str], ...]
    """(what, a, b) for differing mesh, mode, inputs mode, cluster, model."""
    ops: tuple[Change, ...]
    params: tuple[Change, ...]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    collectives: tuple[tuple[str, int, int], ...]
    """(phase:kind, count in a, count in b) where the counts differ."""
    step_time_s: tuple[float, float]
    compute_s: tuple[float, float]
    comm_s: tuple[float, float]
    memory: tuple[tuple[str, int, int], ...]
    """(category, bytes in a, bytes in b) for params, grads, optimizer, activations, total."""

    @property
    def identical(self) -> bool:
        return not (self.settings or self.ops or self.params or self.only_in_a or self.only_in_b or self.collectives) and (
            self.step_time_s[0] == self.step_time_s[1]
        )

    @property
    def delta_step_time_s(self) -> float:
        return self.step_time_s[1] - self.step_time_s[0]

    @property
    def delta_memory(self) -> int:
        return self.memory[-1][2] - self.memory[-1][1]

    def __str__(self) -> str:
        if self.identical:
            return "the plans are identical"
        lines = []
        if not self.same_graph:
            lines.append("the plans were made for different graphs (fingerprints differ): nodes are matched by name only")
        lines += [f"{what}: {a} -> {b}" for what, a, b in self.settings]
        a, b = self.step_time_s
        lines.append(f"predicted step: {a * 1e3:.3f} ms -> {b * 1e3:.3f} ms ({_pct(a, b)})")
        for label, (x, y) in (("  compute", self.compute_s), ("  communication", self.comm_s)):
            lines.append(f"{label}: {x * 1e3:.3f} ms -> {y * 1e3:.3f} ms ({(y - x) * 1e3:+.3f} ms)")
        lines.append("memory per device:")
        lines += [f"  {cat}: {format_bytes(x)} -> {format_bytes(y)} ({_sign_bytes(y - x)})" for cat, x, y in self.memory]
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
    settings = []
    for what, x, y in (
        ("model", a.model, b.model),
        ("mesh", str(a.mesh), str(b.mesh)),
        ("cluster", a.cluster, b.cluster),
        ("mode", a.mode, b.mode),
        ("inputs", a.inputs_mode, b.inputs_mode),
    ):
        if x != y:
            settings.append((what, x, y))
    a_ops, b_ops = {n.name: n for n in a.nodes}, {n.name: n for n in b.nodes}
    ops = tuple(
        Change(name, n.module_path, str(n.strategy), str(b_ops[name].strategy))
        for name, n in a_ops.items()
        if name in b_ops and n.strategy != b_ops[name].strategy
    )
    a_par, b_par = {p.node: p for p in a.params}, {p.node: p for p in b.params}
    params = []
    for name, p in a_par.items():
        q = b_par.get(name)
        if q is not None and (p.layout != q.layout or p.grad_sync_axes != q.grad_sync_axes or a.mesh != b.mesh):
            before, after = _param_form(a, p), _param_form(b, q)
            if before != after:
                params.append(Change(" = ".join(p.fqns), "", before, after))
    only_a = tuple(n for n in list(a_ops) + list(a_par) if n not in b_ops and n not in b_par)
    only_b = tuple(n for n in list(b_ops) + list(b_par) if n not in a_ops and n not in a_par)
    ca, cb = a.collectives(), b.collectives()
    coll = tuple((k, ca.get(k, 0), cb.get(k, 0)) for k in sorted(set(ca) | set(cb)) if ca.get(k, 0) != cb.get(k, 0))
    mem = tuple((f.name, getattr(a.memory, f.name), getattr(b.memory, f.name)) for f in fields(a.memory))
    mem += (("total", a.memory.total, b.memory.total),)
    return PlanDiff(
        same_graph=a.graph_fingerprint == b.graph_fingerprint, settings=tuple(settings), ops=ops, params=tuple(params),
        only_in_a=only_a, only_in_b=only_b, collectives=coll, step_time_s=(a.step_time_s, b.step_time_s),
        compute_s=(a.compute_s, b.compute_s), comm_s=(a.comm_s, b.comm_s), memory=mem,
    )


def _param_form(plan: Plan, p) -> str:
    sync = ",".join(plan.mesh.axis_names[x] for x in p.grad_sync_axes)
    return fmt(p.layout) + (f" (grad all_reduce over {sync})" if sync else "")


__all__ = ["Change", "PlanDiff", "diff_plans"]
