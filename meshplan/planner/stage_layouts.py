"""The layouts a searched pipeline configuration was priced with, for its runtime plan on the stage sub-mesh.

The pipeline search prices a configuration (t, p, d, b) from the plan of one data-parallel replica's stage on
its tensor-parallel width `(t,)` at microbatch b, with data parallelism over d outside it (Megatron's
arrangement). The runtime runs one plan of the whole model on the sub-mesh `(d, t)` at microbatch d b. Solving
that plan freely answers a different question (and, under a memory budget, a much harder MIP: Llama-3-70B's timed
out at 60 s), so the runtime plan starts from the priced one: every parameter and buffer keeps its `(t,)` layout
and is replicated over d, every input with the microbatch as its first dim is split over d. The solver then only
places the activations, and the result is walked and priced like any plan.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from meshplan.ir.graph import Graph
from meshplan.ir.placement import Placements
from meshplan.plans.plan import Plan


def arranged_layouts(graph: Graph, profile: Plan, *, data: int, stand_in: str | None = None,
                     stack: str | None = None) -> tuple[dict[str, Placements], dict[str, Placements]]:
    """(parameter layouts by FQN, input layouts by name) of `graph` (the model at microbatch d b) on the mesh (d, t),
    from `profile`, the model's plan on (t,) at microbatch b. With a profile of the model cut to a few blocks of
    `stack`, every block of the stack takes the layouts of block `stand_in` (the block the profile stretches to all
    of them)."""
    by_fqn = {f: p.layout for p in profile.params for f in p.fqns}

    def outer(layout: Placements, outer_axis) -> Placements:
        """The layout on the stage mesh: (d, t), or (d,) alone when t = 1 (the profile's mesh (1,) is no axis of it)."""
        if data == 1:
            return layout
        return (outer_axis, *layout) if profile.mesh.size > 1 else (outer_axis,)

    params: dict[str, Placements] = {}
    for node in graph.nodes:
        if node.kind not in ("param", "buffer"):
            continue
        for fqn in node.fqns:
            source = fqn
            if stand_in is not None and stack is not None and fqn.startswith(stack + "."):
                block = node.layer  # `model.layers.17` for `model.layers.17.mlp.up_proj.weight`
                source = stand_in + fqn[len(block):] if block and fqn.startswith(block + ".") else fqn
            if source not in by_fqn:
                raise ValueError(f"the stage profile has no layout for {fqn!r} (looked up as {source!r})")
            params[fqn] = outer(by_fqn[source], Replicate())
    batch = {i.name: i for i in profile.inputs}
    inputs: dict[str, Placements] = {}
    for name in graph.input_names:
        if name not in batch:
            continue
        shape = tuple(graph[name].out.shape)
        split = bool(shape) and bool(batch[name].shape) and shape[0] == batch[name].shape[0] * data  # a microbatch of d b
        inputs[name] = outer(batch[name].layout, Shard(0) if split else Replicate())
    return params, inputs
