"""Cost-model fidelity (issue 4): predicted vs measured step time and peak memory, plan by plan.

    python benchmarks/fidelity.py [--quick] [--profile PATH] [--save-profile PATH] [--steps 12]

The same as `meshplan validate`. Without --profile it first calibrates this machine with the
profilers (`profile_model` for the model's op shapes on 2 and 4 devices, `profile_comm` for
collectives and compute contention on 2 and 4 local gloo processes), then plans DP, FSDP, TP,
DP x TP and HSDP plans for a small GPT (meshplan/fidelity.py), trains each on local
gloo processes and prints the table, the Spearman rank correlation of predicted and measured step
times and the median absolute errors, with the targets (>= 0.9; <= 20 % time; <= 10 % memory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

from meshplan import fidelity  # noqa: E402

TARGETS = {"spearman": 0.9, "median_time_error": 0.20, "median_memory_error": 0.10}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, two plans, world 2 (smoke test)")
    ap.add_argument("--profile", help="use this profile instead of calibrating now")
    ap.add_argument("--save-profile", help="write the calibration profile here")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    profile = args.profile or fidelity.calibrate(quick=args.quick, out=args.save_profile, log=log)
    # a profile measured now is refreshed next to each world's steps; a given one is used as it is
    rows = fidelity.run(profile, quick=args.quick, steps=args.steps, refresh_comm=not args.profile, log=log)
    print(fidelity.table(rows))
    figures = fidelity.report(rows)
    met = {
        "spearman": figures["spearman"] >= TARGETS["spearman"],
        "median_time_error": figures["median_time_error"] <= TARGETS["median_time_error"],
        "median_memory_error": figures["median_memory_error"] <= TARGETS["median_memory_error"],
    }
    for name, ok in met.items():
        sign = ">=" if name == "spearman" else "<="
        print(f"{name} = {figures[name]:.3f} (target {sign} {TARGETS[name]}): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
