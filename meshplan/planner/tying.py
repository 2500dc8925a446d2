"""Solve repeated layers once: corresponding nodes of identical layers share one strategy variable.

A 32-layer transformer is the same block 32 times. Tying the i-th node of every `layers.k` to one
class shrinks the MIP about 32-fold, and it stays exact for the reduced problem: every graph edge
is still priced, as an edge between the two classes it joins, counted as often as it occurs
(an edge whose two ends fall in one class becomes a term of that class's own cost). A node is tied
only to nodes with the same op, shapes and candidate list, so the class's costs are its members'.

This is the reduction nnScaler and Alpa make for repeated blocks; the plan it yields gives every
layer of a group the same layouts (the first and last layers still meet the embedding and head
through their own edges).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass

from meshplan.ir.graph import Graph, Node
from meshplan.plans.strategy import Strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Tying:
    """Which node speaks for which: `rep[node]` is its class representative (itself when untied)."""

    rep: dict[str, str]
    count: dict[str, int]
    """Representative -> members in its class (1 for untied nodes)."""
    layers: dict[str, int]
    """Tied group (`layers.*`) -> number of layers solved as one."""

    @property
    def classes(self) -> int:
        return len(self.count)


def tie_repeated_layers(graph: Graph, by_node: dict[str, list[Strategy]], *, enabled: bool = True) -> Tying:
    rep = {n.name: n.name for n in graph.nodes}
    layers: dict[str, int] = {}
    if enabled:
        members: dict[str, list[Node]] = {}
        for n in graph.nodes:
            if n.layer is not None:
                members.setdefault(n.layer, []).append(n)
        for pattern, names in graph.layer_groups().items():
            if len(names) < 2:
                continue
            first = members[names[0]]
            tied = 0
            for other in (members[k] for k in names[1:]):
                for head, n in _aligned(graph, first, other):
                    if _same(graph, head, n) and by_node[head.name] == by_node[n.name]:
                        rep[n.name] = head.name
                        tied += 1
            if tied:
                layers[pattern] = len(names)
                untied = sum(len(members[k]) for k in names[1:]) - tied
                if untied:
                    log.info("%s: %d nodes differ between layers and are solved separately", pattern, untied)
    count: dict[str, int] = {}
    for r in rep.values():
        count[r] = count.get(r, 0) + 1
    return Tying(rep, count, layers)


def _aligned(graph: Graph, first: list[Node], other: list[Node]) -> list[tuple[Node, Node]]:
    """Pairs of corresponding nodes of two layers. Position by position when the layers are alike;
    otherwise the longest matching runs of (op, shapes), so a layer that computes something extra (T5's
    first block computes the relative position bias the others reuse) still ties its common part."""
    def sig(n: Node) -> tuple:
        return (n.kind, n.target if n.kind == "op" else "", n.outputs, tuple(graph.meta(r) for r in n.inputs))

    a, b = [sig(n) for n in first], [sig(n) for n in other]
    if a == b:
        return list(zip(first, other))
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(first[i + k], other[j + k]) for i, j, size in matcher.get_matching_blocks() for k in range(size)]


def _same(graph: Graph, a: Node, b: Node) -> bool:
    """Same op on the same shapes with the same gradient flow: the same costs under every strategy."""
    return (
        a.kind == b.kind
        and (a.target == b.target or a.kind in ("param", "buffer", "input", "constant"))  # a leaf's target is its name
        and a.outputs == b.outputs
        and a.requires_grad == b.requires_grad
        and [graph.meta(r) for r in a.inputs] == [graph.meta(r) for r in b.inputs]
    )
