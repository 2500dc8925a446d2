"""Where a measured step's time goes, term by term against the plan's price (issue 27's time fidelity).

    python benchmarks/step_split.py [--worlds 4 8] [--profile benchmarks/data/fidelity_profile.json]

The out-of-sample fidelity benchmark compares whole steps. This splits them: for every flat plan of
`benchmarks/fidelity.py --out-of-sample` (pipelines have no split here: their schedule interleaves the
terms) on each world of local gloo processes, every rank times each step (forward, backward, Adam step)
and, inside it, the wall time blocked in the runtime's collectives (every counted collective and the
wait for the gradient buckets) and in the optimizer step; the rest is compute. It also takes the
process's CPU seconds over the step (all its threads, gloo's too). Per column the median over 9 steps,
then the largest over ranks. The communication is split three ways: in the counted collectives, the wait for
the last rank of each call's group (its mesh axis) to enter it (the entries compared on the machine's one
monotonic clock) and the time after all have entered; and the wait for the gradient buckets (all-reduced
asynchronously during backward).
Printed against the plan's compute, communication and optimizer terms, and against the machine's throughput
bound: ranks x CPU seconds per rank / cores, the least a step can take when every rank needs that much CPU and
the cores are shared.
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
CALLS: list[tuple[float, float, tuple]] = []  # (entry, exit, group) of each counted collective since the last reset
DRAINED = [0.0]  # of BLOCKED, the seconds waiting for the gradient buckets


def _timing_collectives() -> None:
    """Time every collective the runtime counts (`collectives.collective`) and the wait for the gradient buckets.
    Each counted collective's entry, exit and group are kept too: `perf_counter` is CLOCK_MONOTONIC, one clock for
    every process of the machine, so the entries of a group's ranks into the same call can be compared
    (`arrival_split`)."""
    counted = collectives.collective

    def collective(comm, phase, kind, what, *args, **kwargs):
        start = time.perf_counter()
        try:
            return counted(comm, phase, kind, what, *args, **kwargs)
        finally:
            end = time.perf_counter()
            BLOCKED[0] += end - start
            CALLS.append((start, end, _group(comm, what())))

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
                spent = time.perf_counter() - start
                BLOCKED[0] += spent
                DRAINED[0] += spent
            yield item

    grad_buckets.BucketQueue.drain = timed_drain


def measure(rank: int, world: int, plans_json: list[str], sizes: list[str]) -> list[tuple[list[float], list[list[tuple]]]]:
    """Per plan: medians of (step, compute, blocked in collectives, optimizer step, CPU seconds, the part of the blocked
    spent waiting for the gradient buckets) on this rank, and each timed step's counted collectives (entry, exit, group)."""
    from meshplan.plans.plan import Plan

    warnings.simplefilter("ignore")
    _timing_collectives()
    out = []
    for text, size in zip(plans_json, sizes):
        plan = Plan.from_json(text)
        model, tokens = fidelity.build(fidelity.SIZES[size], fidelity.BATCH)
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan, loss_fn=lambda out, _: out)
        opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)
        samples, calls = [], []
        for i in range(WARMUP + STEPS):
            dist.barrier()
            BLOCKED[0] = DRAINED[0] = 0.0
            CALLS.clear()
            start, cpu = time.perf_counter(), time.process_time()
            pmodel(tokens).backward()
            before_opt = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = time.perf_counter()
            if i >= WARMUP:
                blocked, optimizer = BLOCKED[0], end - before_opt
                samples.append((end - start, end - start - blocked - optimizer, blocked, optimizer, time.process_time() - cpu, DRAINED[0]))
                calls.append(list(CALLS))
        out.append(([statistics.median(s[j] for s in samples) for j in range(6)], calls))
    return out


def _group(comm, description: str) -> tuple[int, tuple[int, ...]]:
    """The group of a counted collective: its mesh axis (every call's description ends "over mesh axis <name>") and
    this rank's coordinates on the other axes."""
    _, sep, name = description.rpartition("over mesh axis ")
    if not sep or name not in comm.mesh.axis_names:
        raise RuntimeError(f"cannot tell the mesh axis of the collective {description!r}")
    axis = comm.mesh.axis_names.index(name)
    return axis, tuple(c for a, c in enumerate(comm.coord) if a != axis)


def arrival_split(calls: list[list[list[tuple[float, float, tuple]]]]) -> tuple[float, float]:
    """`calls[rank][step]`: one plan's counted collectives (entry, exit, group). A group's ranks run its calls in the
    same order, so its j-th call on one rank is its j-th on the others. Each call's time on a rank is the wait for the
    group's last rank to enter it plus what it takes once all have entered; per rank the median over steps of each
    sum, then the largest over ranks: (waiting for the last rank, after all entered), in seconds."""
    ranks, steps = len(calls), len(calls[0])
    waiting, inside = [[] for _ in range(ranks)], [[] for _ in range(ranks)]
    for step in range(steps):
        same_call: dict[tuple, list[tuple[int, float, float]]] = {}  # (group, j) -> (rank, entry, exit) of its members
        group_ranks: dict[tuple, set[int]] = {}
        for r in range(ranks):
            seen: dict[tuple, int] = {}
            for entry, exit_, group in calls[r][step]:
                j = seen[group] = seen.get(group, -1) + 1
                same_call.setdefault((group, j), []).append((r, entry, exit_))
                group_ranks.setdefault(group, set()).add(r)
        w, i = [0.0] * ranks, [0.0] * ranks
        for (group, j), members in same_call.items():
            if len(members) != len(group_ranks[group]):
                raise RuntimeError(f"step {step}: call {j} of group {group} was counted by {len(members)} of its "
                                   f"{len(group_ranks[group])} ranks")
            last = max(entry for _, entry, _ in members)
            for r, entry, exit_ in members:
                w[r] += last - entry
                i[r] += exit_ - last
        for r in range(ranks):
            waiting[r].append(w[r])
            inside[r].append(i[r])
    return max(statistics.median(w) for w in waiting), max(statistics.median(i) for i in inside)


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
          "measured | CPU ms per rank | ranks x CPU / cores | measured comm: collectives waiting for the last rank / after all "
          "entered / gradient buckets' wait |\n|---|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        cases = [c for c in fidelity.out_of_sample_cases() if c.world == world and "PP" not in c.name]
        plans = []
        for case in cases:
            model, tokens = fidelity.build(fidelity.SIZES[case.size], fidelity.BATCH)
            plans.append(meshplan.plan(model, world, (tokens,), cluster=cluster, **dict(case.options)))
        per_rank = run_local(world, measure, [p.to_json() for p in plans], [c.size for c in cases], timeout=1800)
        for i, (case, plan) in enumerate(zip(cases, plans)):
            step, compute, blocked, opt, cpu, drained = (max(r[i][0][j] for r in per_rank) * 1e3 for j in range(6))
            waiting, inside = (t * 1e3 for t in arrival_split([r[i][1] for r in per_rank]))
            predicted = [t * 1e3 for t in fidelity.plan_parts(plan)]
            print(f"| {case.name} | {case.size} | {world} | {' / '.join(f'{t:.1f}' for t in predicted)} | "
                  f"{compute:.1f} / {blocked:.1f} / {opt:.1f} | {plan.step_time_s * 1e3:.1f} / "
                  f"{step:.1f} | {cpu:.1f} | {world * cpu / cores:.1f} | {waiting:.1f} / {inside:.1f} / {drained:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
