"""Why an alternative costs what it does, in words: what it would move, sum or compute that the chosen strategy does not.

Read from the plan alone. A node's neighbours keep their chosen layouts (that is how `delta_s` is priced,
plans/alternatives.py): an input arrives as its producer gives it (the source of the transfer into it, or else the
layout the chosen strategy reads), and an output must reach its consumers as they take it (the targets of the
transfers out of it, or else the chosen output layout). The collectives are the cost model's own steps for each
move (cost_model/redistribution.py), less the ones the chosen strategy runs there too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshplan.cost_model.redistribution import InfeasibleRedistribution, redistribution_steps
from meshplan.ir.graph import TensorMeta
from meshplan.ir.placement import Placements, Replicate, Shard
from meshplan.plans.alternatives import NodeAlternatives
from meshplan.plans.axes import AxisView

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan
    from meshplan.plans.strategy import Strategy


def reasons(plan: Plan, view: AxisView, entry: NodeAlternatives) -> tuple[str, ...]:
    """One phrase per alternative of `entry`, in its order."""
    into = {(t.consumer, t.position): t.src for t in plan.transfers}
    out_of: dict[str, list[Placements]] = {}
    for t in plan.transfers:
        out_of.setdefault(t.tensor, []).append(t.dst)
    param = next((p for p in plan.params if p.node == entry.node), None)
    phrases = []
    for alt in entry.alternatives:
        if entry.kind == "op":
            words = _op_words(entry, alt.strategy, into, out_of, view)
        else:
            words = _leaf_words(entry, alt.strategy, out_of.get(entry.node, []), param, view)
        phrases.append("; ".join(words) or "the same collectives at its edges: the difference is its own cost")
    return tuple(phrases)


def _op_words(entry: NodeAlternatives, alt: Strategy, into: dict, out_of: dict, view: AxisView) -> list[str]:
    chosen, words = entry.chosen, []
    for k, (need, had) in enumerate(zip(alt.inputs, chosen.inputs)):
        if need is not None and need != had:
            src = into.get((entry.node, k), had)
            words += _say(_steps(src, need, view) - _steps(src, had, view), f"input {k}", view)
    for i, (out, had) in enumerate(zip(alt.outputs, chosen.outputs)):
        if out is not None and out != had:
            name = "the output" if len(alt.outputs) == 1 else f"output {i}"
            for dst in _consumers(out_of.get(entry.node if i == 0 else f"{entry.node}[{i}]", []), had):
                words += _say(_steps(out, dst, view) - _steps(had, dst, view), name, view)
    work = _split(chosen.outputs[0], view) / _split(alt.outputs[0], view) if chosen.outputs and alt.outputs else 1
    if work > 1:
        words.append(f"{work:g}x the compute per device")
    elif work < 1:
        words.append(f"1/{1 / work:g} of the compute per device")
    return words


def _leaf_words(entry: NodeAlternatives, alt: Strategy, uses: list[Placements], param, view: AxisView) -> list[str]:
    chosen, layout = entry.chosen.outputs[0], alt.outputs[0]
    if layout is None or chosen is None:
        return []
    words = []
    for dst in _consumers(uses, chosen):
        words += _say(_steps(layout, dst, view) - _steps(chosen, dst, view), entry.what, view)
    if param is not None and not param.is_buffer:
        copies = {a for a in view.shown if isinstance(layout[a], Replicate) and view.sizes[a] > 1}
        synced = {a for a in param.grad_sync_axes if view.sizes[a] > 1}
        if copies - synced:
            words.append(f"gradient all-reduce over {view.axes(sorted(copies - synced))}")
        if synced - copies:
            words.append(f"no gradient all-reduce over {view.axes(sorted(synced - copies))}")
    held = _split(chosen, view) / _split(layout, view)
    if held != 1:
        what = "the parameter, its gradient and optimizer state" if param is not None else "the input"
        words.append(f"{held:g}x {what} per device" if held > 1 else f"1/{1 / held:g} of {what} per device")
    return words


def _consumers(dsts: list[Placements], chosen: Placements | None) -> list[Placements]:
    """The layouts a tensor's consumers take: the targets of its transfers, else the chosen layout."""
    return list(dict.fromkeys(dsts)) or ([chosen] if chosen is not None else [])


def _steps(src: Placements, dst: Placements, view: AxisView) -> set[tuple[str, int]]:
    """(collective, mesh axis) of each communicating step moving `src` to `dst`, as the cost model moves it."""
    dims = [p.dim for p in (*src, *dst) if isinstance(p, Shard)]
    meta = TensorMeta((math.prod(view.sizes),) * (max(dims, default=0) + 1), "float32")  # any shape the layouts divide
    try:
        steps = redistribution_steps(meta, src, dst, view.sizes)
    except InfeasibleRedistribution:  # such an alternative has no delta and no words
        return set()
    return {(s.kind.replace("_", "-"), s.axis) for s in steps if s.communicates}


def _say(steps: set[tuple[str, int]], what: str, view: AxisView) -> list[str]:
    """'all-gather of X on dp,tp', one phrase per kind of collective."""
    by_kind: dict[str, list[int]] = {}
    for kind, a in sorted(steps, key=lambda s: s[1]):
        by_kind.setdefault(kind, []).append(a)
    return [f"{kind} of {what} on {view.axes(axes)}" for kind, axes in by_kind.items()]


def _split(layout: Placements | None, view: AxisView) -> int:
    """Ways the work (or storage) of a tensor is divided: the sizes of the axes it is not replicated on."""
    return math.prod(view.sizes[a] for a, p in enumerate(layout or ()) if not isinstance(p, Replicate))
