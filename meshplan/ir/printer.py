"""Readable text form of an IR graph: one line per node, repeated layers marked."""

from __future__ import annotations

from meshplan.ir.graph import Graph


def format_graph(graph: Graph, *, max_nodes: int | None = None) -> str:
    lines = [f"graph: {len(graph)} nodes, repeated layers: " + (", ".join(f"{k} x{len(v)}" for k, v in graph.layer_groups().items()) or "none")]
    for n in graph.nodes[: max_nodes or len(graph.nodes)]:
        outs = ", ".join("-" if m is None else str(m) for m in n.outputs)
        ins = ", ".join(str(r) for r in n.inputs)
        what = " = ".join(n.fqns) if n.fqns else n.target
        where = f"  # {n.module_path}" if n.module_path else ""
        lines.append(f"{n.name:<28} {n.kind:<8} {what}({ins}) -> {outs}{where}")
    if max_nodes is not None and len(graph.nodes) > max_nodes:
        lines.append(f"... {len(graph.nodes) - max_nodes} more")
    return "\n".join(lines)
