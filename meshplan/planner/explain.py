"""Why a plan chose what it chose: the alternatives per node, their cost deltas, and what ruled others out.

The planner calls `record_alternatives` once, after the solve, so `Plan.explain` (and
`meshplan explain plan.json NODE`) works from the plan file alone. For every parameter, user input
and op whose compute is not negligible it keeps:

- the candidates the solver could pick, each with its *local cost delta*: how much the predicted
  step time changes if this node alone switched strategy while its neighbours kept theirs (its own
  compute or gradient sync, plus resharding on its edges, priced as the solver priced them). A
  negative delta means the node's choice was made for more than itself: repeated layers tied to one
  choice (`PlanOptions.tie_layers`), a solve stopped short of optimal, or a memory constraint;
- the candidates ruled out before the solve, with the reason: `annotation` (a forced layout:
  mode preset, `param_layouts`, `input_layouts`), `divisibility` (a tensor does not split evenly)
  or `memory` (the candidate alone exceeds the per-device budget).

Both lists are capped (`MAX_LISTED`) and the totals are kept, so a capped list says so.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.cost_model.estimate import local_bytes
from meshplan.cost_model.memory import format_bytes, optimizer_state_bytes
from meshplan.ir.placement import fmt
from meshplan.planner.strategy import Strategy

if TYPE_CHECKING:  # the planner builds plans; this module only reads them
    from meshplan.ir.graph import Graph, Node, TensorRef
    from meshplan.ir.mesh import MeshSpec
    from meshplan.ir.placement import Placements
    from meshplan.planner.plan import Plan

MAX_LISTED = 8
"""Alternatives (and ruled-out candidates) kept per node, best first."""
SIGNIFICANT_COMPUTE = 0.01
"""An op's alternatives are recorded when its compute is at least this share of the largest op's."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """A candidate the solver could have picked."""

    strategy: Strategy
    delta_s: float | None
    """Local cost delta in seconds against the chosen strategy; None when the neighbours' chosen
    layouts cannot be moved to what this candidate needs."""


@dataclass(frozen=True, slots=True)
class RuledOut:
    """A candidate removed before the solve."""

    strategy: Strategy
    reason: str
    """Starts with the constraint: 'annotation: ...', 'divisibility: ...' or 'memory: ...'."""


@dataclass(frozen=True, slots=True)
class NodeAlternatives:
    """The recorded choice of one node."""

    node: str
    kind: str
    """'op', 'param', 'buffer' or 'input'."""
    what: str
    """The ATen op, the parameter FQNs (`a = b` when tied) or the input name."""
    module_path: str
    chosen: Strategy
    chosen_cost_s: float
    """The chosen strategy's local cost (node cost plus resharding on its edges)."""
    alternatives: tuple[Alternative, ...]
    candidates: int
    """How many candidates the solver saw (the chosen one included)."""
    ruled_out: tuple[RuledOut, ...]
    ruled_out_total: int

    @staticmethod
    def from_dict(d: dict) -> NodeAlternatives:
        return NodeAlternatives(
            node=d["node"], kind=d["kind"], what=d["what"], module_path=d["module_path"],
            chosen=Strategy.from_json(d["chosen"]), chosen_cost_s=d["chosen_cost_s"],
            alternatives=tuple(Alternative(Strategy.from_json(a["strategy"]), a["delta_s"]) for a in d["alternatives"]),
            candidates=d["candidates"],
            ruled_out=tuple(RuledOut(Strategy.from_json(r["strategy"]), r["reason"]) for r in d["ruled_out"]),
            ruled_out_total=d["ruled_out_total"],
        )


# ---------------------------------------------------------------- recording (planner side)


def record_alternatives(
    graph: Graph, mesh: MeshSpec, cands, before_forced: dict[str, list[Strategy]], choice: dict[str, int], options, *,
    own_cost: Callable[[str, int], float], move_cost: Callable[[TensorRef, Node, Placements, Placements], float | None],
) -> tuple[NodeAlternatives, ...]:
    """What `explain` needs, for the nodes worth explaining (see the module docstring).

    `choice[node]` indexes `cands.by_node[node]`; `own_cost(node, i)` is the node's own cost under
    its candidate `i` (compute, or gradient sync); `move_cost(ref, consumer, src, dst)` the cost of
    moving tensor `ref` to `consumer` between two layouts (None when impossible). Both are the
    planner's, so deltas are priced exactly as the solve priced them.
    """
    consumers = graph.consumers()
    chosen = {name: cands.by_node[name][i] for name, i in choice.items()}

    def local_cost(node: Node, s: Strategy, i: int) -> float:
        total = own_cost(node.name, i)
        for pos, ref in enumerate(node.inputs):
            total += _or_inf(move_cost(ref, node, chosen[ref.node].outputs[ref.index], s.inputs[pos]))
        for user, pos in consumers[node.name]:
            consumer = graph[user]
            ref = consumer.inputs[pos]
            total += _or_inf(move_cost(ref, consumer, s.outputs[ref.index], chosen[user].inputs[pos]))
        return total

    op_costs = [own_cost(n.name, choice[n.name]) for n in graph.nodes if n.kind == "op"]
    threshold = SIGNIFICANT_COMPUTE * max(op_costs, default=0.0)
    budget = getattr(options, "memory_budget", None)
    out: list[NodeAlternatives] = []
    for node in graph.nodes:
        if node.kind not in ("op", "param", "buffer", "input"):
            continue
        if node.kind == "op" and (threshold == 0.0 or own_cost(node.name, choice[node.name]) < threshold):
            continue
        kept = cands.by_node[node.name]
        mine = choice[node.name]
        chosen_cost = local_cost(node, kept[mine], mine)
        alts: list[Alternative] = []
        ruled: list[RuledOut] = [RuledOut(s, _annotation_reason(node, options)) for s in before_forced[node.name] if s not in kept]
        for i, s in enumerate(kept):
            if i == mine:
                continue
            too_big = _memory_reason(node, s, mesh, options, budget)
            if too_big:
                ruled.append(RuledOut(s, too_big))
                continue
            c = local_cost(node, s, i)
            alts.append(Alternative(s, None if math.isinf(c) else c - chosen_cost))
        seen = {str(r.strategy) for r in ruled}
        for s, reason in cands.rejected.get(node.name, []):
            if str(s) not in seen:
                seen.add(str(s))
                ruled.append(RuledOut(s, reason))
        alts.sort(key=lambda a: (a.delta_s is None, a.delta_s or 0.0, str(a.strategy)))
        what = " = ".join(node.fqns) if node.fqns else node.target
        out.append(
            NodeAlternatives(
                node=node.name, kind=node.kind, what=what, module_path=node.module_path, chosen=kept[mine],
                chosen_cost_s=chosen_cost, alternatives=tuple(alts[:MAX_LISTED]), candidates=len(kept),
                ruled_out=tuple(ruled[:MAX_LISTED]), ruled_out_total=len(ruled),
            )
        )
    return tuple(out)


def _or_inf(cost: float | None) -> float:
    return math.inf if cost is None else cost


def _annotation_reason(node: Node, options) -> str:
    for pattern in getattr(options, "param_layouts", {}) or {}:
        if any(fnmatch.fnmatchcase(f, pattern) for f in node.fqns):
            return f"annotation: param_layouts[{pattern!r}] forces another layout"
    if node.name in (getattr(options, "input_layouts", {}) or {}):
        return f"annotation: input_layouts[{node.name!r}] forces another layout"
    mode = getattr(options, "mode", "")
    if mode != "auto":
        return f"annotation: mode={mode!r} forces another layout"
    return "annotation: a forced layout excludes it"


def _memory_reason(node: Node, s: Strategy, mesh: MeshSpec, options, budget) -> str:
    """'memory: ...' when this candidate alone needs more than the per-device budget, else ''."""
    if budget is None:
        return ""
    shape = mesh.shape
    if node.kind in ("param", "buffer"):
        n = local_bytes(node.out, s.outputs[0], shape)
        need = n
        if node.kind == "param" and node.grad(0):
            need += n + optimizer_state_bytes(n // node.out.itemsize, getattr(options, "optimizer", "adam"))
    else:
        need = sum(local_bytes(m, p, shape) for m, p in zip(node.outputs, s.outputs) if m is not None and p is not None)
    if need > budget:
        return f"memory: needs {format_bytes(need)} per device on its own, over the budget of {format_bytes(budget)}"
    return ""


# ---------------------------------------------------------------- explaining (reader side)


@dataclass(frozen=True, slots=True)
class Explanation:
    """`Plan.explain(query)`: the recorded choices of the nodes the query names."""

    query: str
    entries: tuple[NodeAlternatives, ...]
    unrecorded: tuple[tuple[str, str, Strategy], ...]
    """(node, op, chosen strategy) of matched ops too cheap to have alternatives recorded."""

    def __str__(self) -> str:
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
    """The recorded choices for `query`: a module path, a parameter FQN or a node name."""
    if not isinstance(query, str) or not query:
        raise ValueError(f"explain needs a module path, parameter FQN or node name; got {query!r}")
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
