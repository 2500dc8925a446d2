"""IR invariants, checked after tracing (and after any pass that rewrites a graph)."""

from __future__ import annotations

from meshplan.ir.graph import Graph


def verify(graph: Graph) -> None:
    """Raise AssertionError naming the first broken invariant (raised explicitly: `python -O` keeps these checks)."""
    seen: set[str] = set()
    for i, n in enumerate(graph.nodes):
        if n.name in seen:
            raise AssertionError(f"node name {n.name} appears twice")
        for ref in n.inputs:
            if ref.node not in seen:
                raise AssertionError(f"{n.name} reads {ref} before it is produced (nodes must be in topological order)")
            producer = graph[ref.node]
            if not (0 <= ref.index < len(producer.outputs)):
                raise AssertionError(f"{n.name} reads output {ref.index} of {producer.name}, which has {len(producer.outputs)}")
            if producer.outputs[ref.index] is None:
                raise AssertionError(f"{n.name} reads non-tensor output {ref}")
        if n.kind in ("param", "buffer"):
            if not n.fqns:
                raise AssertionError(f"{n.kind} {n.name} has no FQN")
        if n.kind == "output":
            if i != len(graph.nodes) - 1:
                raise AssertionError("the output node must be last")
        else:
            if not (n.requires_grad == () or len(n.requires_grad) == len(n.outputs)):
                raise AssertionError(f"{n.name}: requires_grad does not match outputs")
        seen.add(n.name)
    if not (graph.nodes and graph.nodes[-1].kind == "output"):
        raise AssertionError("graph has no output node")
    fqns = [f for n in graph.nodes for f in n.fqns]
    if len(fqns) != len(set(fqns)):
        raise AssertionError("an FQN names two parameter nodes (tied weights must be one node)")
