"""Peak memory of a pipelined plan, stage by stage: the liveness walk of each stage under its schedule.

A pipeline rank runs its stages' programs once per microbatch. At its peak a stage holds:

- its parameters, their gradients, optimizer state and gradient buckets (the walk's resident state);
- the receive buffers torch's `PipelineStage` allocates once for every microbatch of the step and keeps: the
  stage's input (forward) and the gradient of its output (backward);
- the microbatch it is working on (the walk's own peak: forward, backward and the optimizer step), plus the
  tensors saved for backward by every other microbatch the schedule keeps in flight: `held - 1` times what one
  microbatch's forward leaves behind, where `held` is the schedule model's count (`schedules.in_flight`), the
  one the pipeline search prices its cuts with;
- the outputs it sends on, kept for their gradient's backward (torch's `fwd_cache`).

A rank running several chunks (interleaved schedules, ZB-V) holds all of them: its peak is their sum.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.cost_model.estimate import local_bytes
from meshplan.cost_model.peak import PeakMemory, predict_peak
from meshplan.cost_model.schedules import in_flight
from meshplan.ir.graph import Graph
from meshplan.ir.units import unit_of_nodes


def stage_nodes(graph: Graph, pipe) -> list[set[str]]:
    """Op names of each stage of `pipe` (a `PipelinePlan`), by the units its ops belong to (as the runtime cuts)."""
    unit = unit_of_nodes(graph)
    of_unit = {u: s.index for s in pipe.stages for u in s.units}
    out: list[set[str]] = [set() for _ in pipe.stages]
    for n in graph.nodes:
        if n.kind == "op":
            out[of_unit[unit[n.name]]].add(n.name)
    return out


def stage_peaks(graph: Graph, plan, *, optimizer: str = "adam") -> list[PeakMemory]:
    """Peak of every stage of `plan.pipeline` on one device of its sub-mesh (`plan.mesh`), in stage order."""
    pipe = plan.pipeline
    layout = {n.name: n.strategy.outputs for n in plan.nodes}
    groups = stage_nodes(graph, pipe)
    stage_of = {name: k for k, names in enumerate(groups) for name in names}
    crossing_in = [0] * len(groups)  # bytes per microbatch arriving at each stage (its receive buffers)
    crossing_out = [0] * len(groups)  # bytes of the gradients coming back for what each stage sends on
    sends: list[set[str]] = [set() for _ in groups]
    seen: set[tuple[str, int, int]] = set()
    for n in graph.nodes:
        if n.kind != "op":
            continue
        k = stage_of[n.name]
        for ref in n.inputs:
            src = stage_of.get(ref.node)  # None: a parameter or an input, not sent between stages
            if src is None or src == k or (ref.node, ref.index, k) in seen:
                continue
            seen.add((ref.node, ref.index, k))
            nbytes = local_bytes(graph.meta(ref), layout[ref.node][ref.index], plan.mesh.shape)  # sent as produced
            crossing_in[k] += nbytes
            sends[src].add(ref.node)
            if graph[ref.node].grad(ref.index):
                crossing_out[src] += nbytes
    p, m = pipe.degree, pipe.microbatches
    out = []
    for k, (stage, names, held_out) in enumerate(zip(pipe.stages, groups, sends)):
        walk = predict_peak(graph, plan, optimizer=optimizer, nodes=names, kept=held_out)
        held = in_flight(pipe.schedule, p, m, stage.device, virtual=pipe.chunks) if p > 1 else 1.0
        extra = (held - 1.0) * walk.saved + m * (crossing_in[k] + crossing_out[k])
        at_peak = replace(walk.at_peak, activations=int(walk.at_peak.activations + extra))
        out.append(replace(walk, peak=at_peak.total, at_peak=at_peak))
    return out


def with_stage_memory(graph: Graph, plan, *, optimizer: str = "adam"):
    """`plan` whose pipeline stages carry their walked peaks and whose `memory` is the fullest rank's."""
    peaks = stage_peaks(graph, plan, optimizer=optimizer)
    pipe = replace(plan.pipeline, stages=tuple(replace(s, memory=pk.at_peak) for s, pk in zip(plan.pipeline.stages, peaks)))
    return replace(plan, pipeline=pipe, memory=max(pipe.rank_memory(), key=lambda mb: mb.total))
