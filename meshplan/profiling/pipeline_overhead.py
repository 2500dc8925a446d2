"""Measure what the pipelining runtime costs per schedule action, and once per step, beyond the stages' own work.

A pipelined step runs each microbatch of each stage as separate actions (a forward and a backward,
or under the zero-bubble schedules a forward, a backward for inputs and one for weights) through
`torch.distributed.pipelining`'s schedule loop: Python bookkeeping, an autograd call and a
point-to-point handshake per action. The op profiles price the work; the send/recv fit, measured as
a ring shift of blocking exchanges, overprices a pipeline's small asynchronous handshakes (1.1 ms
latency on 2 gloo ranks here, where a whole trivial 1F1B action took 0.34 ms). So the pipeline
search prices each action at the time measured here, handshake included, and a cut's sends at the
fit's bytes term only (planner/pipeline.py). A step also costs something once, outside its actions:
torch splits the batch into microbatches and sets up and ends the schedule.

Both depend on the schedule (torch runs the interleaved and zero-bubble ones through a different
runtime, with more stages per rank), so `measure_schedule_overhead` measures each: ranks (2k, 2k+1)
run it as a two-rank pipeline of tiny Linear stages (one per chunk), every pair at once (as a
pipeline's data-parallel copies run), with `MICROBATCHES` microbatch counts. The step is priced as
c + a K(m), where K(m) is the step of the same schedule in the cost model (`schedules.schedule_time`)
when every action takes one second: a least-squares line through the three counts' median steps gives
the seconds a per action and c per step.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from meshplan.cost_model.schedule_kinds import SCHEDULES, TORCH_SCHEDULE_CLASS, actions_per_microbatch, chunks_per_device
from meshplan.cost_model.schedules import schedule_time

MICROBATCHES = (4, 8, 12)
"""Valid for every schedule on 2 ranks (ZB-V needs m >= 2p - 1; the interleaved ones, whole rounds)."""
WIDTH = 8
RANKS = 2


def stage_rank(stage: int, schedule: str) -> int:
    """The rank that runs `stage` of a two-rank pipeline: round robin, or the V of ZB-V."""
    if schedule == "zbv":
        return stage if stage < RANKS else 2 * RANKS - 1 - stage
    return stage % RANKS


def unit_step(schedule: str, microbatches: int) -> float:
    """K(m): the cost model's step of `schedule` on two ranks when every action takes one second."""
    v = chunks_per_device(schedule)
    return schedule_time(schedule, RANKS, microbatches, v * actions_per_microbatch(schedule) / 3, virtual=v).step_s


def measure_schedule_overhead(*, steps: int = 15, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """Every rank: schedule -> (seconds per action, seconds per step outside the actions), the same on every rank."""
    import torch.distributed.pipelining as pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    groups = [dist.new_group([RANKS * k + r for r in range(RANKS)]) for k in range(world // RANKS)]  # every rank creates every group
    paired = rank < RANKS * (world // RANKS)

    def step_seconds(schedule: str, m: int) -> float:
        if paired:
            v = chunks_per_device(schedule)
            n = RANKS * v
            mine = [k for k in range(n) if stage_rank(k, schedule) == rank % RANKS]
            with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):  # values do not matter
                stages = [pipelining.PipelineStage(torch.nn.Linear(WIDTH, WIDTH, device=device), k, n, device, group=groups[rank // RANKS])
                          for k in mine]
            cls = getattr(pipelining, TORCH_SCHEDULE_CLASS[schedule])
            run = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=lambda out, _: out.sum())
            x = torch.ones(m, WIDTH, device=device)
            args = (x,) if 0 in mine else ()
            kwargs = {"target": x} if n - 1 in mine else {}

        def step() -> float:
            dist.barrier()
            start = time.perf_counter()
            if paired:
                run.step(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took.item())

        for _ in range(warmup):
            step()
        return statistics.median(step() for _ in range(steps))

    out = {}
    for schedule in SCHEDULES:
        k = [unit_step(schedule, m) for m in MICROBATCHES]
        t = [step_seconds(schedule, m) for m in MICROBATCHES]
        k_mean, t_mean = statistics.fmean(k), statistics.fmean(t)
        slope = sum((a - k_mean) * (b - t_mean) for a, b in zip(k, t)) / sum((a - k_mean) ** 2 for a in k)
        per_action = max(0.0, slope)
        out[schedule] = (per_action, max(0.0, t_mean - per_action * k_mean))
    for g in groups:
        dist.destroy_process_group(g)
    return out
