"""`Plan.explain(query)`: the recorded alternatives of the nodes a query names, as text (`plans/alternatives.py`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.cost_model.memory import format_bytes
from meshplan.inspect.figures import figures, ms, worded
from meshplan.inspect.why import reasons
from meshplan.plans.alternatives import SIGNIFICANT_COMPUTE, NodeAlternatives
from meshplan.plans.axes import AxisView, axis_view, devices_split
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
    why: tuple[tuple[str, ...], ...]
    """Per entry, one phrase per alternative: what it would move, sum or compute that the chosen does not (why.py)."""
    figures: dict
    """The plan's step, peak, MFU and devices, as every reading prints them (`figures.figures`)."""
    view: AxisView
    """How the plan's layouts print (plans/axes.py)."""
    notes: tuple[str, ...] = ()
    """Lines about the plan as a whole (`explain("pipeline")`: the configurations priced, and why the others lost)."""

    def __str__(self) -> str:
        head = [f"plan: {worded(self.figures)}"]
        if self.notes:
            return "\n".join([*head, f"{self.query}:", *(f"  {n}" for n in self.notes)])
        lines = [*head, f"{self.query}: {len(self.entries) + len(self.unrecorded)} node(s)"]
        for k, e in enumerate(self.entries):
            lines += _format_entry(e, self.why[k], self._layout)
        if self.unrecorded:
            lines.append(f"  cheap ops (under {SIGNIFICANT_COMPUTE:.0%} of the largest op's compute; no alternatives recorded):")
            lines += [f"    {node} {op.removeprefix('aten.')}: {self.view.strategy(s)}" for node, op, s in self.unrecorded]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """`meshplan explain --json`: layouts in the plan file's form (one placement per stored mesh axis)."""
        def entry(e: NodeAlternatives, why: tuple[str, ...]) -> dict:
            return {
                "node": e.node, "kind": e.kind, "what": e.what, "module_path": e.module_path, "chosen": str(e.chosen),
                "chosen_cost_s": e.chosen_cost_s, "candidates": e.candidates,
                "alternatives": [{"strategy": str(a.strategy), "delta_s": a.delta_s, "why": w} for a, w in zip(e.alternatives, why)],
                "ruled_out": [{"strategy": str(r.strategy), "reason": r.reason} for r in e.ruled_out], "ruled_out_total": e.ruled_out_total,
            }
        return {"query": self.query, "plan": self.figures, "entries": [entry(e, why) for e, why in zip(self.entries, self.why)],
                "unrecorded": [{"node": n, "op": op, "strategy": str(s)} for n, op, s in self.unrecorded], "notes": list(self.notes)}

    def _layout(self, e: NodeAlternatives, s: Strategy) -> str:
        """A parameter's or input's layout, or an op's strategy."""
        if e.kind != "op" and s.outputs and s.outputs[0] is not None:
            return self.view.layout(s.outputs[0])
        return self.view.strategy(s)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.4f} ms"


def _format_entry(e: NodeAlternatives, why: tuple[str, ...], layout) -> list[str]:
    label = e.what.removeprefix("aten.") if e.kind == "op" else f"{e.kind} {e.what}"
    where = f" at {e.module_path}" if e.module_path and e.kind == "op" else ""
    lines = [f"  {e.node}: {label}{where}", f"    chosen {layout(e, e.chosen)} [{e.chosen.source}]  local cost {e.chosen_cost_s * 1e3:.4f} ms"]
    if e.alternatives:
        lines.append("    alternatives (local cost delta if only this node switched, and what it would add or save):")
        for a, w in zip(e.alternatives, why):
            delta = "infeasible next to its neighbours' layouts" if a.delta_s is None else _ms(a.delta_s)
            words = f": {w}" if a.delta_s is not None else ""
            lines.append(f"      {layout(e, a.strategy):<28} {delta}{words}")
    more = e.candidates - 1 - len(e.alternatives)
    if more > 0:
        lines.append(f"      ... {more} more candidate(s) not listed")
    if e.candidates == 1:
        lines.append("    no other candidate reached the solver")
    if e.ruled_out:
        lines.append("    ruled out:")
        lines += [f"      {layout(e, r.strategy):<28} {r.reason}" for r in e.ruled_out]
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
    view = axis_view(plan)
    return Explanation(query, tuple(entries), tuple(unrecorded), tuple(reasons(plan, view, e) for e in entries), figures(plan), view)


def _explain_pipeline(plan: Plan) -> Explanation:
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("explain('pipeline'): the plan has no pipeline stages")
    searched = "" if pipe.searched_step_s is None else f"; the search's stage profiles priced it at {ms(pipe.searched_step_s)}"
    notes = [f"returned: {devices_split(plan)}, {pipe.schedule}, {pipe.microbatches} microbatches: its stage plan priced at "
             f"{ms(plan.step_time_s)} per step{searched}; the fullest pipeline rank peaks at {format_bytes(plan.peak_memory.total)}"]
    notes += list(plan.solver.skipped) or ["no other configuration was priced"]
    return Explanation("pipeline", (), (), (), figures(plan), axis_view(plan), tuple(notes))
