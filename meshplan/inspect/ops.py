"""`meshplan.list_ops(model, example_inputs)`: every op of the traced model with the source of its
sharding rule and its share of the model's FLOPs, so coverage is visible before planning.

Rule sources: `dtensor` (DTensor's registered op strategy), `meshplan` (meshplan's own rule, or a
factory op computed whole by design), `fallback` (no rule: runs replicated on every device).
`sharded` says whether any candidate splits the op's work; an op with a rule that only allows
replication has `sharded=False` though its source is not `fallback`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

from torch import nn

from meshplan.cost_model.compute import is_view
from meshplan.cost_model.model_flops import node_flops
from meshplan.ir.graph import Graph
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Replicate
from meshplan.ir.trace import trace
from meshplan.planner.strategies import UnsupportedOpWarning, generate
from meshplan.plans.strategy import Strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class OpInfo:
    """One op of the traced model."""

    node: str
    """IR node name."""
    target: str
    """The ATen op."""
    module_path: str
    """The user module that issued it ('' at top level)."""
    source: str
    """Where its sharding rules come from: dtensor, meshplan or fallback."""
    flops: float
    """Forward FLOPs on the whole (global) tensors."""
    share: float
    """flops / the model's forward FLOPs (0 when the model has none)."""
    sharded: bool
    """Some candidate strategy splits the op's work over a mesh axis."""
    candidates: int
    """Number of candidate strategies on the mesh listed for."""


@dataclass(frozen=True, slots=True)
class OpsReport:
    """Every op of a model on one mesh, in graph order."""

    model: str
    mesh: tuple[int, ...]
    ops: tuple[OpInfo, ...]

    @property
    def total_flops(self) -> float:
        return sum(o.flops for o in self.ops)

    def by_source(self) -> dict[str, tuple[int, float]]:
        """Source -> (number of ops, share of FLOPs)."""
        count: Counter = Counter()
        share: Counter = Counter()
        for o in self.ops:
            count[o.source] += 1
            share[o.source] += o.share
        return {s: (count[s], share[s]) for s in ("dtensor", "meshplan", "fallback") if count[s]}

    def fallbacks(self) -> list[OpInfo]:
        return [o for o in self.ops if o.source == "fallback"]

    def replicated_over(self, share: float) -> list[OpInfo]:
        """Ops above `share` of the FLOPs that cannot be split (no rule, or a replicate-only rule)."""
        return [o for o in self.ops if o.share > share and not o.sharded]

    def format(self, *, min_share: float = 0.0, views: bool = False) -> str:
        """A table: one line per op (views left out unless `views`), then the totals per source."""
        lines = [f"{self.model}: {len(self.ops)} ops on mesh {'x'.join(map(str, self.mesh))}, {self.total_flops:.3g} forward FLOPs"]
        lines.append(f"{'node':<28} {'op':<40} {'source':<9} {'FLOPs %':>8}  sharded  module")
        for o in self.ops:
            if o.share < min_share or (not views and is_view(o.target) and o.source != "fallback"):
                continue
            lines.append(
                f"{o.node:<28} {o.target:<40} {o.source:<9} {100 * o.share:>8.2f}  {'yes' if o.sharded else 'NO':<7}  {o.module_path or '<top>'}"
            )
        lines.append("by source: " + ", ".join(f"{s} {n} ops / {100 * f:.1f}% FLOPs" for s, (n, f) in self.by_source().items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _source(strategies: list[Strategy]) -> str:
    sources = {s.source for s in strategies}
    for s in ("fallback", "meshplan", "dtensor"):
        if s in sources:
            return s
    raise AssertionError(f"op strategies with unknown sources {sources}")


def _splits(s: Strategy) -> bool:
    return any(p is not None and any(not isinstance(x, Replicate) for x in p) for p in s.inputs + s.outputs)


def graph_ops(graph: Graph, mesh: MeshSpec, *, model: str = "model") -> OpsReport:
    """The report for an already traced graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedOpWarning)
        cands = generate(graph, mesh)
    rows = []
    for n in graph.nodes:
        if n.kind != "op":
            continue
        rows.append((n, node_flops(n, [graph.meta(r) for r in n.inputs]), cands.by_node[n.name]))
    total = sum(f for _, f, _ in rows)
    ops = tuple(
        OpInfo(
            node=n.name, target=n.target, module_path=n.module_path, source=_source(strategies), flops=f,
            share=f / total if total else 0.0, sharded=any(_splits(s) for s in strategies), candidates=len(strategies),
        )
        for n, f, strategies in rows
    )
    return OpsReport(model, mesh.shape, ops)


def list_ops(model: nn.Module, example_inputs: tuple = (), *, example_kwargs: dict | None = None, mesh_shape: tuple[int, ...] = (2,)) -> OpsReport:
    """Trace `model` and list every op with its rule source and FLOP share on a mesh of `mesh_shape`.

    Nothing runs and no devices are needed (meta or fake inputs are fine).
    """
    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be a tuple of positive ints such as (4,) or (2, 2), got {mesh_shape!r}")
    graph = trace(model, example_inputs, example_kwargs)
    return graph_ops(graph, MeshSpec(shape), model=type(model).__name__)
