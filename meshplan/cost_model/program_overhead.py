"""The in-program overhead per op run of a graph's program, read at the size of its ops.

A one-device program runs slower than the sum of its ops timed one at a time (`Profile.node_overhead_s`: autograd's
engine, Python between ops, caches), and the excess per op run grows with the ops: 5.5, 13.9 and 23.8 us per op run
for the fidelity GPT at widths 64, 128 and 256 (175 runs each, docs/cost_model.md). A profile made from several
models keeps each program's point (`Profile.program_overheads`: its ops' mean isolated seconds per run, its overhead
per run), and a graph is priced at the overhead interpolated at its own ops' mean, so no model pays another's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from meshplan.cost_model.estimate import measured_seconds
from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.profile import OpTiming, op_key
from meshplan.ir.graph import Graph


def op_runs(graph: Graph, ops: Mapping[str, OpTiming]) -> tuple[list[tuple[float, int]], list[str]]:
    """(isolated seconds and runs of each timed op of `graph`'s one-device program, the op nodes without a timing).
    An op runs once, twice where gradients flow (its backward node), as the planner prices it."""
    found, missing = [], []
    for node in graph.nodes:
        if node.kind != "op":
            continue
        t = ops.get(op_key(node.target, [graph.meta(r) for r in node.inputs], node.outputs))
        if t is None:
            missing.append(node.name)
            continue
        backward = any(node.requires_grad)
        found.append((measured_seconds(t, backward), 2 if backward else 1))
    return found, missing


def mean_op_run_s(runs: Sequence[tuple[float, int]]) -> float:
    """Isolated seconds per op run of a program (`op_runs`)."""
    return sum(s for s, _ in runs) / max(sum(r for _, r in runs), 1)


def interpolated(points: Sequence[tuple[float, float]], x: float) -> float:
    """The piecewise-linear curve through `points` (x, y) at `x`, flat beyond the first and last."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


_DERIVED: dict[tuple[int, float], tuple[ClusterPreset, ClusterPreset]] = {}
"""(id of a cluster, overhead) -> (that cluster, kept alive so the id stays its own; the cluster at that overhead):
one object per figure, so the planner's caches, kept per cluster object, serve every plan of the graph."""


def for_program(cluster: ClusterPreset, graph: Graph) -> ClusterPreset:
    """`cluster` with its profile's in-program overhead read at `graph`'s op size (`interpolated` over the profile's
    `program_overheads`); `cluster` itself when its profile measured fewer than two programs or times none of the
    graph's ops on one device."""
    prof = cluster.profile
    if prof is None or len(prof.program_overheads) < 2:
        return cluster
    runs, _ = op_runs(graph, prof.ops)
    if not runs:
        return cluster
    figure = interpolated(prof.program_overheads, mean_op_run_s(runs))
    if figure == prof.node_overhead_s:
        return cluster
    key = (id(cluster), figure)
    if key not in _DERIVED:
        if len(_DERIVED) > 64:
            _DERIVED.clear()
        _DERIVED[key] = (cluster, cluster.with_profile(dataclasses.replace(prof, node_overhead_s=figure)))
    return _DERIVED[key][1]
