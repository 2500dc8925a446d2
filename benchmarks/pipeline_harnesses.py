"""One pipelined plan measured by both harnesses, interleaved: the fidelity benchmark's and pipeline_timeline.py's.

    python benchmarks/pipeline_harnesses.py [--case PP --world 2] [--profile benchmarks/data/fidelity_profile_0831.json] [--rounds 3]

The same search's pipeline on 2 ranks measured 48.6-50.3 ms in `fidelity.py`'s launches (2026-11-28 08:31) and 33.6 ms in
`pipeline_timeline.py` 40 minutes later. This plans the case from the profile and, each round, runs one launch of
`fidelity._measure_plan` (warm-up, contention probe, median of 16 steps timed between barriers, slowest rank) and one of
`pipeline_timeline.measure` (median over its steps of the last end over ranks), so the two read the same hour.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_timeline  # noqa: E402

import meshplan  # noqa: E402
from meshplan.cost_model.presets import cluster_of  # noqa: E402
from meshplan.cost_model.profile import resolve_profile  # noqa: E402
from meshplan.profiling import fidelity  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="PP")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--profile", default=str(Path(__file__).resolve().parent / "data" / "fidelity_profile_0831.json"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    cases = [c for c in fidelity.out_of_sample_cases() if c.name == args.case and c.world == args.world]
    if not cases or "pipeline" not in dict(cases[0].options):
        raise ValueError(f"--case {args.case!r} --world {args.world} is not a pipelined case of fidelity.py")
    case = cases[0]
    model, tokens = fidelity.build(fidelity.SIZES[case.size], fidelity.BATCH)
    plan = meshplan.plan(model, case.world, (tokens,), cluster=cluster_of(resolve_profile(args.profile, None)), **dict(case.options))
    pipe = plan.pipeline
    print(f"{case.name} on {case.world} ranks: {pipe.schedule}, {pipe.microbatches} microbatches, priced {plan.step_time_s * 1e3:.2f} ms")
    for r in range(args.rounds):
        fid = run_local(case.world, fidelity._measure_plan, plan.to_json(), fidelity.SIZES[case.size], fidelity.BATCH, 3, 16,
                        timeout=900)[0]["time_s"]
        per_rank = run_local(case.world, pipeline_timeline.measure, plan.to_json(), case.size, timeout=900)
        steps = [max(end for rank in per_rank for _, _, end in rank[s][1]) - min(rank[s][0] for rank in per_rank)
                 for s in range(pipeline_timeline.STEPS)]
        print(f"round {r}: fidelity harness {fid * 1e3:.2f} ms, timeline harness {statistics.median(steps) * 1e3:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
