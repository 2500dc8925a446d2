"""Record, after the solve, the alternatives each node had and what ruled others out (`plans/alternatives.py`
says what is kept and why)."""

from __future__ import annotations

import math
from collections.abc import Callable

from meshplan.cost_model.memory import format_bytes
from meshplan.ir.graph import Graph, Node, TensorRef
from meshplan.ir.placement import Placements
from meshplan.plans.alternatives import MAX_LISTED, SIGNIFICANT_COMPUTE, Alternative, NodeAlternatives, RuledOut
from meshplan.plans.strategy import Strategy


def record_alternatives(
    graph: Graph, cands, before_constraints: dict[str, list[Strategy]], annotated: dict[str, list[Strategy]], choice: dict[str, int],
    constraints: list, *, own_cost: Callable[[str, int], float],
    move_cost: Callable[[TensorRef, Node, Placements, Placements], float | None],
    memory: Callable[[Node, Strategy], float], memory_budget: float | None,
) -> tuple[NodeAlternatives, ...]:
    """What `explain` needs, for the nodes worth explaining (see the module docstring).

    `choice[node]` indexes `cands.by_node[node]` (the candidates the solve saw: `annotated[node]`, the candidates left
    after `constraints`, the annotations bound to the graph, or a neighbourhood's part of them; `before_constraints`
    holds them all, and those not in `annotated` are listed as ruled out by the annotations). The planner passes its
    own pricing, so deltas are priced exactly as the search priced them: `own_cost(node, i)` is the
    node's own seconds under candidate `i` (compute, or gradient sync), `move_cost(ref, consumer,
    src, dst)` the seconds to move tensor `ref` to `consumer` (None when impossible) and
    `memory(node, strategy)` the bytes per device the node holds under that strategy.
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
    sources: dict[str, list[str]] = {}
    for c in constraints:
        sources.setdefault(c.node, []).append(c.source)
    # repeated layers' nodes hold the same candidate objects: what depends only on those is worked out once (a
    # whole-model stage plan of Llama-3-70B explains 2,577 nodes; hashing and printing their candidates was most of it)
    by_annotations: dict[tuple, tuple[list[Strategy], list[Strategy]]] = {}  # ids -> (the lists, held; the ruled out)
    names: dict[int, str] = {}  # id -> str of a candidate, every one held by the lists above or the graph's

    def name(s: Strategy) -> str:
        found = names.get(id(s))
        if found is None:
            found = names[id(s)] = str(s)
        return found

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
        why = "annotation: " + "; ".join(dict.fromkeys(sources.get(node.name, ["a constraint on a neighbouring op"])))
        before, left = before_constraints[node.name], annotated[node.name]
        key = (tuple(map(id, before)), tuple(map(id, left)))
        if key not in by_annotations:
            held = set(left)  # a list's `in` made this quadratic: 20 s for Llama-3-70B's stage plan on (4, 4, 8)
            by_annotations[key] = (before, left), [s for s in before if s not in held]
        ruled: list[RuledOut] = [RuledOut(s, why) for s in by_annotations[key][1]]
        for i, s in enumerate(kept):
            if i == mine:
                continue
            need = memory(node, s)
            if memory_budget is not None and need > memory_budget:
                ruled.append(RuledOut(s, f"memory: needs {format_bytes(need)} per device on its own, over the budget of {format_bytes(memory_budget)}"))
                continue
            c = local_cost(node, s, i)
            alts.append(Alternative(s, None if math.isinf(c) else c - chosen_cost))
        rejected = cands.rejected.get(node.name)
        if rejected:
            seen = {name(r.strategy) for r in ruled}
            for s, reason in rejected:
                if name(s) not in seen:
                    seen.add(name(s))
                    ruled.append(RuledOut(s, reason))
        alts.sort(key=lambda a: (a.delta_s is None, a.delta_s or 0.0, name(a.strategy)))
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
