"""Pipeline search: degree, stage cuts, microbatches, schedule and each stage's intra-op plan, in one search.

For every inner sub-mesh width `t` and microbatch size `b` the intra-op solver plans the model once
on mesh `(t,)` at batch `b`; `stage_profile` splits that plan into units (embeddings, each layer,
head). Repeated layers are tied in the solve, so a stage of k layers costs k times one layer and a
128-layer model costs as few solves as a 2-layer one. A data-parallel axis of size d outside the
stage's `(t,)` adds its gradient all-reduce. Then, for every pipeline degree p (d = N / (p t)),
microbatch count m = B / (d b) and schedule, a dynamic program over unit ranges x stages (Alpa's
formulation, min-max form) picks the cuts that minimise the slowest stage under the memory budget,
recomputing a stage's layers when its activations would not fit. The cheapest configurations are then priced
again by their runtime plans on their real 2-D sub-mesh `(d, t)` at batch d b (with the layouts they were priced
with), solved on the model cut to a few blocks, walked stage by stage under the budget and stretched to the whole
stack; the cheapest of those that fit is solved on the whole model, walked and returned with its own figures
(docs/pipeline.md, "Search" step 4).

Stage cuts pay the point-to-point send of the activation crossing them (forward) and of its
gradient (backward), on the link between stages (the pipeline axis is outermost).

Context parallelism: for a model with attention, a stage may also have a `cp` axis of size c outside its
tensor-parallel one (torchtitan's order dp, cp, tp). Its profile is solved on `(c, t)` with the axis named `cp`,
where attention can run split along the sequence (regions/context_parallel.py); everything else is priced as above
with an inner width of c t, and the runtime plan runs on `(d, c, t)`. A profile that runs no attention
context-parallel is dropped: its `cp` axis would only repeat a data-parallel configuration.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils import _pytree as pytree

from meshplan.cost_model.collectives import collective_time
from meshplan.cost_model.estimate import GRAD_BUCKET_BYTES, group_collective_time, measured_collective_time
from meshplan.cost_model.memory import MemoryBreakdown, format_bytes
from meshplan.cost_model.presets import CLUSTERS, ClusterPreset
from meshplan.cost_model.schedule_kinds import SCHEDULES, actions_per_microbatch, check_schedule, chunks_per_device
from meshplan.cost_model.schedules import ScheduleCost, in_flight, rank_shares, schedule_time
from meshplan.ir.graph import Graph
from meshplan.ir.mesh import CP_AXIS, MeshSpec
from meshplan.ir.precision import MixedPrecision
from meshplan.ir.units import POST, PRE, unit_names
from meshplan.planner.collector import fewer_collections
from meshplan.planner.planner import UNBOUNDED, MemoryBudgetError, PlanOptions, make_plan, with_walked_memory
from meshplan.planner.recompute import with_stage_recompute
from meshplan.planner.solver import InfeasiblePlan, SolveTimeout
from meshplan.planner.constraints import Constraint
from meshplan.planner.context_parallel_search import ATTENTION, uses_context_parallel
from meshplan.planner.problem import RowWeights
from meshplan.planner.stage_layouts import arranged_layouts, carried_layouts
from meshplan.planner.stage_rows import rank_weights, row_value, within_budget
from meshplan.planner.stage_profile import (Unit, at_data_parallel, profile_units, repeat_layers, stage_grad_bytes, stage_memory,
                                            stage_static_bytes, stretched_stage_memory, tied_grad_bytes)
from meshplan.plans.pipeline import PipelinePlan, PipelineStage
from meshplan.plans.plan import Plan

log = logging.getLogger("meshplan")

TOP_PRICED = 3
"""Configurations (the cheapest by the searched profiles) priced by their stage plans; the cheapest of them is solved
on the whole model and returned (the next when its whole model's stage plan does not fit)."""
MOST_TRIED = 8
"""Configurations tried at most, in the search's order, to find `TOP_PRICED` whose stage plans fit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    schedules: tuple[str, ...] = SCHEDULES
    """Schedules to consider."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Samples per microbatch per data-parallel rank (b) to consider."""
    degrees: tuple[int, ...] | None = None
    """Pipeline degrees to consider; None: every divisor of the device count up to the number of units."""
    tensor_degrees: tuple[int, ...] | None = None
    """Inner sub-mesh widths t to consider; None: every divisor of the device count up to devices_per_node."""
    context_degrees: tuple[int, ...] | None = None
    """Sizes c of a `cp` axis outside t on the stage sub-mesh (attention split along the sequence) to consider, 1 for
    none; None: 1, and for a model with attention every divisor of N / t from 2 up to devices_per_node, beside the
    widest t and then narrower ones while each is priced below the one before."""
    virtual: int = 2
    """Chunks per device for the interleaved schedules."""
    stage_config: dict[str, int] = field(default_factory=dict)
    """Pinned stages: module path (`layers.0`, `wte`, `pre`, `post`) -> stage index; the rest is searched."""
    layers: int | None = None
    """Stretch the traced repeated layers to this many (plan a deep model from a 2-layer trace)."""
    stage_plan: bool = True
    """Solve the winner's intra-op plan on its real sub-mesh (d, t) at batch d b, for the runtime; False leaves
    `PipelineResult.plan` None (pricing only: the Megatron table)."""
    optimizer: str = "adam"
    memory_budget: float | None = None
    """Bytes per device; None: the cluster device's memory."""
    recompute: bool | None = None
    """Force recomputation on (True) or off (False) in every stage; None: only where memory needs it."""
    time_limit_s: float = 60.0
    """Seconds each intra-op solve may take (`meshplan.plan(time_limit_s=)`)."""
    token_order: bool | None = False
    """Whether stage sub-meshes with a `cp` axis hold their splits over it in head-tail token order
    (`PlanOptions.token_order`), in their profiles and their stage plans alike; None: each such configuration is
    searched in both orders (the cheapest of each priced by its stage plan: `_returned_plan`). Not None by default:
    that costs every call with attention planning time (docs/long_context.md, "In head-tail token order")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    tensor: int
    pipeline: int
    data: int
    micro: int
    """b: samples per microbatch per data-parallel rank."""
    pipe: PipelinePlan
    context: int = 1
    """c: the `cp` axis of the stage sub-mesh (d, c, t); 1: none."""
    token_order: bool = False
    """The `cp` axis' splits in head-tail token order (`PlanOptions.token_order`)."""

    @property
    def step_s(self) -> float:
        return self.pipe.step_s

    @property
    def inner(self) -> MeshSpec:
        """The mesh its stage profile was solved on (one data-parallel replica's stage)."""
        return inner_mesh(self.context, self.tensor)

    @property
    def stage_mesh(self) -> MeshSpec:
        """The stage sub-mesh its runtime plan runs on: (d, c, t), without the axes of size 1."""
        return sub_mesh(self.data, self.context, self.tensor)


def sub_mesh(data: int, context: int, tensor: int) -> MeshSpec:
    """Axes dp, cp, tp (torchtitan's order) of sizes `data`, `context`, `tensor`, the ones of size 1 left out."""
    axes = [(n, a) for n, a in ((data, "dp"), (context, CP_AXIS), (tensor, "tp")) if n > 1] or [(1, "dp")]
    return MeshSpec(tuple(n for n, _ in axes), tuple(a for _, a in axes))


def inner_mesh(context: int, tensor: int) -> MeshSpec:
    """The stage profile's mesh: (t,) as it always was, or (c, t) with the `cp` axis named where c > 1."""
    return MeshSpec((tensor,)) if context == 1 else sub_mesh(1, context, tensor)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineResult:
    best: Candidate
    plan: Plan | None
    """The stage sub-mesh's intra-op plan (mesh (d, c, t)) with `pipeline` set; None with `stage_plan=False`."""
    considered: int
    seconds: float
    solves: int


def _pins(units: list[Unit], stage_config: dict[str, int]) -> dict[int, int]:
    pins: dict[int, int] = {}
    for key, stage in stage_config.items():
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise ValueError(f"stage_config[{key!r}] = {stage!r}; a stage index must be an int >= 0")
        hit = [i for i, u in enumerate(units) if u.name == key or key in u.modules or u.name.startswith(key + ".")]
        if not hit:
            raise ValueError(f"stage_config names {key!r}, which is no unit of the model; units: {', '.join(u.name for u in units)} "
                             f"(or a top-level module of pre/post: {', '.join(units[0].modules + units[-1].modules)})")
        for i in hit:
            pins[i] = stage
    return pins


def _device_of(k: int, p: int, schedule: str) -> int:
    if schedule == "zbv":  # V shape: chunk 0 goes down the ranks, chunk 1 comes back up
        return k if k < p else 2 * p - 1 - k
    return k % p


def partition(units: list[Unit], p: int, m: int, schedule: str, *, budget: float, p2p_s: float, action_s: float = 0.0, virtual: int = 2,
              pins: dict[int, int] | None = None, recompute: bool | None = None) -> list[tuple[int, int, bool, float, MemoryBreakdown]] | None:
    """Cut `units` into p * v contiguous stages minimising the slowest stage, each within `budget`.
    Every stage costs `p2p_s` per cut it sits at and `action_s` (the runtime's per-microbatch cost) per microbatch.

    Returns [(start, end, recompute, seconds per microbatch, memory)] per stage, or None if no cut fits."""
    v = chunks_per_device(schedule, virtual)
    n_stages, U = p * v, len(units)
    if n_stages > U:
        return None
    t = np.array([u.time_s for u in units])
    f = np.array([u.forward_s if u.name not in (PRE, POST) else 0.0 for u in units])
    act = np.array([float(u.act_bytes) for u in units])
    kept = np.array([float(u.in_bytes if u.name not in (PRE, POST) else u.act_bytes) for u in units])
    static = np.array([float(u.static_bytes) for u in units])
    cs = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
    T, F, A, K, S = cs(t), cs(f), cs(act), cs(kept), cs(static)
    i_, j_ = np.meshgrid(np.arange(U + 1), np.arange(U + 1), indexing="ij")
    valid = j_ > i_
    shared = float(stage_static_bytes([units[0], units[-1]]) - units[0].static_bytes - units[-1].static_bytes)  # <= 0
    rng_static = S[j_] - S[i_] + np.where((i_ == 0) & (j_ == U), shared, 0.0)
    rng_time = T[j_] - T[i_] + p2p_s * ((i_ > 0).astype(float) + (j_ < U).astype(float)) + action_s
    rng_act, rng_kept, rng_fwd = A[j_] - A[i_], K[j_] - K[i_], F[j_] - F[i_]
    # a microbatch at its peak holds, beyond what it saved, the transient of its fullest unit (its backward's gradients)
    rng_transient = _range_max([float(u.transient_bytes) for u in units])
    # the receive buffers torch's PipelineStage allocates for every microbatch of the step and keeps: what the stage's
    # first unit takes from before the cut, and the gradient of what its last unit hands on
    rng_recv = np.zeros((U + 1, U + 1))
    if p > 1:
        took, handed = np.array([float(u.in_bytes) for u in units]), np.array([float(u.out_bytes) for u in units])
        rng_recv = m * (np.where(i_ > 0, took[np.minimum(i_, U - 1)], 0.0) + np.where(j_ < U, handed[np.maximum(j_ - 1, 0)], 0.0))
    # a recomputing stage at its peak holds one of its own layers made again, whole (the embedding and the head keep
    # their activations, counted in `kept`: only their transient)
    rng_remade = _range_max([float(u.transient_bytes) + (0.0 if u.name in (PRE, POST) else float(u.act_bytes)) for u in units])
    # mixed precision: at the end of each microbatch's backward every weight's working-copy gradient is held, and after
    # the first microbatch the largest one's fp32 gradient before it is summed in (`PeakMemory.casting_back`)
    rng_casting = cs(np.array([float(u.copy_grad_bytes) for u in units]))
    rng_casting = rng_casting[j_] - rng_casting[i_]
    if m > 1:
        rng_casting += _range_max([float(u.cast_accumulate_bytes) for u in units])
    # per-stage cost matrices (memory depends on how many microbatches the stage's device holds)
    costs, rc_used = [], []
    for k in range(n_stages):
        dev = _device_of(k, p, schedule)
        held = in_flight(schedule, p, m, dev, virtual=virtual) if p > 1 else 1.0
        # a device runs v chunks: each may use a v-th of the budget (an even split; exact for v = 1)
        cap = budget / v
        mem_plain = rng_static + held * rng_act + np.maximum(rng_transient, rng_casting - rng_act) + rng_recv
        mem_rc = rng_static + held * rng_kept + np.maximum(rng_remade, rng_casting) + rng_recv
        ok_plain = (mem_plain <= cap) & (recompute is not True)
        ok_rc = (mem_rc <= cap) & (recompute is not False)
        c = np.where(ok_plain, rng_time, np.where(ok_rc, rng_time + rng_fwd, np.inf))
        c = np.where(valid, c, np.inf)
        if pins:
            elsewhere = np.zeros(U)
            for u, s in pins.items():
                if s != k:
                    elsewhere[u] = 1.0
            E = cs(elsewhere)
            c = np.where(E[j_] - E[i_] > 0, np.inf, c)
        costs.append(c)
        rc_used.append(~ok_plain)
    # g[k][j]: best max-stage time covering units [0, j) with stages 0..k
    g = np.full((n_stages, U + 1), np.inf)
    arg = np.zeros((n_stages, U + 1), dtype=int)
    g[0] = costs[0][0]
    for k in range(1, n_stages):
        cand = np.maximum(g[k - 1][:, None], costs[k])
        arg[k] = np.argmin(cand, axis=0)
        g[k] = cand[arg[k], np.arange(U + 1)]
    if not math.isfinite(g[-1][U]):
        return None
    cuts, j = [], U
    for k in range(n_stages - 1, -1, -1):
        i = int(arg[k][j]) if k > 0 else 0
        cuts.append((i, j, k))
        j = i
    out = []
    for i, j, k in reversed(cuts):
        rc = bool(rc_used[k][i, j])
        dev = _device_of(k, p, schedule)
        held = in_flight(schedule, p, m, dev, virtual=virtual) if p > 1 else 1.0
        acts = (held * rng_kept[i, j] + max(rng_remade[i, j], rng_casting[i, j]) if rc else
                held * rng_act[i, j] + max(rng_transient[i, j], rng_casting[i, j] - rng_act[i, j])) + rng_recv[i, j]
        mem = stage_memory(units[i:j], acts)
        out.append((i, j, rc, float(costs[k][i, j]), mem))
    return out


def _range_max(values: list[float]) -> np.ndarray:
    """[i, j]: the largest of `values[i:j]` (0 where j <= i), for every unit range."""
    v = np.array(values)
    out = np.zeros((len(v) + 1, len(v) + 1))
    for i in range(len(v)):
        out[i, i + 1:] = np.maximum.accumulate(v[i:])
    return out


def dp_sync_s(grad_bytes: float, data: int, mesh: tuple[int, ...], axis: int, cluster: ClusterPreset) -> float:
    """Bucketed gradient all-reduce over the data-parallel axis."""
    if data <= 1 or grad_bytes <= 0:
        return 0.0
    fixed = group_collective_time("all_reduce", 1, (axis,), mesh, cluster)
    buckets = max(1, math.ceil(grad_bytes / GRAD_BUCKET_BYTES))
    return group_collective_time("all_reduce", int(grad_bytes), (axis,), mesh, cluster) + (buckets - 1) * fixed


def _cut_prices(units: list[Unit], p: int, d: int, t: int, schedule: str, cluster: ClusterPreset) -> tuple[float, float]:
    """(seconds a stage pays per cut it sits at, seconds per microbatch for the runtime's schedule actions)."""
    mesh = (p, d, t)
    # one cut sends the activation forward and its gradient back, between ranks d*t apart
    cut_bytes = max((u.out_bytes for u in units[:-1]), default=0)
    link = cluster.link_for_axis(mesh, 0)
    p2p = 2 * collective_time("send_recv", int(cut_bytes), 2, link) if p > 1 else 0.0
    # the runtime's own cost of a stage's actions per microbatch, measured with their handshakes
    # (profiling/pipeline_overhead.py): the cut's sends then cost their bytes only
    per_action = cluster.profile.pipeline_action(p * d * t, schedule) if p > 1 and cluster.profile else 0.0
    if per_action:
        p2p = max(0.0, p2p - 2 * collective_time("send_recv", 1, 2, link))
    return p2p, actions_per_microbatch(schedule) * per_action


def evaluate(units: list[Unit], *, p: int, d: int, t: int, m: int, schedule: str, cluster: ClusterPreset, budget: float,
             virtual: int = 2, pins: dict[int, int] | None = None, dp_in_profile: bool, recompute: bool | None = None) -> PipelinePlan | None:
    """The best cut of `units` for one (p, d, t, m, schedule), as a PipelinePlan; None if nothing fits."""
    check_schedule(schedule)
    if not dp_in_profile:
        units = at_data_parallel(units, d)
    p2p, action = _cut_prices(units, p, d, t, schedule, cluster)
    workspace = cluster.device.library_workspace_bytes  # the math libraries' own, held all step (as the walk holds it)
    parts = partition(units, p, m, schedule, budget=budget - workspace, p2p_s=p2p, action_s=action, virtual=virtual, pins=pins,
                      recompute=recompute)
    if parts is None:
        return None
    parts = [(i, j, rc, secs, replace(mem, workspace=workspace)) for i, j, rc, secs, mem in parts]
    return _priced(units, parts, p=p, d=d, t=t, m=m, schedule=schedule, cluster=cluster, virtual=virtual, dp_in_profile=dp_in_profile,
                   p2p=p2p)


def reprice(units: list[Unit], pipe: PipelinePlan, *, d: int, t: int, cluster: ClusterPreset, dp_in_profile: bool) -> PipelinePlan:
    """`pipe`'s stages (the same units, recomputation and memory, idle included) priced on `units` by the search's own
    terms (a range's seconds as `partition` adds them, the schedule and gradient sync as `evaluate` does)."""
    p2p, action = _cut_prices(units, pipe.degree, d, t, pipe.schedule, cluster)
    index = {u.name: k for k, u in enumerate(units)}
    parts = []
    for s in pipe.stages:
        i, j = index[s.units[0]], index[s.units[-1]] + 1
        secs = sum(u.time_s for u in units[i:j]) + p2p * ((i > 0) + (j < len(units))) + action
        if s.recompute:
            secs += sum(u.forward_s for u in units[i:j] if u.name not in (PRE, POST))
        parts.append((i, j, s.recompute, secs, s.memory))
    priced = _priced(units, parts, p=pipe.degree, d=d, t=t, m=pipe.microbatches, schedule=pipe.schedule, cluster=cluster,
                     virtual=pipe.chunks, dp_in_profile=dp_in_profile, p2p=p2p)
    return replace(priced, pinned=pipe.pinned, stages=tuple(replace(n, idle=o.idle) for n, o in zip(priced.stages, pipe.stages)))


def _priced(units: list[Unit], parts, *, p: int, d: int, t: int, m: int, schedule: str, cluster: ClusterPreset, virtual: int,
            dp_in_profile: bool, p2p: float) -> PipelinePlan:
    """The PipelinePlan of stages `parts` ([(start, end, recompute, seconds per microbatch, memory)])."""
    mesh = (p, d, t)
    link = cluster.link_for_axis(mesh, 0)
    v = chunks_per_device(schedule, virtual)
    dev_time = [0.0] * p
    dev_sync = [0.0] * p
    dev_grad = [0.0] * p
    stages = []
    for k, (i, j, rc, secs, mem) in enumerate(parts):
        dev = _device_of(k, p, schedule)
        dev_time[dev] += secs
        dev_sync[dev] += sum(u.sync_s for u in units[i:j])
        dev_grad[dev] += stage_grad_bytes(units[i:j])  # what the all-reduce moves (`mem.grads` holds the buckets too)
        names = tuple(u.name for u in units[i:j])
        modules = tuple(dict.fromkeys(mod for u in units[i:j] for mod in u.modules))
        stages.append(PipelineStage(index=k, device=dev, units=names, modules=modules, time_s=secs, recompute=rc, memory=mem))
    if not dp_in_profile:
        dev_sync = [s + dp_sync_s(g, d, mesh, 1, cluster) for s, g in zip(dev_sync, dev_grad)]
    slow = max(dev_time)
    if p > 1:  # every device at its own stages' seconds: the first and last carry the embedding and the head
        sched = schedule_time(schedule, p, m, slow / 3.0, virtual=virtual, shares=rank_shares(dev_time))
    else:
        sched = schedule_time("1f1b", 1, m, slow / 3.0)
    # the search's units are priced on the tensor-parallel width (t,), a stage plan's on its whole sub-mesh (d, t)
    sched = _sharing_cores(sched, d * t, d * t if dp_in_profile else t, cluster)
    if p > 1:  # tied parameters living on several stages (embedding and head) sum their gradients between them
        shared = tied_grad_bytes(units)
        tie = measured_collective_time("all_reduce", shared, 2, p * d * t, link, cluster)
    else:
        tie = 0.0
    # the runtime's work once per step outside the schedule's actions (profiling/pipeline_overhead.py)
    per_step = cluster.profile.pipeline_step(p * d * t, schedule) if p > 1 and cluster.profile else 0.0
    step = sched.step_s + max(dev_sync) + tie + per_step
    return PipelinePlan(degree=p, schedule=schedule if p > 1 else "1f1b", microbatches=m, chunks=v if p > 1 else 1, stages=tuple(stages),
                        step_s=step, bubble_s=sched.bubble_s, bubble_fraction=sched.bubble_fraction, p2p_s=p2p)


def _sharing_cores(sched: ScheduleCost, ranks_per_stage: int, priced_at: int, cluster: ClusterPreset) -> ScheduleCost:
    """`sched` with its stages' compute slowed to the contention of the ranks that compute at once. A stage's ops
    are priced at the contention of `priced_at` ranks (`Profile.slowdown`, measured on ranks sharing a CPU's cores;
    1 on GPUs): its own sub-mesh's, or the tensor-parallel width's in the search's profiles. But a stage runs on
    `ranks_per_stage` ranks and the stages run side by side: on average busy / step of them at a time (their compute
    seconds summed over the makespan), so as many times the sub-mesh's ranks share the cores (one microbatch through
    two stages: one stage at a time; four microbatches through two equal stages: 1.6 stages). Their gradient syncs
    and the step's work outside the schedule are priced at the whole world's already."""
    prof = cluster.profile
    if prof is None or sched.stages == 1 or sched.step_s <= 0:
        return sched
    busy = ranks_per_stage * sched.busy_s / sched.step_s
    factor = prof.slowdown(busy) / prof.slowdown(priced_at)
    if factor == 1.0:
        return sched
    return replace(sched, step_s=sched.step_s * factor, bubble_s=sched.bubble_s * factor, busy_s=sched.busy_s * factor)


def _what(c: Candidate) -> str:
    """A configuration, as the plan's notes name it."""
    cp = f" x cp {c.context}{' in token order' if c.token_order else ''}" if c.context > 1 else ""
    return f"pipeline tp {c.tensor}{cp} x pp {c.pipeline} x dp {c.data}, microbatch {c.micro}, {c.pipe.schedule}"


def _returned_plan(ranked: list[Candidate], estimate: Callable[[Candidate], PipelinePlan], returned: Callable[[Candidate], Plan],
                   budget: float) -> tuple[Candidate, Plan]:
    """Price the cheapest searched configurations by their stage plans (`estimate`), in the search's order, until
    `TOP_PRICED` fit (at most `MOST_TRIED` tried); solve the cheapest of those on the whole model (`returned`) and
    return it as priced (its step and memory are its own stage plan's), or the next when it does not fit, with why
    each other configuration was not returned (in `plan.solver.skipped`)."""

    fits, dropped = [], []

    def price(c: Candidate) -> bool:
        try:
            fits.append((c, estimate(c)))
            return True
        except MemoryBudgetError as e:
            dropped.append(f"{_what(c)}: its stage plan does not fit: {e}")
        except SolveTimeout as e:
            dropped.append(f"{_what(c)}: its stage plan was not solved in time: {e}")
        return False

    for c in ranked[:MOST_TRIED]:
        if len(fits) == TOP_PRICED:
            break
        price(c)
    # searched in both token orders, the cheapest of each is priced too, so one order's stage plans pricing above their
    # profiles cannot hide the other (Llama-3-70B at 131k, before a dp x cp stage's views kept the sequence split:
    # docs/long_context.md)
    tried, orders = {id(c) for c in ranked[:MOST_TRIED]}, {c.token_order for c in ranked}
    for order in sorted(orders - {c.token_order for c, _ in fits}) if len(orders) > 1 else ():
        for c in [c for c in ranked if c.token_order == order and id(c) not in tried][:MOST_TRIED]:
            if price(c):
                break
    fits.sort(key=lambda cp: (cp[1].step_s, cp[1].peak_memory))
    for i, (c, pipe) in enumerate(fits):
        try:
            plan = returned(c)
        except MemoryBudgetError as e:
            dropped.append(f"{_what(c)}: its stage plan of the whole model does not fit: {e}")
            continue
        except SolveTimeout as e:
            dropped.append(f"{_what(c)}: its stage plan of the whole model was not solved in time: {e}")
            continue
        others = tuple(f"{_what(o)}: ranked at {p.step_s:.4g} s per step by its stage plan, slower than the returned one's {pipe.step_s:.4g} s"
                       for o, p in fits[i + 1:])
        plan = replace(plan, solver=replace(plan.solver, skipped=plan.solver.skipped + tuple(dropped) + others))
        return replace(c, pipe=plan.pipeline), plan
    raise ValueError(f"none of the {len(dropped)} cheapest pipeline configurations has stage plans within the budget of "
                     f"{format_bytes(budget)} per device:\n  " + "\n  ".join(dropped))


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@fewer_collections
def search(graph_at: Callable[[int], Graph], devices: int, batch: int, cluster: ClusterPreset, options: PipelineOptions,
           *, model_name: str = "model", fixed: tuple[int, int, int] | None = None, cache: dict | None = None,
           short: tuple[Callable[[int], Graph], str, int] | None = None) -> PipelineResult:
    """Search (t, p, d), b, m, schedule and cuts for `devices` devices and global batch `batch`.

    Every candidate is priced by one function (`evaluate` on the (t,) profile at b, data parallelism over d
    outside the stage's tensor-parallel group, as Megatron arranges them) and the search is exhaustive over
    (t, p, d, b, m, schedule) and exact over the cuts, so it returns the cheapest configuration of its space:
    a configuration priced with `fixed=` is never cheaper than the unrestricted search's answer. A `cp` axis of size c
    is the exception: its widths t are tried from the widest down only while each prices below the one before.

    `graph_at(n)` traces the model at batch n. `fixed=(t, p, d)` restricts the degrees (to price a
    given configuration, e.g. a paper's, under the same model). `cache` (a dict) keeps intra-op solves
    between calls for the same model and cluster. `short=(graph_at, stack, layers)`: the model traced with
    its stack of identical layers `stack` cut to a few blocks; the stage profiles are solved on it and
    stretched to `layers` blocks (tied layers make a block's cost the same in both), and only the returned
    plan is solved on the whole model."""
    t0 = time.perf_counter()
    budget = float(options.memory_budget or cluster.device.memory_bytes)
    solves = 0
    cache = {} if cache is None else cache
    profiles: dict[tuple, list[Unit]] = cache.setdefault("profiles", {})
    plans: dict[tuple, Plan] = cache.setdefault("plans", {})  # the plan each profile was read off
    stand_ins: dict[tuple, str | None] = cache.setdefault("stand_ins", {})  # the block a cut model's profile stretches

    def solve_at(graph: Graph, mesh: MeshSpec, explain: bool, ordered: bool) -> Plan:
        nonlocal solves
        solves += 1
        # a pipelined step hands out the loss alone: the stage profiles price no gather of the model's other outputs
        plan_options = PlanOptions(memory_budget=UNBOUNDED, optimizer=options.optimizer, alternatives=explain,
                                   time_limit_s=options.time_limit_s, loss_only=True,
                                   token_order=ordered)
        return make_plan(graph, mesh, cluster, plan_options, model_name=model_name)

    def short_profile(mesh: MeshSpec, n: int, ordered: bool) -> tuple[list[Unit], Plan, str] | None:
        """The stage profile from the cut model (with its plan and the block standing for every block), or None when
        its units are not its blocks (then the whole model's)."""
        short_at, stack, layers = short
        g = short_at(n)
        plan = solve_at(g, mesh, explain=False, ordered=ordered)
        units = profile_units(g, plan, options.optimizer)
        if [u.name for u in units[1:-1]] != [f"{stack}.{k}" for k in range(len(units) - 2)] or len(units) < 3:
            return None
        return repeat_layers(units, layers), plan, units[-2].name

    cp_notes: dict[str, None] = {}  # why a cp configuration is not the answer, where nothing else says it

    def profile(mesh: MeshSpec, n: int, ordered: bool = False) -> list[Unit] | None:
        """The stage profile on `mesh` at microbatch `n`; None for a mesh with a `cp` axis whose plan runs no attention
        context-parallel (the axis would only repeat a data-parallel configuration)."""
        key = (mesh, n, options.layers, options.optimizer, ordered)
        if key not in profiles:
            found = short_profile(mesh, n, ordered) if short is not None else None
            if found is None:
                plan = solve_at(graph_at(n), mesh, explain=False, ordered=ordered)  # pricing only: nobody asks this plan to explain itself
                units = profile_units(graph_at(n), plan, options.optimizer)
                if options.layers is not None:
                    units = repeat_layers(units, options.layers)
                found = units, plan, None
            profiles[key], plans[key], stand_ins[key] = found
        if CP_AXIS in mesh.axis_names and not uses_context_parallel(plans[key]):
            cp_notes[f"stage sub-mesh {mesh} (context parallel{', token order' if ordered else ''}), microbatch {n}: its stage "
                     "profile priced no attention op cheaper split along the sequence"] = None
            return None
        return profiles[key]

    def solve(c: Candidate, graph: Graph, preferred: tuple[Constraint, ...], explain: bool = False,
              rows: tuple[RowWeights, ...] = ()) -> Plan:
        """The stage plan of candidate `c` for `graph` (the model, or its cut, at the data-parallel microbatch d b) on
        the stage sub-mesh (d, t): every parameter in the layout its profile was priced with (`stage_layouts.py`), the
        `preferred` layouts kept, under the memory `rows` (one per pipeline rank, `stage_rows.py`; none: unbounded).
        `explain`: record every node's priced alternatives (the plan handed to the user; ranking needs none). Nothing is
        recomputed inside a stage plan: the search recomputes whole stages."""
        nonlocal solves
        solves += 1
        profiled = (c.inner, c.micro, options.layers, options.optimizer, c.token_order)
        params, inputs = arranged_layouts(graph, plans[profiled], data=c.data, stand_in=stand_ins[profiled], stack=short[1] if short else None)
        plan_options = PlanOptions(memory_budget=UNBOUNDED, optimizer=options.optimizer, time_limit_s=options.time_limit_s,
                                   param_layouts=params, input_layouts=inputs, preferred=preferred, alternatives=explain,
                                   loss_only=True, microbatches=c.pipe.microbatches,
                                   token_order=c.token_order, recompute="never", memory_rows=rows)
        return make_plan(graph, c.stage_mesh, cluster, plan_options, model_name=model_name)

    def arranged(c: Candidate, graph: Graph, rows: tuple[RowWeights, ...] = ()) -> Plan:
        """`c`'s stage plan for `graph` under `rows`, solved one mesh axis at a time (`stage_layouts.py`): the
        data-parallel axis with every layer op's tensor-parallel layout as priced, then the tensor-parallel axis with the
        data-parallel layouts found (never slower than the first)."""
        if c.inner.size == 1 or c.data == 1:  # the profile's mesh or the data-parallel axis alone: one solve places everything
            return solve(c, graph, (), rows=rows)
        profiled = (c.inner, c.micro, options.layers, options.optimizer, c.token_order)
        stand_in = stand_ins[profiled]
        ops = carried_layouts(graph, (short[0] if stand_in else graph_at)(c.micro), plans[profiled], axes=(None, *range(c.inner.ndim)),
                              why="the pipeline configuration's tensor-parallel layout (its stage profile on (t,))", stand_in=stand_in,
                              stack=short[1] if short else None, layers_only=True)
        return solve(c, graph, data_parallel(graph, graph, solve(c, graph, ops, rows=rows), c), rows=rows)

    def fitted(c: Candidate, graph: Graph, first: Plan, again: Callable[[tuple[RowWeights, ...]], Plan], cut: bool,
               of: str) -> tuple[Plan, tuple[PipelineStage, ...]]:
        """`first` (`c`'s stage plan of `graph`, solved unbounded) when every pipeline rank's walked peak keeps the
        budget, else `again(rows)` under a row per rank, tightened until they do (`stage_rows.within_budget`); a
        MemoryBudgetError when none does. Returns that plan (walked under `c`'s schedule, unless `cut`: `graph` is the
        model cut to a few blocks) and `c`'s stages with their walked peaks (stretched to the whole stack when `cut`)."""
        last: list = [None, None]  # the plan the last walk was of, and its stages' peaks: within_budget returns it

        def peaks(plan: Plan) -> list[float]:
            if cut:
                stages = stretched_stage_memory(graph, plan, c.pipe, optimizer=options.optimizer)
            else:
                plan = with_walked_memory(with_stage_recompute(replace(plan, pipeline=c.pipe), graph), graph, options.optimizer)
                stages = plan.pipeline.stages
            last[:] = plan, stages
            return [mb.total for mb in replace(c.pipe, stages=stages).rank_memory()]

        within_budget(lambda rows: again(rows) if rows else first, peaks,
                      lambda plan, resident, saved: row_value(graph, plan, resident, saved, options.optimizer),
                      rank_weights(graph, c.pipe), budget,
                      lambda peak: MemoryBudgetError(budget, peak, first.mesh, cluster,
                                                     of=f"{of} (solved again under a memory row per pipeline rank)"))
        return last[0], last[1]

    def data_parallel(graph: Graph, source_graph: Graph, source: Plan, c: Candidate) -> tuple[Constraint, ...]:
        """Every op of `graph` keeping the data-parallel layouts of its counterpart in `source`, none on a mesh of one
        axis."""
        if c.inner.size == 1 or c.data == 1:
            return ()
        stand_in = unit_names(source_graph)[-2] if source_graph is not graph and short else None
        return carried_layouts(graph, source_graph, source, axes=(0, *(None,) * c.inner.ndim), why="the stage plan's data-parallel layout, solved first",
                               stand_in=stand_in, stack=short[1] if stand_in else None)

    def priced(c: Candidate, graph: Graph, plan: Plan) -> Plan:
        """`plan` (`c`'s stage plan of the whole model within the budget, walked under its schedule: `fitted`) priced
        again by its own units."""
        pipe = reprice(profile_units(graph, plan, options.optimizer), plan.pipeline, d=c.data, t=c.inner.size, cluster=cluster,
                       dp_in_profile=True)
        return replace(plan, pipeline=replace(pipe, searched_step_s=c.step_s),
                       model_flops=plan.model_flops * pipe.microbatches)  # the graph is one microbatch

    unbounded: dict[tuple[MeshSpec, int, int, bool], tuple[Graph, Plan]] = {}  # (profile mesh, d, b, token order) -> its stage plan, no rows
    ranking: dict[int, tuple[Graph, Plan]] = {}  # id of a candidate -> the stage plan within the budget ranking priced it by

    def estimate(c: Candidate) -> PipelinePlan:
        """`c` priced by its stage plan within the budget, for ranking: solved unbounded once per (t, d, b), whatever
        the schedule, and again under rows for `c` only where a rank's walk is over the budget; on the model cut to a
        few blocks (when the profiles were), its units and stage peaks stretched to the whole stack."""
        key = (c.inner, c.data, c.micro, c.token_order)
        cut = short is not None and stand_ins[(c.inner, c.micro, options.layers, options.optimizer, c.token_order)] is not None
        if key not in unbounded:
            graph = (short[0] if cut else graph_at)(c.data * c.micro)
            unbounded[key] = graph, arranged(c, graph)
        graph, first = unbounded[key]
        of = f"its stage plan, stretched from the model cut to {len(unit_names(graph)) - 2} blocks" if cut else "its stage plan"
        plan, memory = fitted(c, graph, first, lambda rows: arranged(c, graph, rows), cut, of)
        ranking[id(c)] = graph, plan
        if not cut:
            return priced(c, graph, plan).pipeline
        pipe = replace(c.pipe, stages=tuple(replace(s, memory=st.memory, idle=st.idle) for s, st in zip(c.pipe.stages, memory)))
        units = repeat_layers(profile_units(graph, plan, options.optimizer), short[2])
        return reprice(units, pipe, d=c.data, t=c.inner.size, cluster=cluster, dp_in_profile=True)

    def returned(c: Candidate) -> Plan:
        """`c`'s stage plan of the whole model within the budget, priced: the data-parallel layouts of the plan ranking
        priced it by, the tensor-parallel axis solved again (on the whole model when ranking had its cut), alternatives
        recorded."""
        graph = graph_at(c.data * c.micro)
        ranked_graph, ranked = ranking[id(c)]
        preferred = data_parallel(graph, ranked_graph, ranked, c)
        plan, _ = fitted(c, graph, solve(c, graph, preferred, explain=True),
                         lambda rows: solve(c, graph, preferred, explain=True, rows=rows), False, "its stage plan of the whole model")
        return priced(c, graph, plan)

    tensors = options.tensor_degrees or tuple(x for x in divisors(devices) if x <= cluster.devices_per_node)
    if fixed is not None:
        tensors = (fixed[0],)

    def contexts(t: int) -> tuple[int, ...]:
        """The `cp` sizes searched with tensor width t: given, or for a model with attention, every divisor of N / t from
        2 up to devices_per_node. Each is one more stage profile, a solve on a 2-D mesh at the whole sequence (about 1 s
        for Llama-3-8B at 131k tokens), so beside a size c the widths are tried from the widest down, while each is
        priced below the one before (below): that model on 64 H100s is priced 3.95 s on cp=8 x tp=4 against 4.46 s on
        cp=8 x tp=8 and 4.37 s on tp=8 alone; at 8k tokens no cp=c x tp=8 runs attention split along the sequence."""
        if options.context_degrees is not None:
            return options.context_degrees
        if fixed is not None or not any(n.target == ATTENTION for n in (short[0] if short else graph_at)(1).nodes):
            return (1,)
        return (1, *(c for c in divisors(devices // t) if 1 < c <= cluster.devices_per_node))
    pins_cache: dict[int, dict[int, int]] = {}
    cands: list[Candidate] = []
    considered = 0

    def consider(t: int, ctx: int, b: int, ordered: bool) -> float:
        """Price every (p, d, schedule) of sub-mesh (c, t) at microbatch b; the cheapest step added (inf: none)."""
        nonlocal considered
        first = len(cands)
        for p in options.degrees or divisors(devices // (t * ctx)):
            if (fixed is not None and p != fixed[1]) or (devices // (t * ctx)) % p:
                continue
            d = devices // (t * ctx * p)
            if batch % (d * b):
                continue
            m = batch // (d * b)
            try:
                units = profile(inner_mesh(ctx, t), b, ordered)
            except InfeasiblePlan as e:
                if not ordered or options.token_order:
                    raise
                # searched in both orders, one that cannot be planned (a kernel forced that only the other order runs)
                # leaves the other
                cp_notes[f"stage sub-mesh {inner_mesh(ctx, t)} (context parallel, token order), microbatch {b}: {e}"] = None
                continue
            if units is None or p > len(units):
                continue
            pins = pins_cache.setdefault(len(units), _pins(units, options.stage_config))
            if pins and max(pins.values()) >= p:
                continue
            for sched in options.schedules if p > 1 else ("1f1b",):
                if sched in ("interleaved_1f1b", "interleaved_zb") and m % p:
                    continue  # Megatron's and torch's interleaved schedules want whole rounds of p microbatches
                if sched == "1f1b" and m < p:
                    continue  # torch's Schedule1F1B refuses fewer microbatches than stages
                if sched == "zbv" and m < 2 * p - 1:
                    continue  # torch's ZB-V fills its V with at least 2p - 1 microbatches
                if pins and sched != "gpipe" and sched != "1f1b" and p > 1:
                    continue  # pins name stage indices, which interleaving would renumber
                considered += 1
                pipe = evaluate(units, p=p, d=d, t=t * ctx, m=m, schedule=sched, cluster=cluster, budget=budget,
                                virtual=options.virtual, pins=pins, dp_in_profile=False, recompute=options.recompute)
                if pipe is not None:
                    cands.append(Candidate(tensor=t, pipeline=p, data=d, micro=b, pipe=pipe, context=ctx, token_order=ordered))
        return min((c.step_s for c in cands[first:]), default=math.inf)

    orders = (False, True) if options.token_order is None else (options.token_order,)
    sizes: dict[int, list[int]] = {}  # cp size c -> the tensor widths t searched beside it
    for t in tensors:
        if devices % t:
            raise ValueError(f"tensor degree {t} does not divide {devices} devices")
        for c in contexts(t):
            if (devices // t) % c:
                raise ValueError(f"context degree {c} does not divide the {devices // t} devices outside tensor degree {t}")
            sizes.setdefault(c, []).append(t)
    for t in sizes.get(1, ()):
        for b in options.microbatch_sizes:
            consider(t, 1, b, False)
    # a cp axis splits one sequence (a microbatch of several would split over data parallelism as well, without
    # attention's collectives). Beside each size c, tp narrows from the widest while that makes the configuration
    # cheaper: a narrower tp holds more of each layer per device, which only a longer sequence's attention repays
    for c in sorted(k for k in sizes if k > 1):
        wider, wider_t = math.inf, None
        for t in sorted(sizes[c], reverse=True):
            step = min(consider(t, c, 1, ordered) for ordered in orders)
            if step >= wider:
                narrower = [x for x in sizes[c] if x < t]
                if narrower:
                    why = (f"priced {step:.4g} s per step against {wider:.4g} s with tp={wider_t}" if wider_t is not None else
                           "gave no configuration that fits with attention split along the sequence")
                    cp_notes[f"stage sub-meshes cp={c} x tp={'/'.join(map(str, narrower))} (context parallel): not searched, "
                             f"as cp={c} x tp={t} {why}"] = None
                break
            wider, wider_t = step, t
    if not cands:
        raise ValueError(
            f"no pipeline configuration of {devices} devices fits the memory budget of {format_bytes(budget)} per device "
            f"for batch {batch}" + (f" with (tensor, pipeline, data) = {fixed}" if fixed else "") +
            f"; planned for cluster {cluster.name!r} ({cluster.device.memory_bytes / 2**30:.0f} GiB per device): plan for the "
            f"hardware you run on with cluster= ({', '.join(sorted(CLUSTERS))}), or give memory_budget=, more devices or a smaller batch"
        )
    pinned = tuple(sorted(options.stage_config.items()))
    ranked = [replace(c, pipe=replace(c.pipe, pinned=pinned)) for c in sorted(cands, key=lambda c: (c.step_s, c.pipe.peak_memory))]
    best, plan = ranked[0], None
    if options.stage_plan:
        if options.layers is not None:
            raise ValueError(f"PipelineOptions(layers={options.layers}) stretches a profile the model does not have: the stage plan "
                             "cannot be solved on it; give stage_plan=False (pricing only) or trace the model at its depth")
        best, plan = _returned_plan(ranked, estimate, returned, budget)
        if best.context == 1:
            cheapest = next((c for c in ranked if c.context > 1), None)
            if cheapest is not None and not any(n.startswith(_what(cheapest)) for n in plan.solver.skipped):
                cp_notes[f"{_what(cheapest)}: the cheapest configuration with a cp axis, ranked at {cheapest.step_s:.4g} s per step "
                         f"by its stage profiles, behind the returned configuration's {plan.pipeline.searched_step_s:.4g} s"] = None
        plan = replace(plan, solver=replace(plan.solver, skipped=plan.solver.skipped + tuple(cp_notes)))
    log.info("pipeline search: %d candidates, %d solves, %.1f s", considered, solves, time.perf_counter() - t0)
    return PipelineResult(best=best, plan=plan, considered=considered, seconds=time.perf_counter() - t0, solves=solves)


def pipeline_options(pipeline: int | str | PipelineOptions, stage_config: dict | None, optimizer: str, memory_budget: float | None,
                     time_limit_s: float = 60.0) -> PipelineOptions:
    """`meshplan.plan(..., pipeline=)`: 'auto' searches every degree, an int fixes it, PipelineOptions says everything."""
    if isinstance(pipeline, PipelineOptions):
        options = pipeline
    elif pipeline == "auto":
        options = PipelineOptions()
    elif isinstance(pipeline, int) and not isinstance(pipeline, bool) and pipeline >= 1:
        options = PipelineOptions(degrees=(pipeline,))
    else:
        raise ValueError(f"pipeline={pipeline!r} is not supported; give 'auto', a pipeline degree >= 1, or a PipelineOptions")
    pins = dict(options.stage_config) | dict(stage_config or {})
    return replace(options, stage_config=pins, optimizer=optimizer, memory_budget=options.memory_budget if memory_budget is None else memory_budget,
                   time_limit_s=time_limit_s)


@fewer_collections
def plan_pipeline(model, devices: int, example_inputs: tuple, *, cluster: ClusterPreset, options: PipelineOptions | None = None,
                  example_kwargs: dict | None = None, fixed: tuple[int, int, int] | None = None,
                  precision: MixedPrecision | None = None) -> PipelineResult:
    """Trace `model` (with `precision`'s casts) at each microbatch size the search asks for (inputs, and
    keyword tensors of the same batch, sliced along dim 0) and search.

    `stage_config` pins may also come from `pipeline_stage` attributes on submodules."""
    from meshplan.ir.rebatch import rebatched
    from meshplan.ir.repeat import repeated_stacks, truncated
    from meshplan.ir.trace import trace

    options = options or PipelineOptions()
    pinned = dict(module_stage_pins(model))
    pinned.update(options.stage_config)
    options = replace(options, stage_config=pinned)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive int for a pipeline search; got {devices!r}")
    batch = int(example_inputs[0].shape[0])
    cache: dict[tuple[int, bool], Graph] = {}
    stacks = repeated_stacks(model) if options.layers is None else []

    def traced(n: int, cut: bool) -> Graph:
        if (n, cut) not in cache:
            if n > batch:
                raise ValueError(f"a microbatch of {n} samples does not fit in the example batch of {batch}")
            # the two largest sizes held (traced or derived), where their programs differ only in proportion to the batch,
            # give this one without another export (ir/rebatch.py); a batch of 1 is always traced (export may specialise on it)
            known = sorted((k for k, c in cache if c == cut), reverse=True)[:2]
            graph = None
            if n > 1 and len(known) == 2:
                graph = rebatched(cache[known[0], cut], known[0], cache[known[1], cut], known[1], n)
            if graph is None:
                inputs, kwargs = microbatch_call(example_inputs, example_kwargs, n)
                with truncated(model, stacks if cut else []):
                    graph = trace(model, inputs, kwargs, precision=precision, copy_repeated=not cut)
            cache[n, cut] = graph
        return cache[n, cut]

    short = (lambda n: traced(n, True), stacks[0].path, stacks[0].length) if len(stacks) == 1 else None
    return search(lambda n: traced(n, False), devices, batch, cluster, options, model_name=type(model).__name__, fixed=fixed,
                  short=short)


def microbatch_call(example_inputs: tuple, example_kwargs: dict | None, n: int) -> tuple[tuple, dict]:
    """The example call at a microbatch of `n` samples: every tensor whose first dim is the batch (the first
    input's) is sliced (inputs, and labels among the kwargs); other inputs (flags, sizes) stay as given."""
    batch = int(example_inputs[0].shape[0])
    return pytree.tree_map_only(torch.Tensor, lambda x: x[:n] if x.dim() and x.shape[0] == batch else x,
                                (example_inputs, example_kwargs or {}))


def module_stage_pins(model) -> dict[str, int]:
    """`pipeline_stage` attributes set on submodules: module path -> stage index."""
    return {name: int(m.pipeline_stage) for name, m in model.named_modules() if name and hasattr(m, "pipeline_stage")}
