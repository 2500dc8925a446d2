"""The op runs of a graph's one-device program and their isolated seconds, as the in-program overhead is measured.

A one-device program runs slower than the sum of its ops timed one at a time (`Profile.node_overhead_s`: autograd's
engine, Python between ops, allocator and cache state), and the excess per op run grows with the ops: 5.5, 13.9 and
23.8 us per op run for the fidelity GPT at widths 64, 128 and 256 (175 runs each, docs/cost_model.md), and for one
model with its batch. A profile keeps each program's point (`Profile.program_overheads`: its ops' mean isolated
seconds per run, its overhead per run) and prices an op run by the line through them (`Profile.overhead_line`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshplan.cost_model.estimate import measured_seconds
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
