"""Which candidates a plan in head-tail token order (`PlanOptions.token_order`) may take, and which only it may.

In such a plan every tensor split over the `cp` mesh axis is held as its place's two chunks of 2P
(runtime/token_order.py). Ops whose sharding rule keeps a dimension split compute each index of it on its own, or
sum over it, so they run on those blocks as on contiguous ones. What does not:

- a kernel that reads where its block lies (a masked lookup's offset into the vocabulary, the contiguous
  context-parallel kernels' causal mask), unless it is written for this order (`RegionOp.token_order`);
- buffers split over `cp` (a RoPE table is indexed by the sequence, which this order permutes; DTensor and
  checkpoints hold contiguous blocks). Parameters may be stored split over `cp` (FSDP over `cp`, as torchtitan
  shards them over dp x cp) in contiguous blocks, as DTensor, the optimizer and checkpoints hold them: they, and
  their working copies (mixed precision), are gathered over `cp` before any other op reads them, in the contiguous
  order (runtime/rewrite.py), so no op reads a parameter's block as a head-tail one;
- outputs handed over split over `cp` (`loss_only`'s DTensors), which a loss function would read as contiguous;
- a dimension that does not cut into 2P equal chunks where the `cp` axis splits it.

Those candidates are dropped, each with its reason for `explain`. Without token order the token-order kernels are
dropped instead. The order is the whole plan's: one kernel in either order would give wrong numbers in the other.
"""

from __future__ import annotations

import math

from meshplan.ir.graph import Graph, Node
from meshplan.ir.mesh import CP_AXIS, MeshSpec
from meshplan.ir.placement import Placements, Shard
from meshplan.ir.regions import region_op
from meshplan.plans.strategy import Strategy
from meshplan.planner.strategies import Candidates


def check_token_order(mesh: MeshSpec, *, inputs: str) -> None:
    """A ValueError for a token-order plan that cannot be one: no `cp` axis, or inputs passed in blocks (a rank's own
    slice, which the user would cut contiguously)."""
    if CP_AXIS not in mesh.axis_names:
        raise ValueError(f"token_order=True orders the splits of a mesh axis named {CP_AXIS!r}, and mesh {mesh} has axes "
                         f"{', '.join(map(repr, mesh.axis_names))}: name one {CP_AXIS!r} (e.g. axis_names=('dp', 'cp'))")
    if inputs != "global":
        raise ValueError(f"token_order=True takes whole inputs (inputs='global'); got inputs={inputs!r}: a rank's own slice "
                         "in head-tail order is not the contiguous one a user would pass")


def keep_order(graph: Graph, mesh: MeshSpec, cands: Candidates, token_order: bool) -> None:
    """Drop from `cands` what the plan's order rules out (the module doc), listing each in `cands.rejected`."""
    if CP_AXIS not in mesh.axis_names:
        return  # no cp axis: no kernel or block is ordered
    cp = mesh.axis_names.index(CP_AXIS)
    stored = graph.param_values if token_order else frozenset()
    fx_args = {n.name: n.args for n in graph.fx.gm.graph.nodes} if token_order and graph.fx is not None else {}
    # Repeated layers share their strategy objects (planner/strategies.py caches them) and shapes: what depends on
    # those alone is found once per object, not once per node and strategy (the 70B at 131k in token order: 1.2
    # million of those per call).
    splits_cp: dict[int, bool] = {}
    uneven: dict[tuple[int, tuple], tuple | None] = {}

    def uneven_split(s: Strategy, shapes: tuple) -> tuple | None:
        key = (id(s), shapes)
        if key not in uneven:
            uneven[key] = _uneven_split(shapes, (*s.inputs, *s.outputs), mesh.shape, cp)
        return uneven[key]

    for node in graph.nodes:
        region = region_op(node.target) if node.kind == "op" else None
        if region is None and not token_order:
            continue  # only a region op's kernel can need token order (a large model's planning passes here often)
        metas = [*(graph.meta(r) for r in node.inputs), *node.outputs]
        shapes = tuple(None if meta is None else meta.shape for meta in metas)
        kept = []
        for s in cands.by_node[node.name]:
            split = splits_cp.get(id(s))
            if split is None:
                split = splits_cp[id(s)] = any(layout is not None and isinstance(layout[cp], Shard)
                                               for layout in (*s.inputs, *s.outputs))
            reason = (None if token_order and not split  # nothing split over cp: no order to keep
                      else _ruled_out(node, region, s, shapes, uneven_split, mesh, cp, token_order, stored, fx_args.get(node.name)))
            if reason is None:
                kept.append(s)
            else:
                cands.rejected.setdefault(node.name, []).append((s, reason))
        if len(kept) < len(cands.by_node[node.name]):
            cands.by_node[node.name] = kept


def _ruled_out(node: Node, region, s: Strategy, shapes: tuple[tuple[int, ...] | None, ...], uneven_split, mesh: MeshSpec,
               cp: int, token_order: bool, stored: frozenset[str], args) -> str | None:
    """Why `s` is dropped, or None; in a token-order plan `s` splits a tensor over axis `cp`. `uneven_split(s, shapes)`:
    `_uneven_split` for the strategy's layouts."""
    ordered = bool(s.kernel) and region is not None and region.token_order(s)
    if not token_order:
        return f"{s.kernel} runs on head-tail token-order blocks: plan with token_order=True" if ordered else None
    if node.name in stored:
        return None  # contiguous blocks, gathered over cp before use (below): no order to keep
    kind = node.kind
    if kind == "buffer":
        return (f"token_order=True keeps buffers unsplit on mesh axis {CP_AXIS!r}: a sequence-indexed one (a RoPE table) "
                "would need the head-tail order, and DTensor and checkpoints hold contiguous blocks")
    for ref, layout in zip(node.inputs, s.inputs):
        if ref.node in stored and layout is not None and isinstance(layout[cp], Shard):
            return (f"token_order=True gathers parameters over mesh axis {CP_AXIS!r} before an op reads them: they are "
                    "stored in contiguous blocks, which this op would read as head-tail ones")
    if kind == "output":
        return (f"token_order=True hands outputs over unsplit on mesh axis {CP_AXIS!r} (a loss function would read a "
                "head-tail block as a contiguous one)")
    if s.kernel and not ordered and (args is None or region.reads_block_positions(s, args, cp)):
        return f"{s.kernel} reads contiguous blocks on mesh axis {CP_AXIS!r}, and token_order=True holds them in head-tail order"
    uneven = uneven_split(s, shapes)
    if uneven is not None:
        shape, layout = uneven
        return (f"dim {layout[cp].dim} of a {list(shape)} tensor does not cut into 2 x {mesh.shape[cp]} equal chunks where "
                f"mesh axis {CP_AXIS!r} splits it, as head-tail token order needs")
    return None


def _uneven_split(shapes: tuple, layouts: tuple, mesh_shape: tuple[int, ...], cp: int) -> tuple | None:
    """The first (shape, layout) of a strategy whose split over axis `cp` does not halve evenly, or None."""
    for shape, layout in zip(shapes, layouts):
        if shape is not None and layout is not None and not halves_evenly(shape, layout, mesh_shape, cp):
            return shape, layout
    return None


def halves_evenly(shape: tuple[int, ...], layout: Placements, mesh_shape: tuple[int, ...], cp: int) -> bool:
    """Whether the dimension `layout` splits over axis `cp` (if any) is, where that axis splits it (after the outer
    axes that split it too), a multiple of 2 x the axis' size."""
    p = layout[cp]
    if not isinstance(p, Shard):
        return True
    outer = math.prod(mesh_shape[a] for a in range(cp) if layout[a] == p)
    return (shape[p.dim] // outer) % (2 * mesh_shape[cp]) == 0
