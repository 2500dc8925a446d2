"""Long sequences (issue 29): context-parallel attention against the best plan without sequence sharding.

    python benchmarks/long_context.py [--seq 2048 4096] [--world 4] [--steps 4] [--profile benchmarks/data/fidelity_profile.json]
    python benchmarks/long_context.py --big [--seq 131072 2048]

`--big` plans only (no run): Hugging Face Llama-3-8B on 64 H100s and Llama-3-70B on 256, built in fp32 on the meta
device as benchmarks/big_models.py builds them, with the default call (`meshplan.plan(model, devices=N, (tokens,),
example_kwargs={"labels": tokens}, cluster="h100")`: bf16, the pipeline search beyond one node, which offers a `cp`
axis on its stage sub-meshes). Each sequence length keeps the tokens per step of the 131,072-token batch (8 sequences
for 8B, 16 for 70B: 1M and 2M tokens). The table gives each chosen plan (stage sub-mesh, pipeline degree, cp size,
attention kernel or layout), its predicted step, MFU (`Plan.mfu`: model FLOPs with attention's whole S x S score
rectangle, while the step prices causal attention at the pairs its mask keeps; and 6 N T, attention left out, as
big_models.py prints it) and peak per device, and the seconds the call took. These are predictions of the H100
presets, not measurements.

For each sequence length, a small-width meshplan Llama (2 layers, width 64, 4 query / 2 key-value heads, batch 1) with
its next-token loss inside (the whole step is in the plan, as in benchmarks/memory_truth.py)
is planned from the saved profile (out of sample: nothing re-measured or rescaled) five ways on `world` gloo
ranks: a `cp` mesh with each context-parallel kernel forced (all-gathered K/V, head-tail balanced, ring, Ulysses),
and the default search, whose meshes have no `cp` axis (the best plan without the context-parallel kernels; with a
batch of 1 it may still split the sequence outside attention and the heads inside it). Each is then
trained with AdamW on local processes; the table gives predicted and measured step time (median over steps,
slowest rank) and peak bytes per rank (predicted: the plan's memory; measured: resident state plus the
profiler's allocation peak during a step, as `profiling/fidelity.py` measures it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import meshplan  # noqa: E402
from meshplan.cost_model.presets import get_cluster  # noqa: E402
from meshplan.cost_model.profile import resolve_profile  # noqa: E402
from meshplan.ir.mesh import CP_AXIS  # noqa: E402
from meshplan.models import Llama, LlamaConfig  # noqa: E402
from meshplan.plans.plan import Plan  # noqa: E402
from meshplan.profiling.fidelity import peak_during, resident_bytes, slowest_rank_seconds, solver_memory  # noqa: E402
from meshplan.regions.context_parallel import force_context_parallel  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402

DEFAULT_PROFILE = Path(__file__).resolve().parent / "data" / "fidelity_profile.json"
PLANS = ("cp allgather", "cp balanced", "cp ring", "cp ulysses", "best without cp")


class WithLoss(torch.nn.Module):
    """The Llama with its next-token loss inside, so the whole step is in the plan (and in its predicted peak)."""

    def __init__(self, lm: Llama) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.lm(tokens)[0, :-1], tokens[0, 1:])


def build(seq: int) -> tuple[WithLoss, torch.Tensor]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(seq_len=seq, hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2))
    return WithLoss(model), torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(1))


def make_plan(kind: str, seq: int, world: int, cluster) -> Plan:
    model, tokens = build(seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "best without cp":
            return meshplan.plan(model, world, (tokens,), cluster=cluster)
        with force_context_parallel(kind.split()[1]):
            return meshplan.plan(model, world, (tokens,), cluster=cluster, mesh_shape=(world,), axis_names=("cp",),
                                 input_layouts={"tokens": "S(1)"})


def measure(rank: int, world: int, plans_json: list[str], seq: int, warmup: int, steps: int) -> list[dict]:
    out = []
    for text in plans_json:
        plan = Plan.from_json(text)
        model, tokens = build(seq)
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

        def step(pmodel=pmodel, opt=opt, tokens=tokens) -> None:
            pmodel(tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        times = [slowest_rank_seconds(step) for _ in range(steps)]
        peak = torch.tensor(float(resident_bytes(pmodel, opt) + peak_during(step)), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out.append({"time_s": statistics.median(times), "peak_bytes": float(peak)})
        del pmodel, opt
    return out


BIG = {"Llama-3-8B": ("llama8b", 64, 8), "Llama-3-70B": ("llama70b", 256, 16)}
"""Title -> (benchmarks/big_models.py's case, H100s, sequences per step at 131,072 tokens)."""
LONGEST = 131_072


def plan_big(case: str, devices: int, batch: int, seq: int) -> tuple[Plan, float, int]:
    """The default call's plan for a Hugging Face Llama of big_models.py's `case` at `seq` tokens, its seconds and the
    model's parameters."""
    import transformers as tf
    from big_models import CASES

    cfg = CASES[case][1]()
    cfg.max_position_embeddings, cfg.use_cache = seq, False
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, devices=devices, example_inputs=(tokens,), example_kwargs={"labels": tokens}, cluster="h100")
    return plan, time.perf_counter() - t0, sum(p.numel() for p in model.parameters())


def big(seqs: list[int]) -> None:
    from big_models import H100_BF16_PEAK

    print("| model | H100s | seq | sequences per step | stage sub-mesh | pp | cp | attention | predicted step s | MFU | MFU (6 N T) "
          "| peak GiB | planned in s |")
    print("|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for title, (case, devices, long_batch) in BIG.items():
        for seq in seqs:
            batch = long_batch * LONGEST // seq
            plan, seconds, params = plan_big(case, devices, batch, seq)
            pipe = plan.pipeline
            cp = plan.mesh.shape[plan.mesh.axis_names.index(CP_AXIS)] if CP_AXIS in plan.mesh.axis_names else 1
            attn = {n.strategy.kernel or str(n.strategy) for n in plan.nodes if n.target == "aten.scaled_dot_product_attention.default"}
            print(f"| {title} | {devices} | {seq} | {batch} | {plan.mesh} | {pipe.degree if pipe else 1} | {cp} | {', '.join(sorted(attn))} | "
                  f"{plan.step_time_s:.2f} | {plan.mfu:.1%} | {6 * params * batch * seq / (devices * H100_BF16_PEAK * plan.step_time_s):.1%} | "
                  f"{plan.memory.total / 2**30:.1f} | {seconds:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=None, help="default: 2048 4096; with --big, 131072 2048")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--big", action="store_true", help="plan Llama-3-8B and 70B on 64 and 256 H100s only (module doc)")
    args = ap.parse_args()
    if args.big:
        big(args.seq or [LONGEST, 2048])
        return 0
    args.seq = args.seq or [2048, 4096]
    profile = resolve_profile(args.profile, None)
    cluster = get_cluster(profile.cluster if profile else "cpu").with_profile(profile)
    print(f"world {args.world} gloo ranks, planned from {args.profile}")
    print("| seq | plan | mesh | attention | predicted ms | measured ms | error | predicted MiB | measured MiB |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        plans = [make_plan(kind, seq, args.world, cluster) for kind in PLANS]
        got = run_local(args.world, measure, [p.to_json() for p in plans], seq, args.warmup, args.steps, timeout=3600)[0]
        for kind, plan, m in zip(PLANS, plans, got):
            attn = {n.strategy.kernel or str(n.strategy) for n in plan.nodes if n.target == "aten.scaled_dot_product_attention.default"}
            err = plan.step_time_s / m["time_s"] - 1
            print(f"| {seq} | {kind} | {plan.mesh} | {', '.join(sorted(attn))} | {plan.step_time_s * 1e3:.1f} | "
                  f"{m['time_s'] * 1e3:.1f} | {err:+.0%} | {solver_memory(plan) / 2**20:.1f} | {m['peak_bytes'] / 2**20:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
