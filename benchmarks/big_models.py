"""Plan the big models as users run them: bf16 by default, Hugging Face classes, real batches (issue 15).

    python benchmarks/big_models.py [--only gpt3|llama70b|llama8b]

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
"""

from __future__ import annotations

import argparse
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


def run(case: str) -> None:
    title, _, devices, batch, seq = CASES[case]
    model, tokens = build(case)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the loss inside, as a user of a Hugging Face class trains: labels= makes the model return its loss
        plan = meshplan.plan(model, devices=devices, example_inputs=(tokens,), example_kwargs={"labels": tokens}, cluster="h100")
    seconds = time.perf_counter() - t0
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(CASES))
    args = ap.parse_args()
    for case in [args.only] if args.only else list(CASES):
        run(case)


if __name__ == "__main__":
    main()
