"""A graph's units, the pieces pipeline stages are cut from: everything before the first repeated layer
("pre": embeddings), each repeated layer (`layers.k`), everything after the last ("post": final norm, head)."""

from __future__ import annotations

from meshplan.ir.graph import Graph

PRE, POST = "pre", "post"


def unit_of_nodes(graph: Graph) -> dict[str, str]:
    """Op, input and output node -> unit name; parameters are placed by their consumers.

    An op outside every layer that runs between two of them (a functional activation between the
    `nn.Linear`s of a `ModuleList`) belongs to the layer before it, so units stay in program order."""
    order = [n for n in graph.nodes if n.kind in ("op", "input", "output", "constant")]
    # ops after the last layer are `post`; with no layers at all everything is `pre`
    last = max((i for i, n in enumerate(order) if n.layer is not None), default=len(order))
    out = {}
    current = PRE
    for i, n in enumerate(order):
        if n.layer is not None:
            current = n.layer
        out[n.name] = current if i <= last else POST
    return out


def unit_names(graph: Graph) -> list[str]:
    units = unit_of_nodes(graph)
    names = list(dict.fromkeys(units.values()))
    return [PRE, *[n for n in names if n not in (PRE, POST)], POST]
