"""Plan the big models as users run them: bf16 by default, Hugging Face classes, real batches (issue 15).

    python benchmarks/big_models.py [--only gpt3|llama70b|llama8b] [--runs 3 --against /path/to/checkout]

Each model is a Hugging Face class built in fp32 on the meta device (nothing is allocated) and
planned with the default call `meshplan.plan(model, devices=N, example_inputs, cluster="h100")`:
mixed precision is left at its default, which is bf16 on the H100 preset, and pipeline stages are
searched because the devices span more than one 8-GPU node (`pipeline="multi_node"`, the default).

Printed per model: the plan's mesh and pipeline, predicted step time, peak memory, the two MFU
figures and the per-GPU throughput, next to Megatron-LM's published figure:
- MFU (6 N T) = 6 x parameters x tokens per step / (devices x bf16 peak x step time), the issue's
  definition (no attention FLOPs);
- the plan's own MFU (`Plan.mfu`): the graph's matmul and attention FLOPs x 3, Megatron's
  "model FLOPs" (Narayanan et al. 2021), which is what Megatron's TFLOP/s per GPU counts.

These are predictions of meshplan's cost model under the H100 presets, not measurements.

`--against PATH` then times the same call with the meshplan of another checkout (such as `git worktree add /tmp/base
afd3778`, the code before issue 27), `--runs` times each, every run in a fresh process, the two interleaved (which
goes first alternates), and prints both medians and their ratio (issue 27's target: at most 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import transformers as tf

import meshplan

H100_BF16_PEAK = 989e12

CASES = {
    # name: (title, config, devices, batch, sequence)
    "gpt3": ("GPT-3 175B (GPT2LMHeadModel)", lambda: tf.GPT2Config(
        vocab_size=51200, n_positions=2048, n_embd=12288, n_layer=96, n_head=96, tie_word_embeddings=True), 1024, 1536, 2048),
    "llama70b": ("Llama-3-70B (LlamaForCausalLM)", lambda: tf.LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False), 256, 256, 8192),
    "llama8b": ("Llama-3-8B (LlamaForCausalLM)", lambda: tf.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False), 64, 64, 8192),
}

BUDGET_GIB = 80
"""The H100 preset's memory per device: what every stage's peak must stay within."""
MEGATRON = 0.47
"""Megatron-LM's published figure for its nearest configurations: its README reports up to 47 % MFU on
H100 clusters over its weak-scaling runs (GPT models of 2B to 462B parameters), 47 % for GPT-3 175B.
The Llama-3 sizes fall inside that range; no separate Llama-3 figure is published there."""


def build(case: str):
    _, config, _, batch, seq = CASES[case]
    cfg = config()
    cfg.use_cache = False
    model_cls = tf.GPT2LMHeadModel if isinstance(cfg, tf.GPT2Config) else tf.LlamaForCausalLM
    with torch.device("meta"):
        model = model_cls(cfg)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, tokens


def planned(case: str):
    """(model, the default call's plan, its seconds)."""
    model, tokens = build(case)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the loss inside, as a user of a Hugging Face class trains: labels= makes the model return its loss
        plan = meshplan.plan(model, devices=CASES[case][2], example_inputs=(tokens,), example_kwargs={"labels": tokens}, cluster="h100")
    return model, plan, time.perf_counter() - t0


def run(case: str) -> None:
    title, _, devices, batch, seq = CASES[case]
    model, plan, seconds = planned(case)
    params = sum(p.numel() for p in model.parameters())
    step = plan.step_time_s
    mfu_6nt = 6 * params * batch * seq / (devices * H100_BF16_PEAK * step)
    per_gpu = plan.model_flops / step / devices / 1e12
    pipe = plan.pipeline
    shape = f"mesh {plan.mesh}" + (f" x pp {pipe.degree} ({pipe.schedule}, {pipe.microbatches} microbatches)" if pipe else "")
    print(f"{title}: {params / 1e9:.1f}B parameters, {devices} H100s, batch {batch} x {seq} tokens")
    print(f"  plan: {shape}; precision {plan.precision.name if plan.precision else 'fp32'}; planned in {seconds:.1f} s")
    print(f"  predicted step {step:.2f} s, peak memory per device {plan.memory.total / 2**30:.1f} GiB (the fullest rank's, walked)")
    if pipe:
        print(f"  searched step {pipe.searched_step_s:.2f} s (the stage profiles' price); returned stage plan priced at {step:.2f} s "
              f"(x{step / pipe.searched_step_s:.3f})")
        print("  stage peaks: " + ", ".join(f"stage {s.index} {s.memory.total / 2**30:.1f} GiB" for s in pipe.stages)
              + f"; all within {BUDGET_GIB} GiB: {all(s.memory.total <= BUDGET_GIB * 2**30 for s in pipe.stages)}")
        for reason in plan.solver.skipped:
            print(f"  also priced: {reason}")
    if pipe:
        print(f"  bubble {pipe.bubble_fraction:.1%} of the step; one microbatch of the whole model on a stage's sub-mesh: compute "
              f"{plan.compute_s * 1e3:.0f} ms + communication {plan.comm_s * 1e3:.0f} ms ({plan.comm_s / (plan.compute_s + plan.comm_s):.0%})")
    print(f"  MFU (6 N T) {mfu_6nt:.1%}; plan MFU (model FLOPs incl. attention) {plan.mfu:.1%} = {per_gpu:.0f} TFLOP/s per GPU")
    print(f"  Megatron-LM on H100 (README, nearest configurations): {MEGATRON:.0%} MFU; ours / theirs = {plan.mfu / MEGATRON:.2f}")


def timed(case: str, checkout: str | None) -> float:
    """Seconds of the default call in a fresh process, with the meshplan of `checkout` (None: this one)."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.path.abspath(checkout)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--only", case, "--seconds"], env=env, cwd="/", check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["seconds"]


def compare(case: str, runs: int, against: str) -> None:
    seconds: dict[str | None, list[float]] = {None: [], against: []}
    for r in range(runs):
        for checkout in (None, against) if r % 2 == 0 else (against, None):
            seconds[checkout].append(timed(case, checkout))
    new, old = (statistics.median(seconds[k]) for k in (None, against))
    shown = {k: ", ".join(f"{x:.1f}" for x in v) for k, v in seconds.items()}
    print(f"  planning, medians of {runs} runs in fresh processes, interleaved: {new:.1f} s ({shown[None]}) against {old:.1f} s "
          f"({shown[against]}) with {against}: {new / old:.2f}x (target <= 1.5x: {'met' if new <= 1.5 * old else 'not met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--runs", type=int, default=3, help="timed runs per checkout with --against")
    ap.add_argument("--against", help="a checkout of meshplan (its repository root) to time the same calls with")
    ap.add_argument("--seconds", action="store_true", help="plan only and print the seconds as JSON (what --against runs)")
    args = ap.parse_args()
    for case in [args.only] if args.only else list(CASES):
        if args.seconds:
            print(json.dumps({"seconds": planned(case)[2]}))
            continue
        run(case)
        if args.against:
            compare(case, args.runs, args.against)


if __name__ == "__main__":
    main()
