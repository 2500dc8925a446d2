"""`meshplan.plan_code(plan, model, example_inputs, rank)`: the program one rank runs, as Python.

The runtime rewrites the traced ATen graph per rank (`runtime.rewrite.local_program`): local ops
with rank-local shapes, and a `move_N` submodule in front of every op whose input must change
layout. Here that program is printed with each `move_N` call annotated by the collectives it runs
(forward, and the dual ones autograd runs in backward), preceded by a header naming the rank's mesh
coordinate, its parameter shards, and the gradient all-reduces that run after backward.
"""

from __future__ import annotations

import re

from torch import nn

from meshplan.ir.graph import Graph
from meshplan.ir.placement import fmt, local_shape
from meshplan.ir.trace import trace
from meshplan.plans.plan import Plan
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.rewrite import local_program


def plan_code(
    plan: Plan, model: nn.Module | None = None, example_inputs: tuple = (), *, rank: int = 0,
    example_kwargs: dict | None = None, graph: Graph | None = None,
) -> str:
    """Readable code of the program `rank` runs under `plan`, with its collectives visible.

    Give the model and the example inputs it was planned with (the plan file holds no program), or
    the `ir.Graph` traced from them. Nothing runs and no process group is needed.
    """
    if graph is None:
        if model is None:
            raise ValueError("plan_code needs the model and example inputs the plan was made for (or graph=ir.Graph)")
        graph = trace(model, example_inputs, example_kwargs, precision=plan.precision)
    if graph.fingerprint() != plan.graph_fingerprint:
        raise ValueError(
            f"the plan was made for graph {plan.graph_fingerprint} but this model traces to {graph.fingerprint()}: "
            "pass the model and example inputs the plan was made for"
        )
    if not isinstance(rank, int) or not 0 <= rank < plan.mesh.size:
        raise ValueError(f"rank={rank!r} is not a rank of mesh {plan.mesh}; allowed: 0..{plan.mesh.size - 1}")
    comm = MeshComm(plan.mesh, rank)
    gm = local_program(graph, plan, comm)
    moves = {name: m for name, m in gm.named_children()}
    names = plan.mesh.axis_names

    def axis_names(text: str) -> str:
        return re.sub(r"ax(\d+)", lambda m: names[int(m.group(1))], text)

    layouts = {(str(t.tensor), t.forward): f"{fmt(t.src)}->{fmt(t.dst)}" for t in plan.transfers}
    body = []
    for line in gm.code.strip().splitlines():
        m = re.search(r"self\.(move_\d+)\(", line)
        if m:
            mod = moves[m.group(1)]
            tensor = mod.what.split(" ", 1)[0]
            fwd = " -> ".join(axis_names(str(s)) for s in mod.steps)
            bwd = " -> ".join(axis_names(str(s.dual())) for s in reversed(mod.steps))
            line += f"  # {tensor} {layouts.get((tensor, mod.steps), '')}: {fwd}  (backward: {bwd})"
        body.append(line.rstrip())

    coord = ", ".join(f"{a}={c}" for a, c in zip(names, comm.coord))
    head = [f"# meshplan plan {plan.hash()} for {plan.model}: rank {rank} of mesh {plan.mesh} at ({coord})"]
    head.append("# parameters on this rank (local shard shapes):")
    for p in plan.params:
        head.append(f"#   {' = '.join(p.fqns)}: {fmt(p.layout)} {list(local_shape(p.shape, p.layout, plan.mesh.shape))} of {list(p.shape)}")
    fqns = {p.node: " = ".join(p.fqns) for p in plan.params}
    head.append("# after backward, the gradients are summed over their replicated axes in these bucketed all-reduces:")
    head += [
        f"#   all_reduce({','.join(names[a] for a in b.axes)}) of {b.nbytes} bytes: {', '.join(fqns[n] for n in b.params)}"
        for b in plan.buckets
    ] or ["#   (none)"]
    head.append("# move_N(...) calls run the collectives named in their comment; outputs are scaled by 1/devices in backward")
    return "\n".join(head + body)
