"""Planning time (trace + solve) for large models on simulated meshes: issue 5's targets.

    python benchmarks/planning_time.py [--runs 3] [--only llama|gpt3]

Prints, per case, the median over runs of trace seconds, planning seconds (candidates, costs,
solve) and their sum, next to the target, plus the plan's headline figures. Models are built on
the meta device: nothing is allocated and no process group is needed.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from meshplan.cost_model.presets import get_cluster
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig, Llama, LlamaConfig
from meshplan.planner.planner import PlanOptions, make_plan


def llama3_8b():
    cfg = LlamaConfig(vocab_size=128256, seq_len=2048, hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    return model, (torch.zeros(8, 2048, dtype=torch.long, device="meta"),)


def gpt3_175b():
    cfg = GPTConfig(vocab_size=51200, seq_len=2048, hidden=12288, heads=96, layers=96)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    return model, (torch.zeros(128, 2048, dtype=torch.long, device="meta"),)


CASES = {
    # name: (builder, mesh shape, cluster, target seconds)
    "llama": ("Llama-3-8B shape, 32 layers, mesh (8, 8)", llama3_8b, (8, 8), "h100", 15.0),
    "gpt3": ("GPT-3 175B shape, 96 layers, 1,024 devices, mesh (128, 8)", gpt3_175b, (128, 8), "h100", 60.0),
}


def run(case: str, runs: int) -> None:
    title, build, shape, cluster, target = CASES[case]
    traces, plans = [], []
    plan = None
    for _ in range(runs):
        model, inputs = build()
        t0 = time.perf_counter()
        graph = trace(model, inputs)
        t1 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(graph, MeshSpec(shape), get_cluster(cluster), PlanOptions(), model_name=type(model).__name__)
        t2 = time.perf_counter()
        traces.append(t1 - t0)
        plans.append(t2 - t1)
    tr, pl = statistics.median(traces), statistics.median(plans)
    total = tr + pl
    print(f"{title}: {len(graph.nodes)} nodes")
    print(f"  trace {tr:.1f} s + plan {pl:.1f} s (solver {plan.solver.seconds:.1f} s, {plan.solver.variables} variables, "
          f"{plan.solver.status}) = {total:.1f} s; target {target:.0f} s -> ratio {total / target:.2f} "
          f"({'met' if total <= target else 'NOT met'}); median of {runs}")
    print(f"  predicted step {plan.step_time_s * 1e3:.1f} ms, peak memory/device {plan.memory}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=sorted(CASES))
    args = ap.parse_args()
    for case in [args.only] if args.only else list(CASES):
        run(case, args.runs)


if __name__ == "__main__":
    main()
