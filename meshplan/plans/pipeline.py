"""The pipeline section of a Plan: stages, schedule, microbatches and what they are predicted to cost.

A plan with a pipeline runs `degree` copies of the intra-op plan's mesh (`Plan.mesh`, the stage
sub-mesh) one after the other: the world is `degree` x `Plan.mesh.size` devices, pipeline axis
outermost (stage s owns ranks s * mesh.size .. (s + 1) * mesh.size - 1), so a stage's own
collectives stay on the fast inner links and only the point-to-point sends cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cost_model.memory import MemoryBreakdown, format_bytes
from meshplan.cost_model.schedules import rank_shares
from meshplan.cost_model.timeline import Timeline, timeline


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStage:
    """One stage: a contiguous run of units (`pre`, `layers.k`, `post`) on one device's share."""

    index: int
    """Virtual stage index (equal to the device index unless the schedule interleaves chunks)."""
    device: int
    """Pipeline rank that runs it."""
    units: tuple[str, ...]
    """Units in order: `pre` (embeddings), `layers.k`, `post` (final norm, head)."""
    modules: tuple[str, ...]
    """Module paths the runtime cuts at: every op whose module path starts with one of these."""
    time_s: float
    """Forward + backward seconds per microbatch (with recomputation and the sends at its cut)."""
    recompute: bool
    """Activations of its layers are recomputed in backward (only each layer's input is kept)."""
    memory: MemoryBreakdown
    """Predicted peak per device of this stage under the schedule (activations of the in-flight microbatches)."""
    idle: MemoryBreakdown | None = None
    """The most it holds while its rank runs another of its stages (`PeakMemory.idle`); None: `memory`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    degree: int
    """p: pipeline ranks."""
    schedule: str
    """One of `meshplan.cost_model.schedule_kinds.SCHEDULES`."""
    microbatches: int
    """m: microbatches per step (the batch is split along dim 0)."""
    chunks: int
    """v: stages per pipeline rank (1, or more for interleaved / ZB-V schedules)."""
    stages: tuple[PipelineStage, ...]
    """degree x chunks stages in pipeline order."""
    step_s: float
    """Predicted step seconds: the schedule's step plus the slowest rank's gradient all-reduce."""
    bubble_s: float
    """Idle seconds per step the schedule leaves on a rank."""
    bubble_fraction: float
    """bubble_s / schedule step: (p-1)/(m+p-1) for GPipe and 1F1B with balanced stages."""
    p2p_s: float
    """Seconds per microbatch one cut's send (forward) and its gradient's (backward) take."""
    pinned: tuple[tuple[str, int], ...] = ()
    """Stages the user fixed (`stage_config` / `pipeline_stage`): module path -> stage index."""
    searched_step_s: float | None = None
    """The step the search priced this configuration at from its stage profiles, before its stage plan was solved;
    `step_s` is the stage plan's own price (None: not searched, or priced only)."""

    def rank_memory(self) -> list[MemoryBreakdown]:
        """Each pipeline rank's peak: a rank runs one of its stages (chunks) at a time, so the fullest of them at its peak
        with the others idle (or all in the optimizer step, which `idle` covers); the math libraries' workspace once (one
        process's)."""
        per_rank = []
        for k in range(self.degree):
            mine = [s for s in self.stages if s.device == k]
            idle = [s.memory if s.idle is None else s.idle for s in mine]
            held = max((sum((b for j, b in enumerate(idle) if j != i), s.memory) for i, s in enumerate(mine)), key=lambda mb: mb.total)
            per_rank.append(replace(held, workspace=max(s.memory.workspace for s in mine)))
        return per_rank

    @property
    def peak_memory(self) -> int:
        """The fullest pipeline rank's peak."""
        return max(m.total for m in self.rank_memory())

    def timeline(self) -> Timeline:
        """The schedule this plan is priced with, rank by rank: every rank runs its seconds per microbatch (the sum
        of its stages' `time_s`) split into equal forward, backward and weight thirds, and each cut's send is drawn
        as `p2p_s / 2` (one direction) at the end of the block that sends. Its makespan is the schedule's share of
        `step_s` (`step_s` adds the gradient all-reduce, and on ranks sharing a CPU's cores their contention)."""
        per_rank = [0.0] * self.degree
        for s in self.stages:  # summed in stage order, as the planner does
            per_rank[s.device] += s.time_s
        schedule = self.schedule if self.degree > 1 else "1f1b"
        return timeline(schedule, self.degree, self.microbatches, max(per_rank) / 3.0, virtual=max(self.chunks, 2),
                        send_s=self.p2p_s / 2, shares=rank_shares(per_rank))

    def stage_of(self, unit: str) -> int:
        for s in self.stages:
            if unit in s.units:
                return s.index
        raise KeyError(f"no pipeline stage holds {unit!r}")

    def summary(self) -> str:
        lines = [
            f"pipeline: {self.degree} stages x {self.chunks} chunk(s), schedule {self.schedule}, {self.microbatches} microbatches; "
            f"bubble {self.bubble_fraction:.1%} ({self.bubble_s * 1e3:.3g} ms), p2p {self.p2p_s * 1e6:.3g} µs per cut per microbatch"
        ]
        for s in self.stages:
            span = s.units[0] if len(s.units) == 1 else f"{s.units[0]} .. {s.units[-1]}"
            lines.append(
                f"  stage {s.index} (pipeline rank {s.device}): {span} ({len(s.units)} units), {s.time_s * 1e3:.3g} ms/microbatch"
                f"{', recompute' if s.recompute else ''}; memory {format_bytes(s.memory.total)} "
                f"(params {format_bytes(s.memory.params)}, grads {format_bytes(s.memory.grads)}, "
                f"optimizer {format_bytes(s.memory.optimizer)}, activations {format_bytes(s.memory.activations)})"
            )
        return "\n".join(lines)


def decode_pipeline(d: dict | None) -> PipelinePlan | None:
    """The inverse of the plan file's `pipeline` entry (absent for single-stage plans)."""
    if d is None:
        return None

    def tup(xs) -> tuple:
        if not isinstance(xs, list):
            raise TypeError(f"expected a list, got {xs!r:.60}")
        return tuple(xs)

    stages = tuple(
        PipelineStage(index=s["index"], device=s["device"], units=tup(s["units"]), modules=tup(s["modules"]), time_s=s["time_s"],
                      recompute=s["recompute"], memory=MemoryBreakdown.from_dict(s["memory"]),
                      idle=MemoryBreakdown.from_dict(s["idle"]) if s.get("idle") is not None else None)
        for s in tup(d["stages"])
    )
    return PipelinePlan(
        degree=d["degree"], schedule=d["schedule"], microbatches=d["microbatches"], chunks=d["chunks"], stages=stages, step_s=d["step_s"],
        bubble_s=d["bubble_s"], bubble_fraction=d["bubble_fraction"], p2p_s=d["p2p_s"], pinned=tuple(tuple(x) for x in tup(d["pinned"])),
        searched_step_s=d.get("searched_step_s"),
    )
