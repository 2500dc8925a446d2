"""Where a measured step's time goes, term by term against the plan's price (issue 27's time fidelity).

    python benchmarks/step_split.py [--worlds 4 8] [--profile benchmarks/data/fidelity_profile.json]

The out-of-sample fidelity benchmark compares whole steps. This splits them: for every flat plan of
`benchmarks/fidelity.py --out-of-sample` (pipelines have no split here: their schedule interleaves the
terms) on each world of local gloo processes, every rank times each step (forward, backward, Adam step)
and, inside it, the wall time blocked in the runtime's collectives (every counted collective and the
wait for the gradient buckets) and in the optimizer step; the rest is compute. It also takes the
process's CPU seconds over the step (all its threads, gloo's too). Per column the median over 9 steps,
then the largest over ranks. Printed against the plan's compute, communication and optimizer terms,
and against the machine's throughput bound: ranks x CPU seconds per rank / cores, the least a step can
take when every rank needs that much CPU and the cores are shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import meshplan  # noqa: E402
from meshplan.cost_model.presets import cluster_of  # noqa: E402
from meshplan.cost_model.profile import resolve_profile  # noqa: E402
from meshplan.profiling import fidelity  # noqa: E402
from meshplan.runtime import collectives, grad_buckets  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402

STEPS, WARMUP = 9, 3
BLOCKED = [0.0]  # seconds this rank spent in collectives since the last reset


def _timing_collectives() -> None:
    """Time every collective the runtime counts (`collectives.collective`) and the wait for the gradient buckets."""
    counted = collectives.collective

    def collective(*args, **kwargs):
        start = time.perf_counter()
        try:
            return counted(*args, **kwargs)
        finally:
            BLOCKED[0] += time.perf_counter() - start

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("meshplan.runtime") and getattr(module, "collective", None) is counted:
            module.collective = collective
    drain = grad_buckets.BucketQueue.drain

    def timed_drain(self):
        summed = drain(self)
        while True:
            start = time.perf_counter()
            try:
                item = next(summed)
            except StopIteration:
                return
            finally:
                BLOCKED[0] += time.perf_counter() - start
            yield item

    grad_buckets.BucketQueue.drain = timed_drain


def measure(rank: int, world: int, plans_json: list[str], sizes: list[str]) -> list[list[float]]:
    """Per plan: medians of (step, compute, blocked in collectives, optimizer step, CPU seconds) on this rank."""
    from meshplan.plans.plan import Plan

    warnings.simplefilter("ignore")
    _timing_collectives()
    out = []
    for text, size in zip(plans_json, sizes):
        plan = Plan.from_json(text)
        model, tokens = fidelity.build(fidelity.SIZES[size], fidelity.BATCH)
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan, loss_fn=lambda out, _: out)
        opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)
        samples = []
        for i in range(WARMUP + STEPS):
            dist.barrier()
            BLOCKED[0] = 0.0
            start, cpu = time.perf_counter(), time.process_time()
            pmodel(tokens).backward()
            before_opt = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = time.perf_counter()
            if i >= WARMUP:
                blocked, optimizer = BLOCKED[0], end - before_opt
                samples.append((end - start, end - start - blocked - optimizer, blocked, optimizer, time.process_time() - cpu))
        out.append([statistics.median(s[j] for s in samples) for j in range(5)])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--profile", default=str(Path(__file__).resolve().parent / "data" / "fidelity_profile.json"))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    cluster = cluster_of(resolve_profile(args.profile, None))
    cores = os.cpu_count()
    print(f"{cores} cores; times in ms; measured: median over {STEPS} steps, largest over ranks\n")
    print("| plan | model | world | predicted compute / comm / optimizer | measured compute / comm / optimizer | step predicted / "
          "measured | CPU ms per rank | ranks x CPU / cores |\n|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        cases = [c for c in fidelity.out_of_sample_cases() if c.world == world and "PP" not in c.name]
        plans = []
        for case in cases:
            model, tokens = fidelity.build(fidelity.SIZES[case.size], fidelity.BATCH)
            plans.append(meshplan.plan(model, world, (tokens,), cluster=cluster, **dict(case.options)))
        per_rank = run_local(world, measure, [p.to_json() for p in plans], [c.size for c in cases], timeout=1800)
        for i, (case, plan) in enumerate(zip(cases, plans)):
            step, compute, blocked, opt, cpu = (max(r[i][j] for r in per_rank) * 1e3 for j in range(5))
            predicted = [t * 1e3 for t in fidelity.plan_parts(plan)]
            print(f"| {case.name} | {case.size} | {world} | {' / '.join(f'{t:.1f}' for t in predicted)} | "
                  f"{compute:.1f} / {blocked:.1f} / {opt:.1f} | {plan.step_time_s * 1e3:.1f} / "
                  f"{step:.1f} | {cpu:.1f} | {world * cpu / cores:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
