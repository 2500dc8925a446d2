"""Measure what the pipelining runtime costs per schedule action beyond the stage's own work.

A pipelined step runs each microbatch of each stage as separate actions (a forward and a backward,
or under the zero-bubble schedules a forward, a backward for inputs and one for weights) through
`torch.distributed.pipelining`'s schedule loop: Python bookkeeping, an autograd call and a
point-to-point handshake per action. The op profiles price the work; the send/recv fit, measured as
a ring shift of blocking exchanges, overprices a pipeline's small asynchronous handshakes (1.1 ms
latency on 2 gloo ranks here, where a whole trivial 1F1B action took 0.34 ms). So the pipeline
search prices each action at the time measured here, handshake included, and a cut's sends at the
fit's bytes term only (planner/pipeline.py).

A step also costs something once, outside its actions: torch splits the batch into microbatches,
sets up and ends the schedule, and the runtime scales and writes back gradients.
`measure_schedule_overhead` runs ranks (2k, 2k+1) as two-stage 1F1B pipelines of one tiny Linear
each, every pair at once (as a pipeline's data-parallel copies run), with 2 and with 8
microbatches, and solves 1F1B's step c + (m + 1) * 2 a for the seconds a per action and c per step.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

MICROBATCHES = (2, 8)
WIDTH = 8


def measure_schedule_overhead(*, steps: int = 15, warmup: int = 3) -> tuple[float, float]:
    """Every rank: (seconds per schedule action, seconds per step outside the actions) (see the module
    docstring); the same on every rank."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    groups = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]  # every rank creates every group
    paired = rank < 2 * (world // 2)
    if paired:  # the values do not matter; the caller's random state is left as it was
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
            layer = torch.nn.Linear(WIDTH, WIDTH, device=device)

    def step_seconds(m: int) -> float:
        if paired:
            stage = PipelineStage(layer, rank % 2, 2, device, group=groups[rank // 2])
            schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, _: out.sum())
            x = torch.ones(m, WIDTH, device=device)

        def step() -> float:
            dist.barrier()
            start = time.perf_counter()
            if paired:
                schedule.step(x) if rank % 2 == 0 else schedule.step(target=x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took.item())

        for _ in range(warmup):
            step()
        return statistics.median(step() for _ in range(steps))

    (few, t_few), (many, t_many) = [(m, step_seconds(m)) for m in MICROBATCHES]
    per_action = max(0.0, (t_many - t_few) / (2 * (many - few)))
    per_step = max(0.0, t_few - 2 * (few + 1) * per_action)
    for g in groups:
        dist.destroy_process_group(g)
    return per_action, per_step
