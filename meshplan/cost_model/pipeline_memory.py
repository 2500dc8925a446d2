"""Peak memory of a pipelined plan, stage by stage: the liveness walk of each stage under its schedule.

A pipeline rank runs its stages' programs once per microbatch. At its peak a stage holds:

- its parameters, their gradients, optimizer state and gradient buckets (the walk's resident state);
- the receive buffers torch's `PipelineStage` allocates once for every microbatch of the step and keeps: the
  stage's input (forward) and the gradient of its output (backward);
- the microbatch it is working on (the walk's own peak: forward, backward and the optimizer step), plus the
  tensors saved for backward by every other microbatch the schedule keeps in flight: `held - 1` times what one
  microbatch's forward leaves behind, where `held` is the schedule model's count (`schedules.in_flight`), the
  one the pipeline search prices its cuts with (weights' bf16 working copies not among them: the stage casts once
  per step and its microbatches share them, `PeakMemory.saved`);
- the outputs it sends on, kept for their gradient's backward (torch's `fwd_cache`).

A rank running several chunks (interleaved schedules, ZB-V) holds all of them, but runs one at a time: its peak is
one chunk's peak with every other chunk idle (`PeakMemory.idle`: its parameters, their working copies and gradients,
optimizer state, the tensors its microbatches in flight saved and its receive buffers), or all of them in the
optimizer step (`PipelinePlan.rank_memory`). Summing the chunks' peaks stated a bf16 ZB-V rank of 2 gloo ranks at
34.2 MB where it held 31.6.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cost_model.estimate import local_bytes
from meshplan.cost_model.memory import MemoryBreakdown
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
    groups = stage_nodes(graph, plan.pipeline)
    return [under_schedule(stage_walk(graph, plan, groups, k, optimizer=optimizer), plan.pipeline, stage)
            for k, stage in enumerate(plan.pipeline.stages)]


@dataclass(frozen=True, slots=True)
class StageWalk:
    """One microbatch of a stage, before its schedule multiplies it."""

    walk: PeakMemory
    """The liveness walk of the stage's ops, its sends kept until backward."""
    received: int
    """Bytes per microbatch of its receive buffers: what it takes from other stages and the gradients of what it sends."""


def stage_walk(graph: Graph, plan, groups: list[set[str]], k: int, *, optimizer: str = "adam") -> StageWalk:
    """The walk of stage `k` of `plan`, whose stages' ops are `groups`."""
    layout = {n.name: n.strategy.outputs for n in plan.nodes}
    stage_of = {name: j for j, names in enumerate(groups) for name in names}
    received = 0
    sends: set[str] = set()
    seen: set[tuple[str, int, int]] = set()
    for n in graph.nodes:
        j = stage_of.get(n.name)
        if j is None:
            continue
        for ref in n.inputs:
            src = stage_of.get(ref.node)  # None: a parameter or an input, not sent between stages
            if src is None or src == j or k not in (src, j) or (ref.node, ref.index, j) in seen:
                continue
            seen.add((ref.node, ref.index, j))
            nbytes = local_bytes(graph.meta(ref), layout[ref.node][ref.index], plan.mesh.shape)  # sent as produced
            if j == k:
                received += nbytes
            else:  # stage k sends it, and receives its gradient back
                sends.add(ref.node)
                received += nbytes if graph[ref.node].grad(ref.index) else 0
    return StageWalk(predict_peak(graph, plan, optimizer=optimizer, nodes=groups[k], kept=sends), received)


def under_schedule(w: StageWalk, pipe, stage) -> PeakMemory:
    """The peak of `stage` of `pipe` (a `PipelinePlan`) from its walk: the receive buffers of every microbatch, held
    all step, and, while a microbatch runs forward or backward, the tensors saved by the other microbatches its
    schedule keeps in flight. A schedule that runs some forward after a backward (`held` < microbatches: 1F1B,
    interleaved, zero bubble) runs it with every parameter gradient held (`PeakMemory.accumulating`): the llama of
    benchmarks/memory_truth.py under 1F1B held 6.5 MiB on its first stage, which was stated 6.0 without them. A stage
    with weights' working copies (mixed precision) holds their gradients at the end of each microbatch's backward
    (`PeakMemory.casting_back`): a bf16 GPT stage of 2-layer width 256 under GPipe held 18.1 MB, stated 16.1 without
    them. No microbatch is in flight during the optimizer step."""
    p, m = pipe.degree, pipe.microbatches
    held = in_flight(pipe.schedule, p, m, stage.device, virtual=pipe.chunks) if p > 1 else 1.0
    others = int((held - 1.0) * w.walk.saved)
    phases = [(w.walk.microbatch_phase, w.walk.microbatch, others), ("optimizer", w.walk.step, 0)]
    if held < m:
        phases.append(("accumulating", w.walk.accumulating, others))
    if w.walk.casting_back is not None:  # after the first microbatch each cast's backward sums through a temporary
        phases.append(("casting back", w.walk.casting_back, others + (w.walk.cast_accumulate_bytes if m > 1 else 0)))
    phase, at, add = max(phases, key=lambda ph: ph[1].total + ph[2])
    at_peak = replace(at, activations=int(at.activations + add + m * w.received))
    return replace(w.walk, peak=at_peak.total, at_peak=at_peak, phase=phase,
                   idle=_idle(w, held, m) if pipe.chunks > 1 else None)  # a rank of one stage is never idle beside another


def _idle(w: StageWalk, held: float, m: int) -> MemoryBreakdown:
    """What a stage holds while another chunk of its rank runs: its working copies, its microbatches' saved tensors, and
    once its first backward has run (one microbatch fewer in flight) every parameter gradient. In the optimizer step,
    which steps a rank's chunks together one parameter at a time, its temporaries are the rank's largest parameter's,
    counted in the chunk at its peak: the others hold no more than after their last backward."""
    step = w.walk.step
    waiting = replace(step, params=step.params + w.walk.working_copy_bytes)
    before = replace(waiting, grads=w.walk.resident.grads, activations=int(held * w.walk.saved + m * w.received))
    after = replace(waiting, activations=int(min(held, m - 1) * w.walk.saved + m * w.received))
    return max(before, after, key=lambda mb: mb.total)


def with_stage_memory(graph: Graph, plan, *, optimizer: str = "adam"):
    """`plan` whose pipeline stages carry their walked peaks and whose `memory` is the fullest rank's."""
    peaks = stage_peaks(graph, plan, optimizer=optimizer)
    pipe = replace(plan.pipeline, stages=tuple(replace(s, memory=pk.at_peak, idle=pk.idle) for s, pk in zip(plan.pipeline.stages, peaks)))
    return replace(plan, pipeline=pipe, memory=max(pipe.rank_memory(), key=lambda mb: mb.total))
