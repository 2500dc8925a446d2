"""The exact ILP against greedy propagation (`search="ilp"` / `"propagation"`): docs/modes.md's table.

    python benchmarks/search_modes.py

For each model, mesh and set of annotations, both searches plan the same call (cluster "cpu",
the tests' models and batches: 8 samples, 16 tokens). Printed per search: the objective the search
minimised, the plan's predicted step (which prices gradient all-reduces in buckets, so it differs
from the objective by the same term for both) and the wall time of the call, trace included.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch  # noqa: E402

import meshplan  # noqa: E402
from meshplan.models import GPT, MLP, GPTConfig, Llama, LlamaConfig  # noqa: E402

MLP_MEGATRON = {"layers.0.weight": "S(0)", "layers.0.bias": "S(0)", "layers.1.weight": "S(1)", "layers.1.bias": "R",
                "layers.2.weight": "R", "layers.2.bias": "R"}
LLAMA_MEGATRON = {f"*.{p}.weight": "S(0)" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")} | {
    f"*.{p}.weight": "S(1)" for p in ("o_proj", "down_proj")} | {
    p: "R" for p in ("embed.weight", "*.input_norm.weight", "*.post_attn_norm.weight", "norm.weight", "lm_head.weight")}
LLAMA_PATTERNS = {f"layers.*.attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")} | {
    "layers.*.attn.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise"}


def model(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), torch.randn(8, 32)
    net = GPT(GPTConfig()) if name == "gpt" else Llama(LlamaConfig())
    return net, torch.randint(0, 128, (8, 16))


CASES = [
    # (row title, model, mesh, plan keywords)
    ("MLP, (2,), manual Megatron", "mlp", (2,), {"mode": "manual", "parameter_plan": MLP_MEGATRON, "input_layouts": {"x": "R"}}),
    ("GPT 2 layers, (4,), auto, none", "gpt", (4,), {}),
    ("GPT 2 layers, (2, 2), auto, none", "gpt", (2, 2), {}),
    ("Llama 2 layers, (4,), semi_auto, Megatron name patterns", "llama", (4,),
     {"mode": "semi_auto", "parallelize_plan": LLAMA_PATTERNS, "input_layouts": {"tokens": "R"}}),
    ("Llama 2 layers, (4,), manual Megatron", "llama", (4,),
     {"mode": "manual", "parameter_plan": LLAMA_MEGATRON, "input_layouts": {"tokens": "R"}}),
]


def main() -> None:
    print("| model, mesh, annotations | ILP | propagation |")
    print("|---|---|---|")
    for title, name, mesh, kw in CASES:
        cells = []
        for search in ("ilp", "propagation"):
            net, x = model(name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                plan = meshplan.plan(net, int(torch.tensor(mesh).prod()), (x,), mesh_shape=mesh, cluster="cpu", search=search, **kw)
                seconds = time.perf_counter() - t0
            cells.append((plan.solver.objective_s * 1e3, plan.step_time_s * 1e3, seconds))
        (io, ip, it), (po, pp, pt) = cells
        same = " (equal)" if abs(io - po) <= 1e-9 * max(io, 1e-12) else ""
        print(f"| {title} | {io:.2f} / {ip:.2f} ms, {it:.1f} s | {po:.2f} / {pp:.2f} ms{same}, {pt:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
