"""`Plan.explain(query)`: the recorded alternatives of the nodes a query names, as text (`plans/alternatives.py`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.cost_model.memory import format_bytes
from meshplan.ir.placement import fmt
from meshplan.plans.alternatives import SIGNIFICANT_COMPUTE, NodeAlternatives
from meshplan.plans.strategy import Strategy

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan


@dataclass(frozen=True, slots=True)
class Explanation:
    """`Plan.explain(query)`: the recorded choices of the nodes the query names."""

    query: str
    entries: tuple[NodeAlternatives, ...]
    unrecorded: tuple[tuple[str, str, Strategy], ...]
    """(node, op, chosen strategy) of matched ops too cheap to have alternatives recorded."""
    notes: tuple[str, ...] = ()
    """Lines about the plan as a whole (`explain("pipeline")`: the configurations priced, and why the others lost)."""

    def __str__(self) -> str:
        if self.notes:
            return "\n".join([f"{self.query}:", *(f"  {n}" for n in self.notes)])
        lines = [f"{self.query}: {len(self.entries) + len(self.unrecorded)} node(s)"]
        for e in self.entries:
            lines += _format_entry(e)
        if self.unrecorded:
            lines.append(f"  cheap ops (under {SIGNIFICANT_COMPUTE:.0%} of the largest op's compute; no alternatives recorded):")
            lines += [f"    {node} {op.removeprefix('aten.')}: {s}" for node, op, s in self.unrecorded]
        return "\n".join(lines)


def _layout(e: NodeAlternatives, s: Strategy) -> str:
    return fmt(s.outputs[0]) if e.kind != "op" and s.outputs and s.outputs[0] is not None else str(s)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.4f} ms"


def _format_entry(e: NodeAlternatives) -> list[str]:
    label = e.what.removeprefix("aten.") if e.kind == "op" else f"{e.kind} {e.what}"
    where = f" at {e.module_path}" if e.module_path and e.kind == "op" else ""
    lines = [f"  {e.node}: {label}{where}", f"    chosen {_layout(e, e.chosen)} [{e.chosen.source}]  local cost {e.chosen_cost_s * 1e3:.4f} ms"]
    if e.alternatives:
        lines.append("    alternatives (local cost delta if only this node switched):")
        for a in e.alternatives:
            delta = "infeasible next to its neighbours' layouts" if a.delta_s is None else _ms(a.delta_s)
            lines.append(f"      {_layout(e, a.strategy):<28} {delta}")
    more = e.candidates - 1 - len(e.alternatives)
    if more > 0:
        lines.append(f"      ... {more} more candidate(s) not listed")
    if e.candidates == 1:
        lines.append("    no other candidate reached the solver")
    if e.ruled_out:
        lines.append("    ruled out:")
        lines += [f"      {_layout(e, r.strategy):<28} {r.reason}" for r in e.ruled_out]
        if e.ruled_out_total > len(e.ruled_out):
            lines.append(f"      ... {e.ruled_out_total - len(e.ruled_out)} more ruled out")
    return lines


def explain(plan: Plan, query: str) -> Explanation:
    """The recorded choices for `query`: a module path, a parameter FQN or a node name; or "pipeline": how the returned
    pipeline configuration was priced and what the other configurations priced came to (or why they were dropped)."""
    if not isinstance(query, str) or not query:
        raise ValueError(f"explain needs a module path, parameter FQN, node name or 'pipeline'; got {query!r}")
    if query == "pipeline":
        return _explain_pipeline(plan)
    recorded = {a.node: a for a in plan.alternatives}
    params = {p.node: p for p in plan.params}

    def matches(e_path: str, fqns: tuple[str, ...], name: str) -> bool:
        if name == query or query in fqns:
            return True
        return any(p == query or p.startswith(query + ".") for p in (e_path, *fqns) if p)

    entries: list[NodeAlternatives] = []
    unrecorded: list[tuple[str, str, Strategy]] = []
    for a in plan.alternatives:
        fqns = params[a.node].fqns if a.node in params else ()
        if matches(a.module_path if a.kind == "op" else "", fqns, a.node):
            entries.append(a)
    for n in plan.nodes:
        if n.name not in recorded and matches(n.module_path, (), n.name):
            unrecorded.append((n.name, n.target, n.strategy))
    if not entries and not unrecorded:
        if not plan.alternatives:
            raise ValueError(f"plan records no alternatives (made by an older meshplan); re-plan to explain {query!r}")
        known = sorted({n.module_path for n in plan.nodes if n.module_path} | {f for p in plan.params for f in p.fqns})
        close = difflib.get_close_matches(query, known, n=5, cutoff=0.5) or known[:5]
        raise ValueError(f"{query!r} names no module, parameter or node of the plan; close matches: {', '.join(close)}")
    return Explanation(query, tuple(entries), tuple(unrecorded))


def _explain_pipeline(plan: Plan) -> Explanation:
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("explain('pipeline'): the plan has no pipeline stages")
    searched = "" if pipe.searched_step_s is None else f"; the search's stage profiles priced it at {pipe.searched_step_s:.4g} s"
    notes = [f"returned: pp {pipe.degree} x {plan.mesh}, {pipe.schedule}, {pipe.microbatches} microbatches: its stage plan priced at "
             f"{pipe.step_s:.4g} s per step{searched}; the fullest rank peaks at {format_bytes(plan.memory.total)}"]
    notes += list(plan.solver.skipped) or ["no other configuration was priced"]
    return Explanation("pipeline", (), (), tuple(notes))
