"""Long sequences (issue 29): context-parallel attention against the best plan without sequence sharding.

    python benchmarks/long_context.py [--seq 2048 4096] [--world 4] [--steps 4] [--profile benchmarks/data/fidelity_profile.json] [--plans ...]
    python benchmarks/long_context.py --longest [--budget-mib 32] [--world 4] [--steps 4]
    python benchmarks/long_context.py --big [--seq 131072 2048]

`--longest` finds, for a per-rank budget, the longest sequence (a multiple of `--granule`, 256) the small-width Llama
below trains at under each of four plans: CP (the ring kernel forced on a `cp` mesh, plain and load-balanced),
Ulysses (likewise), and the best plan without sequence sharding: the default call (`meshplan.plan(model, world,
(tokens,))`) with every candidate that splits a tensor along the sequence removed from its search
(`without_sequence_splits`: no `cp` axis, no sequence split outside attention either; heads, hidden and weights may
still split), checked on the plan. A length fits when the MEASURED peak (every rank's, as `profiling/fidelity.py` measures it, the lower of two profiled
steps) is within the budget. The search doubles from `--start` until a length does not fit, then bisects, each round
training every strategy still searching on one launch of `world` gloo processes. Then, at the unsharded plan's longest length, it prints every
plan's peak, CP's and Ulysses' peak over the unsharded plan's (issue 29's target: at most 0.35) and, as a reference,
over one process training the whole step, with each plan's predicted memory by part.

`--big` plans only (no run; `--token-order on`: with `token_order=True`; `both`: the pipeline search in both orders): Hugging Face Llama-3-8B on 64 H100s and Llama-3-70B on 256, built in fp32 on the meta
device as benchmarks/big_models.py builds them, with the default call (`meshplan.plan(model, devices=N, (tokens,),
example_kwargs={"labels": tokens}, cluster="h100")`: bf16, the pipeline search beyond one node, which offers a `cp`
axis on its stage sub-meshes). Each sequence length keeps the tokens per step of the 131,072-token batch (8 sequences
for 8B, 16 for 70B: 1M and 2M tokens). The table gives each chosen plan (stage sub-mesh, pipeline degree, cp size,
attention kernel or layout), its predicted step, MFU (`Plan.mfu`: model FLOPs with attention's whole S x S score
rectangle, while the step prices causal attention at the pairs its mask keeps; and 6 N T, attention left out, as
big_models.py prints it) and peak per device, and the seconds the call took. These are predictions of the H100
presets, not measurements.

For each sequence length, a small-width meshplan Llama (2 layers, width 64, 4 query / 2 key-value heads, batch 1) with
its next-token loss inside (the whole step is in the plan, as in benchmarks/memory_truth.py; the labels shifted, as
Hugging Face's causal-LM loss shifts them, so the logits keep all S rows and split with the sequence) is planned
from the saved profile (out of sample: nothing re-measured or rescaled), to which the context-parallel kernels' own
blocks at that length are added, timed on this machine first (`with_kernel_blocks`: the busiest
rank's blocks as it runs them, one process, the profiler's method; before 2026-11-26 15:00 UTC the roofline priced
them), nine ways on `world` gloo
ranks: a `cp` mesh with each context-parallel kernel forced (all-gathered K/V, balanced, ring, balanced ring,
Ulysses, and the three kernels of head-tail token order, torch's ring among them, planned with `token_order=True`), and the default search without a `cp` axis (`context_parallel=False`: "best without cp"; with a batch of 1
it may split the sequence outside attention and the heads inside it). Each is then
trained with AdamW on local processes; the table gives predicted and measured step time (median over steps,
slowest rank) and peak bytes per rank (predicted: the plan's memory; measured: resident state plus the
profiler's allocation peak during a step, as `profiling/fidelity.py` measures it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import meshplan  # noqa: E402
from meshplan.cost_model.presets import cluster_of  # noqa: E402
from meshplan.cost_model.profile import resolve_profile  # noqa: E402
from meshplan.ir.mesh import CP_AXIS, MeshSpec  # noqa: E402
from meshplan.ir.placement import Shard, fmt  # noqa: E402
from meshplan.ir.trace import trace  # noqa: E402
from meshplan.models import Llama, LlamaConfig  # noqa: E402
from meshplan.models.next_token_loss import NextTokenLoss  # noqa: E402
from meshplan.plans.plan import Plan  # noqa: E402
from meshplan.profiling.calibrate import time_region_kernels  # noqa: E402
from meshplan.profiling.fidelity import peak_during, resident_bytes, slowest_rank_seconds, solver_memory  # noqa: E402
from meshplan.regions.context_parallel import TOKEN_ORDER, VARIANTS, force_context_parallel  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402

DEFAULT_PROFILE = Path(__file__).resolve().parent / "data" / "fidelity_profile.json"
DEFAULT_BUDGET_MIB = 32.0
"""`--longest`'s per-rank budget: CP reaches about 7k tokens, so a run takes a few minutes on 2 cores."""
PLANS = ("cp allgather", "cp balanced", "cp ring", "cp ring_balanced", "cp ulysses", "cp headtail", "cp ring_headtail",
         "cp torch_ring", "best without cp")


def build(seq: int) -> tuple[NextTokenLoss, torch.Tensor]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(seq_len=seq, hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2))
    return NextTokenLoss(model), torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(1))


_KERNEL_BLOCKS: dict[tuple[int, int], dict] = {}


def with_kernel_blocks(cluster, seq: int, world: int):
    """`cluster` with the context-parallel kernels' blocks of this model at `seq` tokens on a `cp` axis of `world`
    timed into its profile (`time_region_kernels`, once per length): what a user's `meshplan profile compute` of
    this model measures besides its ops. The profile's other entries stay as saved."""
    if cluster.profile is None:
        return cluster
    if (seq, world) not in _KERNEL_BLOCKS:
        model, tokens = build(seq)
        with force_context_parallel(*VARIANTS):  # every kernel, torch's ring (offered only when asked for) among them
            _KERNEL_BLOCKS[seq, world] = time_region_kernels(trace(model, (tokens,)), [MeshSpec((world,), (CP_AXIS,))])
    return cluster.with_profile(dataclasses.replace(cluster.profile, ops={**cluster.profile.ops, **_KERNEL_BLOCKS[seq, world]}))


def make_plan(kind: str, seq: int, world: int, cluster) -> Plan:
    model, tokens = build(seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "best without cp":
            return meshplan.plan(model, world, (tokens,), cluster=cluster, context_parallel=False)
        cluster = with_kernel_blocks(cluster, seq, world)  # outside the forcing, which offers one kernel only
        kernel = kind.split()[1]
        with force_context_parallel(kernel):
            return meshplan.plan(model, world, (tokens,), cluster=cluster, mesh_shape=(world,), axis_names=("cp",),
                                 input_layouts={"tokens": "S(1)"}, token_order=kernel in TOKEN_ORDER)


def measure(rank: int, world: int, plans_json: list[str], seqs: list[int], warmup: int, steps: int) -> list[dict]:
    """Train each plan (its own sequence length) a few AdamW steps: median step of the slowest rank, and each rank's
    peak (resident state plus the profiler's allocation peak during a step, the lower of two, `profiling/fidelity.py`)."""
    out = []
    for text, seq in zip(plans_json, seqs):
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
        # peak_during is an upper bound (frees on gloo's threads go unseen until the address is reused): the ring's
        # peak at 7,168 tokens read 31.7 and 35.2 MiB in two runs, so the lower of two profiled steps (fewer than
        # fidelity.PEAK_RUNS: these steps are long)
        peak = torch.tensor(float(resident_bytes(pmodel, opt) + peak_during(step, 2)), dtype=torch.float64)
        peaks = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
        out.append({"time_s": statistics.median(times), "peak_bytes": max(map(float, peaks)), "rank_peaks": [float(p) for p in peaks]})
        del pmodel, opt
    return out


LONGEST_KINDS = ("cp ring", "cp ring_balanced", "cp ulysses", "no sequence sharding")
"""`--longest`'s strategies: CP (the ring kernel, plain and load-balanced), Ulysses, and the best plan that splits no
tensor along the sequence."""
ONE_RANK = "one rank (reference)"


def _metas(graph, node) -> list:
    return [*(graph.meta(r) for r in node.inputs), *node.outputs]


def _splits_sequence(strategy, metas: list, seq: int) -> str | None:
    """'shape placements' of the first tensor `strategy` splits along a dimension that holds the sequence (a multiple
    of `seq` long: [1, S, h], [1, heads, S, d], the flattened [S, h]), None when it splits none."""
    for meta, layout in zip(metas, [*strategy.inputs, *strategy.outputs]):
        if meta is not None and layout is not None and any(isinstance(p, Shard) and meta.shape[p.dim] % seq == 0 for p in layout):
            return f"{tuple(meta.shape)} {fmt(layout)}"
    return None


def sequence_splits(plan: Plan, graph, seq: int) -> list[str]:
    """'node: shape placements' of every tensor the plan splits along the sequence (`_splits_sequence`), as inputs or
    outputs of its ops; empty when none is."""
    nodes = {n.name: n for n in graph.nodes}
    found = []
    for choice in plan.nodes:
        if choice.name not in nodes:
            raise ValueError(f"plan node {choice.name!r} is not in the traced graph: plan and graph are of different models")
        if what := _splits_sequence(choice.strategy, _metas(graph, nodes[choice.name]), seq):
            found.append(f"{choice.name}: {what}")
    return found


@contextlib.contextmanager
def without_sequence_splits(seq: int) -> Iterator[None]:
    """While planning, every node's candidates less those that split a tensor along the sequence (`_splits_sequence`).

    The planner has no option for this: the call's candidate generator (`planner.planner.generate`) is wrapped for
    the call. Forbidding only the input's split is not enough: from 2,048 tokens the solver slices a whole input
    along the sequence at the first op."""
    import meshplan.planner.planner as planner

    original = planner.generate

    def generate(graph, mesh, **kwargs):
        cands = original(graph, mesh, **kwargs)
        nodes = {n.name: n for n in graph.nodes}
        for name, strategies in cands.by_node.items():
            kept = [s for s in strategies if not _splits_sequence(s, _metas(graph, nodes[name]), seq)]
            if not kept:
                raise ValueError(f"every candidate of {name} splits the sequence; e.g. {strategies[0]}")
            cands.by_node[name] = kept
        return cands

    planner.generate = generate
    try:
        yield
    finally:
        planner.generate = original


def plan_longest(kind: str, seq: int, world: int, cluster) -> Plan:
    """CP and Ulysses forced on a `cp` mesh (`make_plan`). Without sequence sharding: the default call, its search
    restricted to candidates that split no tensor along the sequence (`without_sequence_splits`; so no `cp` axis
    either), and the plan checked for it."""
    if kind != "no sequence sharding":
        return make_plan(kind, seq, world, cluster)
    model, tokens = build(seq)
    with warnings.catch_warnings(), without_sequence_splits(seq):
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, world, (tokens,), cluster=cluster)
    split = sequence_splits(plan, trace(model, (tokens,)), seq)
    if split:
        raise ValueError(f"the plan without sequence sharding splits {len(split)} tensors along the sequence at {seq} "
                         f"tokens, e.g. {split[:3]}")
    return plan


def longest_fitting(fits, kinds: tuple[str, ...], start: int, granule: int, limit: int) -> dict[str, tuple[int, int | None]]:
    """The longest length (a multiple of `granule`) each kind fits at, by doubling from `start` and then bisection.

    `fits({kind: length})` answers {kind: bool} for one round, every kind still searching at once (one launch of
    processes per round). Returns kind -> (longest length that fit, 0 if none; shortest that did not, None if every
    length up to `limit` fit). Assumes fitting is monotone in the length."""
    if start % granule or start <= 0 or limit < start:
        raise ValueError(f"start must be a positive multiple of granule ({granule}) at most limit ({limit}); got {start}")
    bounds: dict[str, list] = {k: [0, None] for k in kinds}  # [longest that fit, shortest that did not]

    def probe(lo: int, hi: int | None) -> int | None:
        if hi is None:
            nxt = 2 * lo if lo else start
            return nxt if nxt <= limit else None
        mid = (lo + hi) // 2 // granule * granule
        return mid if lo < mid < hi else None

    while todo := {k: n for k, (lo, hi) in bounds.items() if (n := probe(lo, hi)) is not None}:
        for kind, ok in fits(todo).items():
            bounds[kind][0 if ok else 1] = todo[kind]
    return {k: (lo, hi) for k, (lo, hi) in bounds.items()}


def largest_whole(plan: Plan, graph, top: int = 3) -> list[str]:
    """The `top` largest op outputs the plan splits on no mesh axis, as 'node (shape): MiB': what sharding leaves whole."""
    outputs = {n.name: n.outputs for n in graph.nodes}
    whole = [(meta.nbytes, f"{c.name} {tuple(meta.shape)}")
             for c in plan.nodes if c.name in outputs
             for meta, layout in zip(outputs[c.name], c.strategy.outputs)
             if meta is not None and layout is not None and not any(isinstance(p, Shard) for p in layout)]
    return [f"{name}: {b / 2**20:.1f} MiB" for b, name in sorted(whole, reverse=True)[:top]]


def longest(world: int, cluster, budget: int, start: int, granule: int, limit: int, warmup: int, steps: int) -> None:
    """`--longest`: the longest sequence each of `LONGEST_KINDS` trains at within `budget` bytes per rank (measured
    peak, the largest over ranks), then every kind's peak at the unsharded plan's longest length."""
    seen: dict[tuple[str, int], tuple[Plan, dict]] = {}  # (kind, seq) -> plan, measurement

    def run(todo: dict[str, int]) -> None:
        todo = {k: n for k, n in todo.items() if (k, n) not in seen}
        if not todo:
            return
        plans = {k: plan_longest(k, n, world, cluster) for k, n in todo.items()}
        t0 = time.perf_counter()
        got = run_local(world, measure, [p.to_json() for p in plans.values()], list(todo.values()), warmup, steps,
                        timeout=3600)[0]
        for (kind, seq), plan, m in zip(todo.items(), plans.values(), got):
            seen[kind, seq] = plan, m
            print(f"  {kind} at {seq}: measured {m['peak_bytes'] / 2**20:.1f} MiB (predicted "
                  f"{solver_memory(plan) / 2**20:.1f}), step {m['time_s'] * 1e3:.0f} ms (predicted "
                  f"{plan.step_time_s * 1e3:.0f}): {'fits' if m['peak_bytes'] <= budget else 'over'}", flush=True)
        print(f"  (round of {len(todo)} measured in {time.perf_counter() - t0:.0f} s; load average after it "
              f"{os.getloadavg()[0]:.1f}, {world} of it this run's ranks)", flush=True)

    def fits(todo: dict[str, int]) -> dict[str, bool]:
        run(todo)
        return {k: seen[k, n][1]["peak_bytes"] <= budget for k, n in todo.items()}

    found = longest_fitting(fits, LONGEST_KINDS, start, granule, limit)
    mib = 2**20

    def row(kind: str, seq: int, over: str = "") -> str:
        if not seq:
            return f"| {kind} | none | {over} |" + " |" * 8
        plan, m = seen[kind, seq]
        attn = {n.strategy.kernel or str(n.strategy) for n in plan.nodes if n.target == "aten.scaled_dot_product_attention.default"}
        ranks = " / ".join(f"{b / mib:.1f}" for b in m["rank_peaks"])
        return (f"| {kind} | {seq} | {over}{' | ' if over else ''}{plan.mesh} | {', '.join(sorted(attn))} | {m['peak_bytes'] / mib:.1f} | "
                f"{ranks} | {solver_memory(plan) / mib:.1f} | {plan.step_time_s * 1e3:.0f} | {m['time_s'] * 1e3:.0f} | "
                f"{plan.step_time_s / m['time_s'] - 1:+.0%} |")

    head = ("| strategy | seq | {}mesh | attention | measured peak MiB (max) | per rank | predicted MiB | predicted ms | "
            "measured ms | step error |\n|---|---:|{}---|---|---:|---|---:|---:|---:|---:|")
    print(f"\nLongest sequence within {budget / mib:g} MiB per rank (measured), {world} gloo ranks, multiples of {granule}:")
    print(head.format("shortest over | ", "---:|"))
    for kind, (lo, hi) in found.items():
        print(row(kind, lo, str(hi) if hi else f"none up to {limit}"))
    common = found["no sequence sharding"][0]
    if not common:
        print("the plan without sequence sharding fits at no length searched: no common length")
        return
    run({k: common for k in LONGEST_KINDS})
    # reference, not the baseline: the whole step on one process, where nothing divides the activations
    model, tokens = build(common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = meshplan.plan(model, 1, (tokens,), cluster=cluster)
    seen[ONE_RANK, common] = one, run_local(1, measure, [one.to_json()], [common], warmup, steps, timeout=3600)[0][0]
    print(f"\nAt {common} tokens (the unsharded plan's longest):")
    print(head.format("", ""))
    for kind in (*LONGEST_KINDS, ONE_RANK):
        print(row(kind, common))
    for base in ("no sequence sharding", ONE_RANK):
        for kind in (k for k in LONGEST_KINDS if k.startswith("cp")):
            ratio = seen[kind, common][1]["peak_bytes"] / seen[base, common][1]["peak_bytes"]
            target = f" (issue 29's target, at most 0.35: {'met' if ratio <= 0.35 else 'NOT met'})" if base != ONE_RANK else ""
            print(f"{kind} peak / {base} peak: measured {ratio:.3f}{target}, predicted "
                  f"{solver_memory(seen[kind, common][0]) / solver_memory(seen[base, common][0]):.3f}")
    graph = trace(model, (tokens,))
    for kind in (*LONGEST_KINDS, ONE_RANK):
        print(f"{kind} predicted memory: {seen[kind, common][0].memory}")
        if kind.startswith("cp"):
            print(f"  largest op outputs it holds whole on every rank: {'; '.join(largest_whole(seen[kind, common][0], graph))}")


BIG = {"Llama-3-8B": ("llama8b", 64, 8), "Llama-3-70B": ("llama70b", 256, 16)}
"""Title -> (benchmarks/big_models.py's case, H100s, sequences per step at 131,072 tokens)."""
LONGEST = 131_072


def plan_big(case: str, devices: int, batch: int, seq: int, token_order: str | None = None) -> tuple[Plan, float, int]:
    """The default call's plan for a Hugging Face Llama of big_models.py's `case` at `seq` tokens, its seconds and the
    model's parameters. `token_order`: 'on' (`token_order=True`), 'both' (the pipeline search in both orders,
    `PipelineOptions(token_order=None)`), or None (the default)."""
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
        kwargs = {"on": {"token_order": True}, "both": {"pipeline": meshplan.PipelineOptions(token_order=None)}}.get(token_order, {})
        plan = meshplan.plan(model, devices=devices, example_inputs=(tokens,), example_kwargs={"labels": tokens}, cluster="h100",
                             **kwargs)
    return plan, time.perf_counter() - t0, sum(p.numel() for p in model.parameters())


def big(seqs: list[int], token_order: str | None = None) -> None:
    from big_models import H100_BF16_PEAK

    print("| model | H100s | seq | sequences per step | stage sub-mesh | pp | cp | attention | predicted step s | MFU | MFU (6 N T) "
          "| peak GiB | planned in s |")
    print("|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for title, (case, devices, long_batch) in BIG.items():
        for seq in seqs:
            batch = long_batch * LONGEST // seq
            plan, seconds, params = plan_big(case, devices, batch, seq, token_order)
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
    ap.add_argument("--plans", nargs="+", choices=PLANS, default=PLANS, help="the plans measured (default: all)")
    ap.add_argument("--big", action="store_true", help="plan Llama-3-8B and 70B on 64 and 256 H100s only (module doc)")
    ap.add_argument("--token-order", choices=("on", "both"), default=None, help="--big: plan with token_order=True ('on': the "
                    "pipeline search's cp stage sub-meshes in head-tail token order) or search both orders ('both')")
    ap.add_argument("--longest", action="store_true", help="the longest sequence CP, Ulysses and the plan without sequence "
                    "sharding train at within --budget-mib per rank, measured (module doc)")
    ap.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB)
    ap.add_argument("--start", type=int, default=1024, help="--longest: the first length tried (then doubled)")
    ap.add_argument("--granule", type=int, default=256, help="--longest: lengths searched are its multiples")
    ap.add_argument("--limit", type=int, default=1 << 17, help="--longest: the longest length tried")
    args = ap.parse_args()
    if args.big:
        big(args.seq or [LONGEST, 2048], args.token_order)
        return 0
    cluster = cluster_of(resolve_profile(args.profile, None))
    if args.longest:
        if args.granule % (2 * args.world) or args.budget_mib <= 0:
            raise ValueError(f"--granule must be a multiple of 2 x --world ({2 * args.world}) and --budget-mib positive; "
                             f"got {args.granule} and {args.budget_mib}")
        print(f"world {args.world} gloo ranks, planned from {args.profile}, budget {args.budget_mib:g} MiB per rank")
        longest(args.world, cluster, int(args.budget_mib * 2**20), args.start, args.granule, args.limit, args.warmup, args.steps)
        return 0
    args.seq = args.seq or [2048, 4096]
    print(f"world {args.world} gloo ranks, planned from {args.profile}")
    print("| seq | plan | mesh | attention | predicted ms | measured ms | error | predicted MiB | measured MiB |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        plans = [make_plan(kind, seq, args.world, cluster) for kind in args.plans]
        got = run_local(args.world, measure, [p.to_json() for p in plans], [seq] * len(plans), args.warmup, args.steps,
                        timeout=3600)[0]
        for kind, plan, m in zip(args.plans, plans, got):
            attn = {n.strategy.kernel or str(n.strategy) for n in plan.nodes if n.target == "aten.scaled_dot_product_attention.default"}
            err = plan.step_time_s / m["time_s"] - 1
            print(f"| {seq} | {kind} | {plan.mesh} | {', '.join(sorted(attn))} | {plan.step_time_s * 1e3:.1f} | "
                  f"{m['time_s'] * 1e3:.1f} | {err:+.0%} | {solver_memory(plan) / 2**20:.1f} | {m['peak_bytes'] / 2**20:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
