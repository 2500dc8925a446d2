"""The optimizer step as a training step runs it, against what the profiler prices it at (issue 27's time fidelity).

    python benchmarks/optimizer_step.py [--optimizer adam] [--rounds 3]

For each model of `benchmarks/fidelity.py` (GPTs of width 64, 128 and 256), one process on one thread, as a rank runs:
- in step: `optimizer.step()` right after a forward + backward of the model's batch, median over 12 steps;
- priced, cold: the profiler's rates (`op_profiler.optimizer_rate`: caches evicted before each timed step, median)
  applied to the model's parameter sizes, whole and a quarter of each (sharded 4 ways), as the planner applies them;
- priced, hot: the method used before 2026-11-27, each configuration's fastest of 9 steps run back to back
  (`hot_rate` here).
Rounds alternate the three (the machine's speed drifts); per model the medians over rounds and the ratios
priced / in step. The whole-size rows are what a data-parallel or replicated plan's step runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch  # noqa: E402

from meshplan.profiling import fidelity  # noqa: E402
from meshplan.profiling.op_profiler import OPTIMIZERS, optimizer_rate  # noqa: E402

STEPS = 12


def in_step_seconds(size: str, optimizer: str) -> float:
    """Median seconds of `optimizer.step()` right after each forward + backward of the model of `size`."""
    model, tokens = fidelity.build(fidelity.SIZES[size], fidelity.BATCH)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    times = []
    for _ in range(STEPS + 3):
        model(tokens).backward()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
    return statistics.median(times[3:])


def hot_rate(optimizer: str, numels: Sequence[int], runs: int = 9) -> tuple[float, float]:
    """(seconds per tensor, per element) as the profiler measured them before 2026-11-27: steps back to back with the
    caches warm, each configuration's fastest run."""

    def fastest(shapes: Sequence[int]) -> float:
        params = [torch.nn.Parameter(torch.randn(max(int(n), 1))) for n in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = OPTIMIZERS[optimizer](params)
        times = []
        for _ in range(runs + 2):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return min(times[2:])

    per_tensor = fastest([16] * 32) / 32
    sizes = [list(numels), [max(n // 4, 1) for n in numels]]
    return per_tensor, statistics.median(max(fastest(s) - per_tensor * len(s), 0.0) / sum(s) for s in sizes)


def priced(rate: tuple[float, float], numels: Sequence[int]) -> float:
    return rate[0] * len(numels) + rate[1] * sum(numels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # as each local rank runs
    print(f"{args.optimizer}, one thread; ms, medians over {args.rounds} rounds; ratio: priced / in step\n")
    print("| model | tensors | elements | in step | priced cold | ratio | priced hot | ratio | "
          "a quarter of each: priced cold | priced hot |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in ("small", "medium", "large"):
        model, _ = fidelity.build(fidelity.SIZES[size], fidelity.BATCH)
        numels = [p.numel() for p in model.parameters()]
        quarter = [max(n // 4, 1) for n in numels]
        rows = []
        for _ in range(args.rounds):
            step = in_step_seconds(size, args.optimizer)
            cold = optimizer_rate(args.optimizer, "cpu", numels)
            hot = hot_rate(args.optimizer, numels)
            rows.append((step, priced(cold, numels), priced(hot, numels), priced(cold, quarter), priced(hot, quarter)))
        step, cold, hot, cold_q, hot_q = (statistics.median(r[j] for r in rows) * 1e3 for j in range(5))
        print(f"| {size} | {len(numels)} | {sum(numels)} | {step:.2f} | {cold:.2f} | {cold / step:.2f} | {hot:.2f} | "
              f"{hot / step:.2f} | {cold_q:.2f} | {hot_q:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
