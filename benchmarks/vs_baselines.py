"""Training step time of meshplan's own plan against DDP, FSDP2 and Megatron-style TP (issue 5).

    python benchmarks/vs_baselines.py [--quick] [--worlds 2 4] [--sizes small medium large] [--steps 12] [--methods ...]

For each (world, model size) one `run_local` group of gloo processes trains a GPT with every
method in turn (Adam, same data, same initial weights) and times forward + backward + optimizer
step with `time.perf_counter`, after a `dist.barrier()`, on every rank:

- meshplan, inputs="global": `meshplan.plan(...)` (mesh search, cluster "cpu", with this machine's
  profile measured first: the model's ops on every mesh and gloo's collectives, `--profile`) then
  `auto_parallelize`; every rank passes the whole batch and gets whole logits.
- meshplan, inputs="local": the same, but each rank passes only its slice of the batch (what a
  DDP user's data loader gives it). This is the like-for-like comparison with DDP and FSDP2.
- DDP: `DistributedDataParallel`, each rank its batch slice.
- FSDP2: `fully_shard` on each block and on the root, each rank its batch slice.
- TP: `parallelize_module` with Megatron's layout (colwise q/k/v/fc1, rowwise out_proj/fc2,
  everything else replicated); every rank the whole batch, attention on its local heads.

Before timing, the losses of the warm-up steps of every method (mean over ranks where ranks see
different slices) must equal the single-process losses within 1e-4: the "parity" line. Timed
steps are interleaved across methods in rounds (one untimed step re-warms a method at the start
of each round), so a change in background load hits all methods alike. Reported per method: the
median step time on rank 0 and the largest median over ranks; ratios use the latter.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import meshplan
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.launch import run_local
from meshplan.runtime.parallel_module import shard_tensor

SIZES = {
    "small": GPTConfig(vocab_size=512, seq_len=64, hidden=128, heads=4, layers=4),
    "medium": GPTConfig(vocab_size=512, seq_len=64, hidden=256, heads=4, layers=4),
    "large": GPTConfig(vocab_size=512, seq_len=64, hidden=512, heads=8, layers=4),
}
BATCH = 16
LR = 1e-3
PARITY_ATOL = 1e-4
TARGET = 1.05
MESHPLAN = ("meshplan (global)", "meshplan (local)")
BASELINES = ("DDP", "FSDP2", "TP")
DP_PLAN = "meshplan (local, DP)"
TP_PLAN = "meshplan (TP)"
LIKE_FOR_LIKE = {DP_PLAN: "DDP", TP_PLAN: "TP"}
"""meshplan's runtime on the baseline's own layouts: a data-parallel plan (mode='data_parallel', inputs='local')
against DDP, and Megatron's layouts (param_layouts, whole batch) against parallelize_module's TP. These rows
measure the runtime's overhead apart from the planner's choice of plan."""
METHODS = MESHPLAN + tuple(LIKE_FOR_LIKE) + BASELINES
COLWISE = ("q_proj", "k_proj", "v_proj", "fc1")
ROWWISE = ("out_proj", "fc2")


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    world: int
    size: str
    warmup: int
    steps: int
    rounds: int
    methods: tuple[str, ...] = METHODS
    profile: str = "measure"
    """'measure' (this machine, now), a profile path, or 'none' (cpu presets)."""
    foreach: bool | None = None
    """Adam's `foreach` for every method (None: torch's default, per-parameter loops on CPU)."""
    fused: bool | None = None
    """Adam's `fused` for every method (one kernel per parameter group; torchtitan's default)."""


def build(cfg: GPTConfig) -> tuple[GPT, torch.Tensor]:
    """The model and the whole batch, identical on every process (seeded)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    return model, tokens


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch_slice(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return tokens.chunk(world)[rank]


def reference_losses(cfg: GPTConfig, steps: int) -> list[float]:
    """Single-process losses of the first `steps` steps: what every method must reproduce."""
    model, tokens = build(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def output_layout(cfg: GPTConfig, plan) -> tuple:
    """The layout of the logits a rank gets back from the plan (with inputs='local', its slice)."""
    model, tokens = build(cfg)
    gm = trace(model, (tokens,)).fx.gm
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    producer = out.args[0][0].name
    moved = [t.dst for t in plan.transfers if t.consumer == "output" and t.position == 0 and t.forward]
    if moved:
        return moved[0]
    (node,) = [n for n in plan.nodes if n.name == producer]
    return node.strategy.outputs[0]


# ---------------------------------------------------------------- the methods (run on every rank)


def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """GPT attention on this rank's heads (Megatron's heads-per-partition): same math, local shapes."""
    b, s, _ = x.shape
    q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


def make_method(name: str, rank: int, world: int, cfg: GPTConfig, plans: dict, out_layouts: dict):
    """(module, this rank's input, this rank's loss targets, whether ranks see different data)."""
    from torch.distributed.device_mesh import init_device_mesh

    model, tokens = build(cfg)
    if name in MESHPLAN or name in LIKE_FOR_LIKE:
        mode = {MESHPLAN[0]: "global", MESHPLAN[1]: "local", DP_PLAN: "dp", TP_PLAN: "tp"}[name]
        plan = plans[mode]
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan)
        if mode in ("global", "tp"):
            return pmodel, tokens, tokens, False
        x = shard_tensor(tokens, plan.inputs[0].layout, plan.mesh, rank)
        return pmodel, x, shard_tensor(tokens, out_layouts[mode], plan.mesh, rank), True
    if name == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        x = batch_slice(tokens, rank, world)
        return DistributedDataParallel(model), x, x, True
    mesh = init_device_mesh("cpu", (world,))
    if name == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = batch_slice(tokens, rank, world)
        return model, x, x, True
    assert name == "TP", name
    megatron_tp(model, cfg, mesh)
    return model, tokens, tokens, False


def megatron_tp(model: GPT, cfg: GPTConfig, mesh) -> None:
    """`parallelize_module` with Megatron's layout over `mesh` (1-D): colwise q/k/v/fc1, rowwise out_proj/fc2,
    attention on the local heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layout = {}
    for i, block in enumerate(model.layers):
        block.attn.head_dim = cfg.hidden // cfg.heads
        block.attn.forward = types.MethodType(_tp_attention_forward, block.attn)
        layout |= {f"layers.{i}.attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        layout |= {f"layers.{i}.attn.out_proj": RowwiseParallel(), f"layers.{i}.mlp.fc1": ColwiseParallel(),
                   f"layers.{i}.mlp.fc2": RowwiseParallel()}
    parallelize_module(model, mesh, layout)


def worker(rank: int, world: int, setting: Setting, plans: dict, out_layouts: dict) -> dict:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    warnings.simplefilter("ignore")
    cfg = SIZES[setting.size]
    runs = {}
    for name in setting.methods:
        module, x, y, split = make_method(name, rank, world, cfg, plans, out_layouts)
        # a DTensor and a plain tensor may not meet in one foreach op (TP keeps the unsharded parameters plain)
        kinds = [[p for p in module.parameters() if isinstance(p, DTensor) == dt] for dt in (True, False)]
        opt = torch.optim.Adam([{"params": ps} for ps in kinds if ps], lr=LR, foreach=setting.foreach, fused=setting.fused)

        def step(module=module, x=x, y=y, opt=opt) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(module(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        losses = []
        for _ in range(setting.warmup):  # untimed: parity losses
            loss = step()
            if split:  # each rank's loss covers its slice; equal slices, so the mean is the whole batch's
                dist.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
        runs[name] = (step, losses, [])
    per_round = math.ceil(setting.steps / setting.rounds)
    for r in range(setting.rounds):
        for name in setting.methods:
            step, _, times = runs[name]
            dist.barrier()
            step()  # re-warm after the other methods ran
            for _ in range(min(per_round, setting.steps - r * per_round)):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
    return {name: (losses, times) for name, (_, losses, times) in runs.items()}


# ---------------------------------------------------------------- driver and report


def measured_profile(cfg: GPTConfig, world: int, source: str):
    """This machine's profile for the setting: `source` 'measure' times the model's ops on every mesh of
    `world` devices and the collectives of `world` gloo ranks now; a path reads a saved profile; 'none'
    plans with the cpu presets."""
    if source == "none":
        return None
    if source != "measure":
        return source
    from meshplan.profiling.calibrate import profile_comm, profile_model

    model, tokens = build(cfg)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile_model(model, (tokens,), devices=(world,)).merged(profile_comm((world,), sizes=[4096 * 4**k for k in range(7)]))
    print(f"profiled this machine (ops on every mesh of {world} devices, collectives 4 KiB..16 MiB on {world} ranks): "
          f"{time.perf_counter() - t0:.1f} s")
    return prof


def plan_meshplan(cfg: GPTConfig, world: int, methods: tuple[str, ...], profile=None) -> tuple[dict, dict]:
    """meshplan's plans by input mode ('dp', 'tp': the like-for-like plans) and their output layouts."""
    model, tokens = build(cfg)
    plans, layouts = {}, {}
    megatron = {f"*.{m}.*": "S(0)" for m in COLWISE} | {f"*.{m}.weight": "S(1)" for m in ROWWISE}
    like = {"dp": {"inputs": "local", "mode": "data_parallel", "mesh_shape": (world,)},
            "tp": {"mesh_shape": (world,), "param_layouts": megatron, "input_layouts": {"tokens": "R"}}}
    modes = ["global", "local"] + [m for m, n in (("dp", DP_PLAN), ("tp", TP_PLAN)) if n in methods]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in modes:
            kw = like.get(mode, {"inputs": mode})
            plans[mode] = meshplan.plan(model, devices=world, example_inputs=(tokens,), cluster="cpu", profile=profile, **kw)
            layouts[mode] = output_layout(cfg, plans[mode])
    return plans, layouts


def run_setting(setting: Setting) -> bool:
    cfg = SIZES[setting.size]
    params = sum(p.numel() for p in build(cfg)[0].parameters())
    print(f"\n=== world {setting.world}, {setting.size}: GPT hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads, "
          f"vocab {cfg.vocab_size}, seq {cfg.seq_len}, batch {BATCH} (global), {params / 1e6:.2f} M params, "
          f"Adam{' (foreach)' if setting.foreach else ' (fused)' if setting.fused else ''} ===")
    profile = measured_profile(cfg, setting.world, setting.profile)
    t0 = time.perf_counter()
    plans, out_layouts = plan_meshplan(cfg, setting.world, setting.methods, profile)
    print(f"planning (both input modes, mesh search): {time.perf_counter() - t0:.1f} s")
    for mode, plan in plans.items():
        params_by_layout: dict[str, int] = {}
        for p in plan.params:
            params_by_layout[str(p.layout)] = params_by_layout.get(str(p.layout), 0) + 1
        what = {"dp": "mode=data_parallel, inputs=local", "tp": "Megatron param_layouts, inputs=global"}.get(mode, f"inputs={mode}")
        print(f"meshplan plan, {what}: mesh {plan.mesh}, input layout {plan.inputs[0].layout}, "
              f"output layout {out_layouts[mode]}, predicted step {plan.step_time_s * 1e3:.1f} ms")
        print(f"  collectives per step: {dict(sorted(plan.collectives().items()))}")
        print(f"  parameter layouts: {params_by_layout}")
    reference = reference_losses(cfg, setting.warmup)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = run_local(setting.world, worker, setting, plans, out_layouts, timeout=1800)
    print(f"run: {time.perf_counter() - t0:.1f} s (all methods, one process group); 1-min load average "
          f"{load:.2f} before, {os.getloadavg()[0]:.2f} after (this run adds about {setting.world})")

    ok = True
    diffs = {}
    for name in setting.methods:
        losses = results[0][name][0]
        diffs[name] = max(abs(a - b) for a, b in zip(losses, reference))
        ok &= diffs[name] <= PARITY_ATOL
    print(f"parity ({setting.warmup} warm-up steps' losses vs single process {[round(v, 5) for v in reference]}, "
          f"atol {PARITY_ATOL:g}): " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()) + f" -> parity: {'OK' if ok else 'FAILED'}")

    rank0 = {n: statistics.median(results[0][n][1]) for n in setting.methods}
    worst = {n: max(statistics.median(r[n][1]) for r in results) for n in setting.methods}
    best_name = min((n for n in BASELINES if n in setting.methods), key=lambda n: worst[n])
    best = worst[best_name]
    print(f"{'method':<22}{'median ms (rank 0)':>20}{'max over ranks':>16}{'/ best baseline':>17}")
    for n in setting.methods:
        print(f"{n:<22}{rank0[n] * 1e3:>20.1f}{worst[n] * 1e3:>16.1f}{worst[n] / best:>17.2f}")
    print(f"(median of {len(results[0][setting.methods[0]][1])} timed steps per method after {setting.warmup} warm-up steps; "
          f"best baseline: {best_name})")
    for n in (m for m in MESHPLAN if m in setting.methods):
        ratio = worst[n] / best
        print(f"world {setting.world} {setting.size}: {n} / best baseline = {ratio:.2f} (target <= {TARGET}): "
              f"{'met' if ratio <= TARGET else 'NOT met'}")
    for n, baseline in LIKE_FOR_LIKE.items():  # the runtime's overhead, like for like
        if n in setting.methods and baseline in setting.methods:
            ratio = worst[n] / worst[baseline]
            print(f"world {setting.world} {setting.size}: {n} / {baseline} = {ratio:.2f} (same layouts; target <= {TARGET}): "
                  f"{'met' if ratio <= TARGET else 'NOT met'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small model, world 2, 3 timed steps")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "medium"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per method (>= 10 for reported figures)")
    ap.add_argument("--rounds", type=int, default=4, help="timed steps are split into this many interleaved rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--foreach", action="store_true",
                    help="Adam(foreach=True) for every method (torch's default on GPUs; on CPU it defaults to per-parameter loops)")
    ap.add_argument("--fused", action="store_true", help="Adam(fused=True) for every method (torchtitan's default)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                    help="methods to run (default all; at least one baseline)")
    ap.add_argument("--profile", default="measure",
                    help="costs the planner uses: 'measure' (profile this machine first, the default), a profile path, or 'none' (cpu presets)")
    args = ap.parse_args(argv)
    if args.quick:
        args.worlds, args.sizes, args.steps, args.rounds = [2], ["small"], 3, 1
    if args.foreach and args.fused:
        raise ValueError("give --foreach or --fused, not both")
    if not set(args.methods) & set(BASELINES):
        raise ValueError(f"--methods {args.methods} names no baseline; add one of {', '.join(BASELINES)}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        raise ValueError(f"--steps, --rounds and --warmup must be >= 1; got {args.steps}, {args.rounds}, {args.warmup}")
    torch.set_num_threads(1)
    ok = True
    for world in args.worlds:
        for size in args.sizes:
            ok &= run_setting(Setting(world=world, size=size, warmup=args.warmup, steps=args.steps,
                                      rounds=min(args.rounds, args.steps), methods=tuple(m for m in METHODS if m in args.methods),
                                      profile=args.profile, foreach=args.foreach or None, fused=args.fused or None))
    if not ok:
        print("parity FAILED in at least one setting: the timings above are not comparable", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
