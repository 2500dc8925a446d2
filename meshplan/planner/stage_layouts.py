"""The layouts a searched pipeline configuration was priced with, for its runtime plan on the stage sub-mesh.

The pipeline search prices a configuration (t, p, d, b) from the plan of one data-parallel replica's stage on
its tensor-parallel width `(t,)` at microbatch b, with data parallelism over d outside it (Megatron's
arrangement). The runtime runs one plan of the whole model on the sub-mesh `(d, t)` at microbatch d b. Solving
that plan freely answers a different question (and, under a memory budget, a much harder MIP: Llama-3-70B's timed
out at 60 s), so the runtime plan starts from the priced one: every parameter and buffer keeps its `(t,)` layout
and is replicated over d, and every input with the microbatch as its first dim is split over d. The solver then
places the activations one mesh axis at a time (`carried_layouts`), and the result is walked and priced like any
plan: first the data-parallel axis, every op of the repeated layers keeping its `(t,)` layouts on the tensor-parallel
one (the embeddings and the head are left free on both: the runtime's global outputs gather there over d, which one
replica on (t,) never does); then the tensor-parallel axis, every op keeping the data-parallel layouts found. Each
solve is small, since the tables of a 2-D mesh are mostly the moves between its layouts: Llama-3-70B's stage plan on
(8, 8) took a third of the time of one solve over both axes, with the same step to the last digit. The second solve
is never slower than the first, and finds what the layouts of a one-replica profile cost on the 2-D mesh (Llama-3-8B
on (8, 4): the profile's sequence-parallel output projection reshards a tensor sharded over d and t dearer than on
(t,) alone; the first solve priced that stage plan 1.7 % slower, the second as the solve over both axes).
"""

from __future__ import annotations

import difflib

from torch.distributed.tensor import Replicate, Shard

from meshplan.ir.graph import Graph, Node
from meshplan.ir.placement import Placements
from meshplan.ir.units import POST, PRE, unit_of_nodes
from meshplan.planner.annotations import show
from meshplan.planner.constraints import Constraint
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


def carried_layouts(graph: Graph, source_graph: Graph, source: Plan, *, axes: tuple[int | None, ...], why: str,
                    stand_in: str | None = None, stack: str | None = None, layers_only: bool = False) -> tuple[Constraint, ...]:
    """Every op of `graph` keeps the layouts its counterpart in `source_graph` has in `source` (each tensor it reads and
    writes), on the mesh axes `axes` names: axis a of `graph`'s mesh keeps the placement on `source`'s mesh axis
    `axes[a]`, or is left to the solver where that is None. Counterparts are found unit by unit (`pre`, each block,
    `post`; every block of `stack` stands for `stand_in` when `source_graph` is the model cut to a few blocks), op by op
    along the longest runs of the same op on tensors of the same ranks, so an op one trace has and the other does not
    (a batch of 1 expands less) is left free; `layers_only` leaves `pre` and `post` free. `why` names the reason in
    `Plan.explain`."""
    strategy = {n.name: n.strategy for n in source.nodes}
    theirs = _ops_by_unit(source_graph)
    out = []
    for unit, ops in _ops_by_unit(graph).items():
        if layers_only and unit in (PRE, POST):
            continue
        counterpart = stand_in if stand_in is not None and stack is not None and unit.startswith(stack + ".") else unit
        for mine, their in _aligned(graph, ops, source_graph, theirs.get(counterpart, [])):
            s = strategy[their.name]
            for slot, layouts in (("in", s.inputs), ("out", s.outputs)):
                for i, layout in enumerate(layouts):
                    if layout is None:
                        continue
                    want = tuple(None if a is None else layout[a] for a in axes)
                    what = f"{'input' if slot == 'in' else 'output'} {i} of {mine.target} ({mine.name}) at {mine.module_path or '<top>'}"
                    out.append(Constraint(mine.name, slot, i, want, what, f"{why}: {show(want)}"))
    return tuple(out)


def _ops_by_unit(graph: Graph) -> dict[str, list[Node]]:
    unit = unit_of_nodes(graph)
    out: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.kind == "op":
            out.setdefault(unit[n.name], []).append(n)
    return out


def _aligned(graph: Graph, mine: list[Node], profiled: Graph, theirs: list[Node]) -> list[tuple[Node, Node]]:
    def sig(g: Graph, n: Node) -> tuple:
        return n.target, tuple(None if m is None else len(m.shape) for m in n.outputs), tuple(len(g.meta(r).shape) for r in n.inputs)

    a, b = [sig(graph, n) for n in mine], [sig(profiled, n) for n in theirs]
    if a == b:
        return list(zip(mine, theirs))
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(mine[i + k], theirs[j + k]) for i, j, size in matcher.get_matching_blocks() for k in range(size)]
