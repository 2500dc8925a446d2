"""Why a plan chose what it chose, as data: per node, the candidates the solver could pick with their cost deltas,
and the ones ruled out before the solve with the reason.

The planner records them once, after the solve (`planner/alternatives.py`), so that `Plan.explain` and
`meshplan explain plan.json NODE` (`inspect/explain.py`) work from the plan file alone. For every parameter, user
input and op whose compute is not negligible a plan keeps:

- the candidates the solver could pick, each with its *local cost delta*: how much the predicted
  step time changes if this node alone switched strategy while its neighbours kept theirs (its own
  compute or gradient sync, plus resharding on its edges, priced as the search priced them, so in
  units of `plan.solver.objective_s` rather than the bucket-priced `plan.step_time_s`). A
  negative delta means the node's choice was made for more than itself: repeated layers tied to one
  choice (`PlanOptions.tie_layers`), a solve stopped short of optimal, or a memory constraint;
- the candidates ruled out before the solve, with the reason: `annotation` (a forced layout:
  mode preset, `param_layouts`, `input_layouts`), `divisibility` (a tensor does not split evenly)
  or `memory` (the candidate alone exceeds the per-device budget).

Both lists are capped (`MAX_LISTED`) and the totals are kept, so a capped list says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.plans.strategy import Strategy

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
