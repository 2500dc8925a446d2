"""IR invariants, checked after tracing (and after any pass that rewrites a graph)."""

from __future__ import annotations

from meshplan.ir.graph import Graph


def verify(graph: Graph) -> None:
    """Raise AssertionError naming the first broken invariant."""
    seen: set[str] = set()
    for i, n in enumerate(graph.nodes):
        assert n.name not in seen, f"node name {n.name} appears twice"
        for ref in n.inputs:
            assert ref.node in seen, f"{n.name} reads {ref} before it is produced (nodes must be in topological order)"
            producer = graph[ref.node]
            assert 0 <= ref.index < len(producer.outputs), f"{n.name} reads output {ref.index} of {producer.name}, which has {len(producer.outputs)}"
            assert producer.outputs[ref.index] is not None, f"{n.name} reads non-tensor output {ref}"
        if n.kind in ("param", "buffer"):
            assert n.fqns, f"{n.kind} {n.name} has no FQN"
        if n.kind == "output":
            assert i == len(graph.nodes) - 1, "the output node must be last"
        else:
            assert n.requires_grad == () or len(n.requires_grad) == len(n.outputs), f"{n.name}: requires_grad does not match outputs"
        seen.add(n.name)
    assert graph.nodes and graph.nodes[-1].kind == "output", "graph has no output node"
    fqns = [f for n in graph.nodes for f in n.fqns]
    assert len(fqns) == len(set(fqns)), "an FQN names two parameter nodes (tied weights must be one node)"
