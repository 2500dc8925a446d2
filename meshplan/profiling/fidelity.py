"""Cost-model fidelity: predicted against measured step time and peak memory, plan by plan.

Small GPTs whose forward returns their loss (so the whole step is in the plan), planned and trained
on local gloo processes. Each plan trains alone in its own launch, as a user runs it, `rounds` times (3 by default), the
plans' launches taking turns; each launch times Adam steps after a warm-up, a step being forward +
backward + `optimizer.step()` (a pipelined plan's `step()` runs all its microbatches), timed between
barriers, its time the slowest rank's; the plan's figure is the median of its launches.

Two modes:

- **Out of sample** (`out_of_sample_cases`, the honest test): the profile is measured once and
  saved; a later process plans every case from that file, with nothing re-measured or rescaled,
  then measures. 25 plans: forced DP, FSDP, TP, DP x TP, HSDP and five pipelined plans, and the plans
  the solver chooses itself (the default call) for three model sizes on 2, 4 and 8 processes.
  Predicted: the plan's own figures, `plan.step_time_s` and `plan.memory` (the liveness walk's
  peak; a pipelined plan's fullest rank).
- **In sample** (`cases`, calibration): eight forced plans of one model; each world's collectives
  and contention are measured again next to its timed steps, and the predicted compute and
  communication are scaled by the contention probe taken while measuring. Memory is predicted by
  `cost_model.peak.predict_peak` (the walk `plan.memory` reports). This measures how
  well the cost model can fit this machine, not how well it predicts.

Peak memory, measured: the bytes of the tensors a rank holds when a step starts (parameters,
optimizer state, gradient-bucket buffers) plus the highest point of the running sum of every
allocation and free torch's CPU allocator reports during the step (`torch.profiler` with
`profile_memory=True`), the lowest of `PEAK_RUNS` steps (`peak_during`), the largest over ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshplan.models import GPT, GPTConfig
from meshplan.runtime.local_view import local_of

MODEL = GPTConfig(vocab_size=256, seq_len=32, hidden=128, heads=4, layers=2)
BATCH = 16
QUICK_MODEL = GPTConfig(vocab_size=64, seq_len=8, hidden=32, heads=2, layers=1)
QUICK_BATCH = 8
SIZES = {"small": GPTConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2), "medium": MODEL,
         "large": GPTConfig(vocab_size=256, seq_len=32, hidden=256, heads=4, layers=2), "tiny": QUICK_MODEL}
"""Model sizes: the out-of-sample runs use the first three, the in-sample runs "medium", smoke runs "tiny"."""
MEGATRON = {"gpt.layers.*.attn.q_proj": "colwise", "gpt.layers.*.attn.k_proj": "colwise", "gpt.layers.*.attn.v_proj": "colwise",
            "gpt.layers.*.attn.out_proj": "rowwise", "gpt.layers.*.mlp.fc1": "colwise", "gpt.layers.*.mlp.fc2": "rowwise"}


class LMLoss(nn.Module):
    """A GPT whose forward returns its loss: the loss is part of the planned program."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # cross-entropy against a uniform target: F.cross_entropy's decomposition leaves a meta
        # constant in the traced program that the runtime cannot run yet
        return -F.log_softmax(self.gpt(tokens), dim=-1).mean()


def build(cfg: GPTConfig, batch: int) -> tuple[LMLoss, torch.Tensor]:
    torch.manual_seed(0)
    model = LMLoss(cfg)
    return model, torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(1))


FSDP = {"mode": "manual", "parameter_plan": {"*": "S(0)"}, "input_layouts": {"tokens": "S(0)"}}
"""`meshplan.plan` keywords of a ZeRO-3 / FSDP plan: every parameter stored sharded, the batch split."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One plan to measure: a name, a world size, the `meshplan.plan` keywords that force it (none: the
    solver's own plan, the default call) and the model size (`SIZES`)."""

    name: str
    world: int
    options: dict = field(default_factory=dict)
    size: str = "medium"


def cases(quick: bool = False) -> list[Case]:
    fsdp = FSDP
    tp = {"mode": "semi_auto", "parallelize_plan": MEGATRON, "input_layouts": {"tokens": "R"}}
    all_cases = [
        Case(name="DP", world=2, options={"mode": "data_parallel"}),
        Case(name="FSDP", world=2, options=fsdp),
        Case(name="TP", world=2, options=tp),
        Case(name="DP", world=4, options={"mode": "data_parallel"}),
        Case(name="FSDP", world=4, options=fsdp),
        Case(name="TP", world=4, options=tp),
        Case(name="DPxTP", world=4, options={"mode": "semi_auto", "mesh_shape": (2, 2), "axis_names": ("dp", "tp"),
                                             "parallelize_plan": MEGATRON, "input_layouts": {"tokens": "S(0)R"}}),
        Case(name="HSDP", world=4, options={"mode": "manual", "mesh_shape": (2, 2), "parameter_plan": {"*": "RS(0)"},
                                            "input_layouts": {"tokens": "S(0)S(0)"}}),
    ]
    if quick:
        return [dataclasses.replace(c, size="tiny") for c in all_cases if c.world == 2 and c.name in ("DP", "TP")]
    return all_cases


def out_of_sample_cases(quick: bool = False) -> list[Case]:
    """The forced plans of `cases` and more, and the solver's own for every size on 2, 4 and 8 processes."""
    if quick:
        return [Case(name="DP", world=2, options={"mode": "data_parallel"}, size="tiny"),
                Case(name="PP", world=2, options={"pipeline": 2}, size="tiny"),
                Case(name="auto", world=2, size="tiny")]
    from meshplan.planner.pipeline import PipelineOptions

    forced = cases() + [
        Case(name="PP", world=2, options={"pipeline": 2}),
        Case(name="PP 1F1B", world=2, options={"pipeline": PipelineOptions(degrees=(2,), schedules=("1f1b",))}),
        Case(name="PP", world=4, options={"pipeline": 2}),
        Case(name="PPxTP", world=4, options={"pipeline": PipelineOptions(degrees=(2,), tensor_degrees=(2,))}),
        Case(name="PP", world=8, options={"pipeline": 2}),
        Case(name="DP", world=8, options={"mode": "data_parallel"}),
        Case(name="FSDP", world=8, options=FSDP),
        Case(name="DPxTP", world=8, options={"mode": "semi_auto", "mesh_shape": (4, 2), "axis_names": ("dp", "tp"),
                                             "parallelize_plan": MEGATRON, "input_layouts": {"tokens": "S(0)R"}}),
    ]
    return forced + [Case(name=f"auto {size}", world=w, size=size) for size in ("small", "medium", "large") for w in (2, 4, 8)]


# ---------------------------------------------------------------- measuring (runs on every rank)


def resident_bytes(pmodel, opt) -> int:
    tensors = list(pmodel.parameters()) + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tensors += pmodel._grad_sync.buffers  # the packed gradient buckets
    tensors += [p.grad for p in pmodel.parameters() if p.grad is not None]
    return held_bytes(tensors)


def slowest_rank_seconds(step) -> float:
    """Seconds of one `step()` started together on every rank, as the slowest rank took it."""
    dist.barrier()
    start = time.perf_counter()
    step()
    t = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def held_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each storage once (a DTensor's bytes are its local tensor's)."""
    seen: set[int] = set()
    total = 0
    for t in map(local_of, tensors):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def peak_during(fn, runs: int = 1) -> int:
    """Highest net bytes allocated (allocations minus frees) at any moment while `fn` runs: with `runs` > 1, the lowest
    of that many runs' figures (`PEAK_RUNS`).

    The profiler records allocator events only on the threads it profiles. A buffer whose last
    reference a collective's worker thread drops (gloo keeps a finished work's tensors until its own
    thread lets the work go) is freed there unrecorded, and would count as held to the end. An address the allocator
    hands out again was freed before that, so the walk below frees a buffer at the latest when its
    address is reused. Frees it still cannot see keep their buffer to the end: one run's figure is an
    upper bound of what it held. Which buffer a worker thread frees is a race, so a training step's figure varies
    from step to step above a floor: FSDP on 4 ranks, six steps per rank, 9.18 MiB in 16 of 24 and up to 10.89
    (its plan states 9.17; HSDP: 8.33 in 16 of 24, up to 8.83, stated 8.32; 2026-11-26). A step repeats the same
    allocations, so the lowest of several steps' upper bounds is still an upper bound of each."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    if runs < 1:
        raise ValueError(f"runs must be at least 1; got {runs!r}")
    peaks = []
    for _ in range(runs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
            stack.extend(node.children)
        peaks.append(peak_of(events))
    return min(peaks)


PEAK_RUNS = 5
"""Profiled training steps per measured peak (`peak_during`): the figure goes over the floor only where all of them
do (about one step in three did, on the FSDP run of its doc)."""


def peak_of(events: list[tuple[int, int, int]]) -> int:
    """Highest net bytes held over allocator events (time, address, bytes: negative for a free), an
    address allocated again counting as freed just before (see `peak_during`)."""
    held: dict[int, int] = {}  # address -> bytes, allocated and not freed yet
    level = peak = 0
    for _, ptr, nbytes in sorted(events):
        if nbytes > 0:
            level -= held.pop(ptr, 0)
            held[ptr] = nbytes
        else:
            held.pop(ptr, None)
        level += nbytes
        peak = max(peak, level)
    return peak


def training_step(plan, model: torch.nn.Module, tokens: torch.Tensor, world: int):
    """(the parallel module, its Adam, one training step: forward, backward, `optimizer.step()`) of `plan` on this
    rank. The model's output is its loss; a pipeline's last stage hands it to loss_fn as it is."""
    import meshplan

    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan, loss_fn=lambda out, _: out)
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)

    def step() -> None:
        if plan.pipeline is not None:
            pmodel.step(tokens, target=tokens)
        else:
            pmodel(tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return pmodel, opt, step


def _measure_plan(rank: int, world: int, plan_json: str, cfg: GPTConfig, batch: int, warmup: int, steps: int) -> dict:
    """One plan trained on this launch's processes, as a user runs it: `warmup` untimed steps, the compute contention
    probed, one step to re-warm, `steps` timed steps, then the peak of one more."""
    from meshplan.plans.plan import Plan
    from meshplan.profiling.comm_profiler import measure_contention

    model, tokens = build(cfg, batch)
    pmodel, opt, step = training_step(Plan.from_json(plan_json), model, tokens, world)
    for _ in range(warmup):
        step()
    contention = measure_contention(pairs=1, seconds=0.2)
    step()
    times = [slowest_rank_seconds(step) for _ in range(steps)]
    peak = torch.tensor(float(resident_bytes(pmodel, opt) + peak_during(step, PEAK_RUNS)), dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"time_s": statistics.median(times), "peak_bytes": float(peak), "contention": contention}


# ---------------------------------------------------------------- the benchmark


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    case: Case
    mesh: tuple[int, ...]
    predicted_s: float
    measured_s: float
    predicted_bytes: float
    measured_bytes: float
    parts_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Predicted compute, communication and optimizer-step seconds (their sum is `predicted_s`; a pipelined
    plan's schedule is all compute here)."""
    pipeline: int = 1
    """Pipeline degree (the world is `pipeline` x the mesh's devices)."""
    layouts: str = ""
    """`layouts_key` of the plan measured."""
    contention: float | None = None
    """The compute contention probed in the plan's launches next to its timed steps (the median; `measure_contention`),
    None where not recorded (rows saved before 2026-11-28 14:25 UTC)."""

    @property
    def time_error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float:
        return abs(self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"spearman needs two equally long lists of >= 2 values; got {len(a)} and {len(b)}")

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0


def predict(plan, graph, optimizer: str = "adam") -> tuple[tuple[float, float, float], float]:
    """((compute, communication, optimizer) seconds, peak bytes) predicted for one training step of
    `plan` on one device."""
    from meshplan.cost_model.peak import predict_peak

    parts = (plan.compute_s, plan.comm_s, plan.optimizer_s)
    if abs(sum(parts) - plan.step_time_s) > 1e-12 * max(plan.step_time_s, 1.0):
        raise AssertionError("no other term (pipeline, offload) is forced here")
    return parts, float(predict_peak(graph, plan, optimizer=optimizer).peak)


def run(profile=None, *, quick: bool = False, steps: int = 16, warmup: int = 3, refresh_comm: bool = False, rounds: int = 3,
        log=print) -> list[Row]:
    """In sample: plan every case of `cases` with `profile` (see `meshplan.plan(profile=)`), measure each, and
    scale the predictions by the contention measured next to the timed steps; return the rows.

    `refresh_comm`: measure each world's collectives and contention again right before its plans
    are made and timed. On this shared machine their cost drifts by up to 2x within minutes
    (FSDP on 4 ranks: 283 ms, then 482 ms of collectives per step, same code), so a calibration is
    only good next to the measurement it predicts."""
    return _run(cases(quick), profile, batch=QUICK_BATCH if quick else BATCH, quick=quick, steps=steps, warmup=warmup,
                refresh_comm=refresh_comm, in_sample=True, rounds=rounds, log=log)


def run_out_of_sample(profile, *, quick: bool = False, steps: int = 16, warmup: int = 3, rounds: int = 3, log=print) -> list[Row]:
    """Out of sample: plan every case of `out_of_sample_cases` from the saved `profile` as it is (nothing
    measured again, nothing rescaled), then measure each in `rounds` launches; return the rows."""
    return _run(out_of_sample_cases(quick), profile, batch=QUICK_BATCH if quick else BATCH, quick=quick, steps=steps,
                warmup=warmup, refresh_comm=False, in_sample=False, rounds=rounds, log=log)


def plan_case(case: Case, cluster, batch: int):
    """(model, tokens, plan) of `case`: its model at `batch`, planned on `cluster` with the case's options."""
    import meshplan

    model, tokens = build(SIZES[case.size], batch)
    return model, tokens, meshplan.plan(model, case.world, (tokens,), cluster=cluster, **dict(case.options))


def save_rows(rows: list[Row], path) -> None:
    """What each plan measured (case, world, size, the plan's layouts, step and peak), for `reprice`."""
    with open(path, "w") as f:
        json.dump([{"name": r.case.name, "world": r.case.world, "size": r.case.size, "layouts": r.layouts, "measured_s": r.measured_s,
                    "measured_bytes": r.measured_bytes, "contention": r.contention} for r in rows], f, indent=1)


STATED = ("memory", "peak_bytes", "solver", "alternatives", "bubble_fraction", "model_flops")
"""Plan file fields other than `*_s` that say what the cost model predicts, not what runs (`layouts_key`)."""


def layouts_key(plan) -> str:
    """Identifies what a plan runs: its file without what the cost model states about it (prices, memory, the solver's
    figures, the candidates it ruled out: `*_s`, `memory`, `peak_bytes`, `solver`, `alternatives`, a pipeline's
    `bubble_fraction`, the model FLOPs MFU counts), so two cost models that price one plan differently give the same
    key, and two plans give two. Rows saved before 2026-11-27 02:10 UTC keyed pipelines with the bubble fraction, and
    before 07:50 UTC every plan with its model FLOPs (those of 03:59-07:16 UTC are re-keyed)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.endswith("_s") and k not in STATED}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return hashlib.sha256(json.dumps(strip(plan.to_dict()), sort_keys=True).encode()).hexdigest()[:16]


def reprice(rows_path, profile, log=print) -> list[Row]:
    """The out-of-sample cases saved by `save_rows`, planned again from `profile` and set against the steps and peaks
    measured then: how another profile, or another version of the cost model, prices the same measurements. A case
    planned into another plan than the one measured (other layouts, stages or microbatches) has no measurement here:
    it is left out, and logged."""
    from meshplan.cost_model.presets import cluster_of
    from meshplan.cost_model.profile import resolve_profile

    with open(rows_path) as f:
        saved = json.load(f)
    batch = BATCH if saved and saved[0]["size"] != "tiny" else QUICK_BATCH
    by_key = {(c.name, c.world, c.size): c for c in out_of_sample_cases(quick=batch == QUICK_BATCH)}
    measured_profile = resolve_profile(profile, None)
    cluster = cluster_of(measured_profile)
    rows = []
    for s in saved:
        case = by_key.get((s["name"], s["world"], s["size"]))
        if case is None:
            raise ValueError(f"{rows_path}: case {s['name']!r} on {s['world']} ({s['size']}) is not an out-of-sample case; "
                             f"allowed: {sorted(by_key)}")
        plan = plan_case(case, cluster, batch)[2]
        if layouts_key(plan) != s["layouts"]:
            log(f"left out {case.name} on {case.world} ({case.size}): this profile plans another plan than the one measured")
            continue
        log(f"planned {case.name} on {case.world}: predicted {plan.step_time_s * 1e3:.2f} ms, measured {s['measured_s'] * 1e3:.2f}")
        rows.append(_row(case, plan, s["measured_s"], s["measured_bytes"], contention=s.get("contention")))
    return rows


def load_adjusted(rows: list[Row], profile) -> tuple[list[Row], dict[int, tuple[float, float]]]:
    """A diagnostic, not a prediction: (each row that recorded its contention, its predicted step scaled by that
    contention over the one `profile` was calibrated with at the row's world, as in-sample mode does per world; world ->
    (the calibration's contention, the median the rows probed)), to tell how much of an error is this shared machine's
    load moving between calibration and measurement. The probe is a fixed workload, not the plan: nothing is fitted to
    the plans."""
    from meshplan.cost_model.profile import resolve_profile

    calibrated = resolve_profile(profile, None)
    probed = [r for r in rows if r.contention is not None]
    adjusted = []
    for r in probed:
        scale = r.contention / calibrated.slowdown(r.case.world)
        adjusted.append(dataclasses.replace(r, predicted_s=r.predicted_s * scale, parts_s=tuple(p * scale for p in r.parts_s)))
    worlds = sorted({r.case.world for r in probed})
    return adjusted, {w: (calibrated.slowdown(w), statistics.median(r.contention for r in probed if r.case.world == w)) for w in worlds}


def plan_parts(plan) -> tuple[float, float, float]:
    """The plan's own (compute, communication, optimizer) seconds; a pipelined plan's schedule counts as compute."""
    if plan.pipeline is not None:
        return (plan.step_time_s, 0.0, 0.0)
    return (plan.step_time_s - plan.comm_s - plan.optimizer_s, plan.comm_s, plan.optimizer_s)


def solver_memory(plan) -> float:
    """Bytes per device the plan states: `plan.memory`, its walked peak (a pipelined plan's fullest rank)."""
    return float(plan.memory.total)


def _run(all_cases: list[Case], profile, *, batch: int, quick: bool, steps: int, warmup: int, refresh_comm: bool,
         in_sample: bool, rounds: int, log) -> list[Row]:
    from meshplan.cost_model.presets import cluster_of
    from meshplan.cost_model.profile import resolve_profile
    from meshplan.ir.trace import trace

    measured_profile = resolve_profile(profile, None)
    graphs: dict[str, object] = {}  # size -> its traced graph (in sample: the liveness memory model reads it)
    rows = []
    for world in sorted({c.world for c in all_cases}):
        world_profile = measured_profile
        if refresh_comm and measured_profile is not None:
            log(f"measuring collectives and contention on {world} local processes again, next to the timed steps")
            world_profile = measured_profile.merged(_comm_profile((world,), quick))
        cluster = cluster_of(world_profile)
        mine = []
        for case in (c for c in all_cases if c.world == world):
            model, tokens, plan = plan_case(case, cluster, batch)
            mine.append((case, plan))
            if in_sample and case.size not in graphs:
                graphs[case.size] = trace(model, (tokens,))
            log(f"planned {case.name} on {case.world}: mesh {plan.mesh.shape}"
                f"{f' x pp {plan.pipeline.degree}' if plan.pipeline else ''}, predicted {plan.step_time_s * 1e3:.2f} ms")
        log(f"measuring {len(mine)} plans on {world} local gloo processes, each in its own launch, {rounds} rounds")
        results = _measure_alone(world, mine, batch, warmup, steps, rounds)
        scale = 1.0
        if in_sample:
            measuring = statistics.median(r["contention"] for r in results)
            now = _with_contention(cluster, world, measuring)
            log(f"compute contention at {world} ranks: {_slowdown(cluster, world):.2f} at calibration, {measuring:.2f} "
                "while measuring (the median over the plans' launches, used)")
            scale = _slowdown(now, world) / _slowdown(cluster, world)
        for (case, plan), got in zip(mine, results):
            if in_sample:
                (compute, comm, opt), m = predict(plan, graphs[case.size])
                # every op's time and optimizer step is linear in the contention factor; the collective
                # fits were measured under the load of calibration time, and waiting for peers scales
                # with load the same way
                parts = (compute * scale, comm * scale, opt * scale)
                rows.append(_row(case, plan, got["time_s"], got["peak_bytes"], parts=parts, predicted_bytes=m,
                                 contention=got["contention"]))
            else:
                rows.append(_row(case, plan, got["time_s"], got["peak_bytes"], contention=got["contention"]))
    return rows


def _row(case: Case, plan, measured_s: float, measured_bytes: float, *, parts: tuple[float, float, float] | None = None,
         predicted_bytes: float | None = None, contention: float | None = None) -> Row:
    """The plan's own figures (or the `parts` and `predicted_bytes` given) against what it measured."""
    parts = plan_parts(plan) if parts is None else parts
    return Row(case=case, mesh=plan.mesh.shape, predicted_s=sum(parts), measured_s=measured_s,
               predicted_bytes=solver_memory(plan) if predicted_bytes is None else predicted_bytes, measured_bytes=measured_bytes,
               parts_s=parts, pipeline=plan.pipeline.degree if plan.pipeline else 1, layouts=layouts_key(plan), contention=contention)


def _measure_alone(world: int, planned: list, batch: int, warmup: int, steps: int, rounds: int) -> list[dict]:
    """Each (case, plan) of one world trained as a user runs it, alone in its own launch of `world` processes, `rounds`
    times, the plans' launches taking turns (so a change of background load hits all plans alike): the median of the
    launches' step times, the largest peak. All of a world's plans built in one process group measured FSDP on 4
    ranks at 201 ms where alone it takes 260 (2026-11-26, docs/cost_model.md)."""
    from meshplan.runtime.launch import run_local

    got: list[list[dict]] = [[] for _ in planned]
    for _ in range(rounds):
        for i, (case, plan) in enumerate(planned):
            got[i].append(run_local(world, _measure_plan, plan.to_json(), SIZES[case.size], batch, warmup,
                                    max(4, steps // rounds), timeout=1800)[0])
    return [{"time_s": statistics.median(r["time_s"] for r in runs), "peak_bytes": max(r["peak_bytes"] for r in runs),
             "contention": statistics.median(r["contention"] for r in runs)} for runs in got]


def _slowdown(cluster, world: int) -> float:
    return cluster.profile.slowdown(world) if cluster.profile is not None else 1.0


def _with_contention(cluster, world: int, factor: float):
    """The cluster with the compute contention measured next to the timed steps: on a machine shared
    with other jobs the load drifts between calibration and measurement, and contention is the part
    of the calibration that follows it."""
    if cluster.profile is None:
        return cluster
    return cluster.with_profile(dataclasses.replace(cluster.profile, contention={**cluster.profile.contention, world: factor}))


def table(rows: list[Row]) -> str:
    from meshplan.cost_model.memory import format_bytes

    lines = ["| plan | model | world | mesh | predicted ms (compute + comm + optimizer) | measured ms | error | predicted peak | measured peak | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = " + ".join(f"{p * 1e3:.1f}" for p in r.parts_s)
        mesh = "x".join(map(str, r.mesh)) + (f" pp {r.pipeline}" if r.pipeline > 1 else "")
        lines.append(
            f"| {r.case.name} | {r.case.size} | {r.case.world} | {mesh} | {r.predicted_s * 1e3:.2f} ({parts}) | {r.measured_s * 1e3:.2f} | "
            f"{r.time_error:.0%} | {format_bytes(r.predicted_bytes)} | {format_bytes(r.measured_bytes)} | {r.memory_error:.0%} |"
        )
    f = report(rows)
    lines.append("")
    lines.append(
        f"{len(rows)} plans. Spearman rank correlation of step times: {f['spearman']:.3f}; absolute error: time median "
        f"{f['median_time_error']:.1%}, max {f['max_time_error']:.1%}; peak memory median {f['median_memory_error']:.1%}, "
        f"max {f['max_memory_error']:.1%}"
    )
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str) -> None:
    """Predicted against measured step time and peak memory, one point per plan (matplotlib, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (what, pred, meas, unit, scale) in zip(axes, [
        ("step time", [r.predicted_s for r in rows], [r.measured_s for r in rows], "ms", 1e3),
        ("peak memory per device", [r.predicted_bytes for r in rows], [r.measured_bytes for r in rows], "MiB", 2.0**-20),
    ]):
        xs, ys = [m * scale for m in meas], [p * scale for p in pred]
        for world, marker in ((2, "o"), (4, "s"), (8, "^")):
            pts = [(x, y) for x, y, r in zip(xs, ys, rows) if r.case.world == world]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=f"{world} processes")
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"measured {what} ({unit})")
        ax.set_ylabel(f"predicted {what} ({unit})")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate(*, quick: bool = False, out=None, out_of_sample: bool = False, log=print):
    """Measure this machine for the benchmark: each model's op shapes on every world of its cases
    (`profile_model`) and collectives + contention on those numbers of local processes (`profile_comm`)."""
    from meshplan.profiling.calibrate import profile_model

    all_cases = out_of_sample_cases(quick) if out_of_sample else cases(quick)
    batch = QUICK_BATCH if quick else BATCH
    worlds = sorted({c.world for c in all_cases})
    compute = None
    for size in dict.fromkeys(c.size for c in all_cases):
        cfg = SIZES[size]
        model, tokens = build(cfg, batch)
        log(f"profiling the ops of a GPT of hidden size {cfg.hidden} for {worlds} devices")
        found = profile_model(model, (tokens,), tuple(worlds), budget_s=0.01 if quick else 0.05)
        compute = found if compute is None else compute.merged(found)
    log(f"profiling collectives on {worlds} local processes")
    profile = compute.merged(_comm_profile(tuple(worlds), quick))
    if out is not None:
        from meshplan.cost_model.profile import save_merged

        profile = save_merged(profile, out)
    return profile


def _comm_profile(worlds: tuple[int, ...], quick: bool):
    from meshplan.profiling.calibrate import profile_comm

    sizes = (4 * 2**10, 64 * 2**10, 2**20) if quick else tuple(4 * 2**10 * 4**k for k in range(7))  # up to 16 MiB
    return profile_comm(worlds, sizes=sizes, reps=3 if quick else 5)


def report(rows: list[Row]) -> dict:
    """The figures the acceptance targets name."""
    return {
        "spearman": spearman([r.predicted_s for r in rows], [r.measured_s for r in rows]),
        "median_time_error": statistics.median(r.time_error for r in rows),
        "max_time_error": max(r.time_error for r in rows),
        "median_memory_error": statistics.median(r.memory_error for r in rows),
        "max_memory_error": max(r.memory_error for r in rows),
    }
