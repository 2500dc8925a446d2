"""Plan quality under memory pressure (issue 17): meshplan against hand-written FSDP2, Megatron TP and
FSDP2 + TP when data parallelism does not fit.

    python benchmarks/memory_bound.py [--quick] [--steps 12] [--budget-fraction 0.55] [--profile measure|none|PATH]

A GPT (benchmarks/vs_baselines.py's "large": hidden 512, 4 layers) on 4 local gloo processes, Adam,
the same data and initial weights for every method. The per-rank budget is a fraction of the memory
meshplan's data-parallel plan needs (its `plan.memory`), so DDP does not fit by construction; the
DDP row shows by how much it misses, measured.

Methods: meshplan's default mesh search with `memory_budget=` (inputs "local": each rank passes the
part of the batch its plan's input layout gives it), FSDP2 (`fully_shard` on every block and the
root), Megatron TP (`parallelize_module`, colwise q/k/v/fc1, rowwise out_proj/fc2), FSDP2 + TP on a
2 x 2 mesh (TP inside a pair, `fully_shard` over the pairs), and DDP.

Measured per method: the slowest rank's median step time (forward + backward + `optimizer.step()`,
timed steps interleaved across methods in rounds, as in vs_baselines.py) and the peak per rank: the
bytes of its parameters, gradients and optimizer state (their local tensors, each storage once)
plus the highest running sum of allocations minus frees torch's CPU allocator reports during one
step (`torch.profiler`, `profile_memory=True`); the largest over ranks. Persistent communication
buffers (DDP's and meshplan's gradient buckets) are left out of every method alike. Every method's
losses over the warm-up steps must equal one process's within 1e-4, or the script exits 1.

Target: meshplan fits the budget and its step time is <= 1.0 x the fastest baseline that fits.
`--quick` (tiny model, 3 timed steps) is the smoke run tests/test_benchmarks_smoke.py checks.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import meshplan  # noqa: E402
import vs_baselines as vb  # noqa: E402
from meshplan.models import GPTConfig  # noqa: E402
from meshplan.profiling.fidelity import PEAK_RUNS, held_bytes, peak_during, slowest_rank_seconds  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402

WORLD = 4
MESHPLAN = "meshplan (auto, budget)"
BASELINES = ("FSDP2", "TP", "FSDP2+TP", "DDP")
METHODS = (MESHPLAN,) + BASELINES
QUICK = GPTConfig(vocab_size=128, seq_len=16, hidden=64, heads=4, layers=2)


def fsdp_tp(model, cfg: GPTConfig):
    """TP inside each pair of ranks (mesh axis 'tp'), FSDP2 over the pairs ('dp'): torchtitan's 2-D layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    vb.megatron_tp(model, cfg, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh.get_coordinate()[0]


def make(name: str, rank: int, cfg: GPTConfig, plan, out_layout):
    """(module, this rank's input, this rank's loss targets)."""
    if name == "FSDP2+TP":
        model, tokens = vb.build(cfg)
        model, dp_rank = fsdp_tp(model, cfg)
        x = vb.batch_slice(tokens, dp_rank, 2)
        return model, x, x
    if name == MESHPLAN:  # vs_baselines' "meshplan (local)": each rank passes the part of the batch its plan's inputs hold
        name, plan, out_layout = vb.MESHPLAN[1], {"local": plan}, {"local": out_layout}
    module, x, y, _ = vb.make_method(name, rank, WORLD, cfg, plan, out_layout)
    return module, x, y


def worker(rank: int, world: int, cfg: GPTConfig, plan, out_layout, warmup: int, steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    runs = {}
    for name in METHODS:
        module, x, y = make(name, rank, cfg, plan, out_layout)
        kinds = [[p for p in module.parameters() if isinstance(p, DTensor) == dt] for dt in (True, False)]
        opt = torch.optim.Adam([{"params": ps} for ps in kinds if ps], lr=vb.LR)

        def step(module=module, x=x, y=y, opt=opt) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = vb.lm_loss(module(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        losses = []
        for _ in range(warmup):  # untimed: parity losses; equal slices, each replicated alike, so the mean over ranks is the batch's
            loss = step()
            dist.all_reduce(loss)
            losses.append(float(loss) / world)
        held = [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None),
                *(t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor))]
        peak = torch.tensor(float(held_bytes(held) + peak_during(step, PEAK_RUNS)), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        runs[name] = (step, losses, [], float(peak))
    per_round = math.ceil(steps / rounds)
    for r in range(rounds):
        for name in METHODS:
            step, _, times, _ = runs[name]
            dist.barrier()
            step()
            times.extend(slowest_rank_seconds(step) for _ in range(min(per_round, steps - r * per_round)))
    return {name: (losses, statistics.median(times), peak) for name, (_, losses, times, peak) in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budget-fraction", type=float, default=0.55,
                    help="the per-rank budget as a fraction of meshplan's data-parallel plan's memory")
    ap.add_argument("--profile", default="measure", help="'measure' (this machine, now), a profile path, or 'none' (cpu presets)")
    args = ap.parse_args()
    cfg = QUICK if args.quick else vb.SIZES["large"]
    steps, warmup = (3, 2) if args.quick else (args.steps, 3)
    model, tokens = vb.build(cfg)
    print(f"GPT hidden {cfg.hidden}, {cfg.layers} layers, vocab {cfg.vocab_size}, batch {list(tokens.shape)}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {WORLD} gloo ranks, Adam")
    profile = vb.measured_profile(cfg, WORLD, "none" if args.quick else args.profile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = meshplan.plan(model, WORLD, (tokens,), cluster="cpu", profile=profile, mode="data_parallel", inputs="local")
        budget = args.budget_fraction * dp.memory.total
        t0 = time.perf_counter()
        plan = meshplan.plan(model, WORLD, (tokens,), cluster="cpu", profile=profile, memory_budget=budget, inputs="local")
    print(f"budget per rank: {budget / 2**20:.1f} MiB ({args.budget_fraction:.2f} x the data-parallel plan's {dp.memory.total / 2**20:.1f} MiB)")
    print(f"meshplan plan ({time.perf_counter() - t0:.1f} s, solver {plan.solver.status}, gap {plan.solver.gap:.1%}): mesh {plan.mesh}, "
          f"predicted {plan.step_time_s * 1e3:.1f} ms, "
          f"{plan.memory.total / 2**20:.1f} MiB per rank; parameter layouts "
          f"{dict(sorted(Counter(str(p.layout) for p in plan.params).items()))}")
    results = run_local(WORLD, worker, cfg, plan, vb.output_layout(cfg, plan), warmup, steps, args.rounds, timeout=1800)[0]
    reference = vb.reference_losses(cfg, warmup)
    worst = {name: max(abs(a - b) for a, b in zip(losses, reference)) for name, (losses, _, _) in results.items()}
    parity = all(w <= vb.PARITY_ATOL for w in worst.values())
    print(f"parity ({warmup} warm-up steps vs one process, atol {vb.PARITY_ATOL}): "
          + ", ".join(f"{n} {w:.1e}" for n, w in worst.items()) + f" -> {'OK' if parity else 'FAILED'}")
    print(f"{'method':26s} {'step ms':>9s} {'peak MiB':>9s}  fits {budget / 2**20:.1f} MiB")
    for name, (_, t, peak) in results.items():
        print(f"{name:26s} {t * 1e3:9.1f} {peak / 2**20:9.1f}  {'yes' if peak <= budget else 'no'}")
    fitting = {n: t for n, (_, t, peak) in results.items() if n in BASELINES and peak <= budget}
    ours_t, ours_peak = results[MESHPLAN][1], results[MESHPLAN][2]
    if not fitting:
        print("no baseline fits the budget")
    else:
        best = min(fitting, key=fitting.get)
        ratio = ours_t / fitting[best]
        ok = ours_peak <= budget and ratio <= 1.0
        print(f"meshplan / fastest fitting baseline ({best}) = {ratio:.2f}; meshplan fits: {'yes' if ours_peak <= budget else 'no'} "
              f"(target: fits and <= 1.0): {'met' if ok else 'NOT met'}")
    return 0 if parity else 1


if __name__ == "__main__":
    raise SystemExit(main())
