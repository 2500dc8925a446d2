"""Where a pipelined step's time goes, rank by rank, against its price (issue 27's time fidelity).

    python benchmarks/pipeline_timeline.py [--case "PP" --world 4] [--profile benchmarks/data/fidelity_profile_2046.json]

`benchmarks/step_split.py` splits flat plans; a pipeline's schedule interleaves compute, handshakes and waiting, so
this takes its timeline instead. One pipelined plan of `benchmarks/fidelity.py --out-of-sample` (by case name and
world) is planned from the profile and trained on local gloo processes as the fidelity benchmark trains it (Adam,
`pmodel.step` then the optimizer); every rank records, on the machine's one monotonic clock, its schedule's forward and
backward actions (torch's `forward_one_chunk` / `backward_one_chunk`, handshakes excluded), its waits on
point-to-point handshakes, the gradient sync after the schedule (the buckets' wait and the tied weights' sums) and
the optimizer step. Printed per rank: each span's median start (from the step's first start over ranks) and
duration over the timed steps; then the step (the last end over ranks, median) against the plan's price and each
stage's priced seconds per microbatch (its actions and handshakes included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch.distributed as dist  # noqa: E402

import meshplan  # noqa: E402
from meshplan.cost_model.presets import cluster_of  # noqa: E402
from meshplan.cost_model.profile import resolve_profile  # noqa: E402
from meshplan.profiling import fidelity  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402

WARMUP, STEPS = 3, 9
SPANS: list[tuple[str, float, float]] = []  # (what, start, end) on this rank since the step began


def _timed(owner, attr: str, what: str) -> None:
    """Record every call of `owner.attr` as a span named `what`."""
    inner = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPANS.append((what, start, time.perf_counter()))

    setattr(owner, attr, timed)


def measure(rank: int, world: int, plan_json: str, size: str) -> list[tuple[float, list[tuple[str, float, float]]]]:
    """Per timed step on this rank: its start and its spans."""
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    from meshplan.plans.plan import Plan
    from meshplan.runtime.stage_grads import StageGradSync

    warnings.simplefilter("ignore")
    _timed(stage._PipelineStageBase, "forward_one_chunk", "forward")
    _timed(stage._PipelineStageBase, "backward_one_chunk", "backward")
    _timed(schedules, "_wait_batch_p2p", "handshake wait")
    _timed(StageGradSync, "finish", "gradient sync")
    model, tokens = fidelity.build(fidelity.SIZES[size], fidelity.BATCH)
    pmodel, opt, _ = fidelity.training_step(Plan.from_json(plan_json), model, tokens, world)
    out = []
    for i in range(WARMUP + STEPS):
        dist.barrier()
        SPANS.clear()
        start = time.perf_counter()
        pmodel.step(tokens, target=tokens)
        before_opt = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        SPANS.append(("optimizer", before_opt, time.perf_counter()))
        if i >= WARMUP:
            out.append((start, list(SPANS)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="PP")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--profile", default=str(Path(__file__).resolve().parent / "data" / "fidelity_profile_2046.json"))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    cases = [c for c in fidelity.out_of_sample_cases() if c.name == args.case and c.world == args.world]
    if not cases or "pipeline" not in dict(cases[0].options):
        names = sorted({f"{c.name!r} on {c.world}" for c in fidelity.out_of_sample_cases() if "pipeline" in dict(c.options)})
        raise ValueError(f"--case {args.case!r} --world {args.world} is not a pipelined case of fidelity.py; pipelined cases: {', '.join(names)}")
    case = cases[0]
    cluster = cluster_of(resolve_profile(args.profile, None))
    model, tokens = fidelity.build(fidelity.SIZES[case.size], fidelity.BATCH)
    plan = meshplan.plan(model, case.world, (tokens,), cluster=cluster, **dict(case.options))
    pipe = plan.pipeline
    per_rank = run_local(case.world, measure, plan.to_json(), case.size, timeout=1800)

    steps = []
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in range(STEPS):
        first = min(r[s][0] for r in per_rank)
        steps.append(max(end for r in per_rank for _, _, end in r[s][1]) - first)
        for rank, r in enumerate(per_rank):
            for what, start, end in r[s][1]:
                spans.setdefault((rank, what), []).append((start - first, end - start))
    print(f"{case.name} on {case.world} ranks, {case.size} model: {plan.mesh} x pp {pipe.degree}, {pipe.schedule}, "
          f"{pipe.microbatches} microbatch(es); times in ms, medians over {STEPS} steps\n")
    print("| rank | stage(s) | span | calls per step | start | duration | per step |\n|---|---|---|---|---|---|---|")
    n = plan.mesh.size
    for (rank, what), xs in sorted(spans.items()):
        stages = ", ".join(str(st.index) for st in pipe.stages if st.device == rank // n)
        calls = len(xs) // STEPS
        print(f"| {rank} | {stages} | {what} | {calls} | {statistics.median(x[0] for x in xs) * 1e3:.2f} | "
              f"{statistics.median(x[1] for x in xs) * 1e3:.2f} | {sum(x[1] for x in xs) / STEPS * 1e3:.2f} |")
    print(f"\nstep: predicted {plan.step_time_s * 1e3:.2f}, measured {statistics.median(steps) * 1e3:.2f} "
          f"(steps {', '.join(f'{t * 1e3:.1f}' for t in steps)})")
    print("priced per microbatch (forward + backward, actions and handshakes included): "
          + ", ".join(f"stage {st.index} {st.time_s * 1e3:.2f}" for st in pipe.stages)
          + f"; the slowest rank's bubble {pipe.bubble_s * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
