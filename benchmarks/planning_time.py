"""Planning time of the default calls users make on big models (issue 16's targets).

    python benchmarks/planning_time.py [--runs 3] [--only gpt3 llama70b ...]

Every case is `meshplan.plan(model, devices, (tokens,), cluster="h100")` with nothing else: mixed
precision, the mesh search and the pipeline rule (stages searched when the devices span more than
one node) at their defaults. The models are Hugging Face classes (and meshplan's own Llama and GPT for
the cases of the older fixed-mesh table) built on the meta device at a real batch: nothing is
allocated and no process group is needed.

`--zoo` instead times the default call on the small models of benchmarks/mesh_search.py at 8 and 64
devices, next to the same call without pipelines.

Printed per case, medians over `--runs`: total seconds next to the target, then the seconds of each
part of planning (`meshplan.progress.collect`): trace, candidates (strategy generation), tables
(costing), solve, and the rest ("search": the pipeline and mesh searches' own work and the plans'
bookkeeping); then the plan's mesh, pipeline and predicted step. The runs are interleaved (one run of
every case, then the next round, in reverse order every other round), so cases read side by side saw
the same load on the machine. With both `own_llama8b` and `own_llama8b_dict` (the same model with its
blocks in an `nn.ModuleDict`, as torchtitan keeps them) a last line compares their traces and plans.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
import transformers as tf

import meshplan
from meshplan.models import GPT, GPTConfig, Llama, LlamaConfig
from meshplan.progress import collect

PARTS = ("trace", "candidates", "tables", "solve")

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False)
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False)
GPT3_175B = dict(vocab_size=51200, n_positions=2048, n_embd=12288, n_layer=96, n_head=96, tie_word_embeddings=True, use_cache=False)


def hf(model_cls, config_cls, config: dict, batch: int, seq: int):
    def build():
        with torch.device("meta"):
            model = model_cls(config_cls(**config))
        return model, torch.zeros(batch, seq, dtype=torch.long, device="meta")

    return build


def own(model_cls, config, batch: int):
    def build():
        with torch.device("meta"):
            model = model_cls(config)
        return model, torch.zeros(batch, config.seq_len, dtype=torch.long, device="meta")

    return build


CASES = {
    # name: (title, builder, devices, target seconds)
    "gpt3": ("GPT-3 175B (GPT2LMHeadModel), batch 1536 x 2048", hf(tf.GPT2LMHeadModel, tf.GPT2Config, GPT3_175B, 1536, 2048), 1024, 30.0),
    "llama70b": ("Llama-3-70B (LlamaForCausalLM), batch 256 x 8192", hf(tf.LlamaForCausalLM, tf.LlamaConfig, LLAMA3_70B, 256, 8192), 256, 20.0),
    "llama8b": ("Llama-3-8B (LlamaForCausalLM), batch 16 x 2048", hf(tf.LlamaForCausalLM, tf.LlamaConfig, LLAMA3_8B, 16, 2048), (8, 8), 5.0),
    "llama8b_64": ("Llama-3-8B (LlamaForCausalLM), batch 64 x 8192", hf(tf.LlamaForCausalLM, tf.LlamaConfig, LLAMA3_8B, 64, 8192), 64, 60.0),
    "own_llama8b": ("meshplan Llama, Llama-3-8B shape, batch 8 x 2048", own(Llama, LlamaConfig(
        vocab_size=128256, seq_len=2048, hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32), 8), (8, 8), 60.0),
    "own_llama8b_dict": ("meshplan Llama, blocks in an nn.ModuleDict, Llama-3-8B shape, batch 8 x 2048", own(Llama, LlamaConfig(
        vocab_size=128256, seq_len=2048, hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32, module_dict=True), 8),
        (8, 8), 60.0),
    "own_gpt3": ("meshplan GPT, GPT-3 175B shape, batch 128 x 2048", own(GPT, GPTConfig(
        vocab_size=51200, seq_len=2048, hidden=12288, heads=96, layers=96), 128), 1024, 60.0),
}


@dataclass(slots=True)
class Runs:
    totals: list[float] = field(default_factory=list)
    parts: list[dict[str, float]] = field(default_factory=list)
    plan: object = None

    def median(self, part: str) -> float:
        return statistics.median(s.get(part, 0.0) for s in self.parts)


def run(case: str, runs: Runs) -> None:
    """One planning call of `case`, added to `runs`."""
    _, build, devices, _ = CASES[case]
    model, tokens = build()
    gc.collect()  # the earlier runs' graphs: collected here, not inside whichever trace crosses the collector's threshold
    with collect() as seconds, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        runs.plan = meshplan.plan(model, devices, (tokens,), cluster="h100")
        runs.totals.append(time.perf_counter() - t0)
    runs.parts.append(seconds)


def report(case: str, runs: Runs) -> None:
    title, _, devices, target = CASES[case]
    totals, parts, plan = runs.totals, runs.parts, runs.plan
    total = statistics.median(totals)
    split = {p: runs.median(p) for p in PARTS}
    search = statistics.median(t - sum(s.get(p, 0.0) for p in PARTS) for t, s in zip(totals, parts))
    pipe = plan.pipeline
    shape = f"mesh {plan.mesh}" + (f" x pp {pipe.degree} ({pipe.schedule}, {pipe.microbatches} microbatches)" if pipe else "")
    print(f"{title}, devices={devices}: {total:.1f} s (median of {len(totals)}: {', '.join(f'{t:.1f}' for t in totals)}); "
          f"target {target:.0f} s -> {total / target:.2f}x ({'met' if total <= target else 'NOT met'})")
    print("  " + ", ".join(f"{p} {split[p]:.1f} s" for p in PARTS) + f", search {search:.1f} s")
    print(f"  plan: {shape}, {plan.precision.name if plan.precision else 'fp32'}, predicted step {plan.step_time_s:.3f} s, "
          f"solver {plan.solver.status}")


def compare_containers(as_list: Runs, as_dict: Runs) -> None:
    """The trace time of the ModuleDict form against the ModuleList form's, and whether their plans agree."""
    def traces(r: Runs) -> str:
        each = ", ".join(f"{s.get('trace', 0.0):.2f}" for s in r.parts)
        return f"{r.median('trace'):.2f} s ({each})"

    same = as_dict.plan.hash() == as_list.plan.hash()
    print(f"blocks in an nn.ModuleDict vs an nn.ModuleList (meshplan Llama, Llama-3-8B shape, (8, 8)): trace {traces(as_dict)} vs "
          f"{traces(as_list)}, medians; plans {'identical' if same else 'DIFFER'} (predicted step {as_dict.plan.step_time_s:.4f} vs "
          f"{as_list.plan.step_time_s:.4f} s)")


def zoo(devices: list[int]) -> None:
    """The default call on every model of benchmarks/mesh_search.py (cluster 'cpu', as there), next to the
    same call with `pipeline=None`: seconds and predicted step of each, and which is faster."""
    from mesh_search import MODELS, _unpack

    print(f"{'model':13s} {'dev':>3s} {'default s':>9s} {'plan':34s} {'step ms':>9s} | {'pipeline=None s':>15s} {'mesh':12s} {'step ms':>9s}")
    slowest = 0.0
    for n in devices:
        for name, build in MODELS.items():
            row = []
            for pipeline in ("multi_node", None):
                model, inputs, kwargs = _unpack(build())
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    plan = meshplan.plan(model, n, inputs, example_kwargs=kwargs, cluster="cpu", pipeline=pipeline)
                    row.append((time.perf_counter() - t0, plan))
            (s1, p1), (s2, p2) = row
            slowest = max(slowest, s1)
            shape = f"{p1.mesh.shape}" + (f" pp {p1.pipeline.degree} {p1.pipeline.schedule}" if p1.pipeline else "")
            print(f"{name:13s} {n:3d} {s1:9.1f} {shape:34s} {p1.step_time_s * 1e3:9.3f} | {s2:15.1f} {str(p2.mesh.shape):12s} "
                  f"{p2.step_time_s * 1e3:9.3f}", flush=True)
    print(f"slowest default call: {slowest:.1f} s (target <= 60 s): {'met' if slowest <= 60 else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=sorted(CASES))
    ap.add_argument("--zoo", type=int, nargs="*", metavar="DEVICES",
                    help="instead: the default call on benchmarks/mesh_search.py's models at these device counts (default 8 64)")
    args = ap.parse_args()
    if args.zoo is not None:
        zoo(args.zoo or [8, 64])
        return
    cases = args.only or list(CASES)
    runs = {case: Runs() for case in cases}
    for r in range(args.runs):
        for case in cases if r % 2 == 0 else cases[::-1]:  # A B, B A, A B: no case always runs first in its round
            run(case, runs[case])
    for case in cases:
        report(case, runs[case])
    if "own_llama8b" in runs and "own_llama8b_dict" in runs:
        compare_containers(runs["own_llama8b"], runs["own_llama8b_dict"])


if __name__ == "__main__":
    main()
