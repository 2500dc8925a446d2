"""Context-parallel attention's per-rank compute on one GPU: each rank's blocks against the pricing (issue 29).

    python benchmarks/gpu_cp_blocks.py --out DIR      # on a CUDA machine (benchmarks/gpu_run.sh runs it)
    python benchmarks/gpu_cp_blocks.py --device cpu --seq 1024 --heads 4 --kv-heads 2   # the same on this CPU, small

Without the blocks timed in its profile (`ContextParallel.timed_work`), the planner prices a context-parallel
kernel's attention on its busiest rank as the fraction of the whole causal attention's query-key pairs that rank
computes (`regions/context_parallel.causal_pairs`): (2P-1)/P of the average
for the contiguous split (ring, allgather), the average (1/P) when balanced. Here every rank's blocks of a
Llama-3-8B-shaped attention layer (32 query heads, 8 KV heads, head dim 128, bf16) run forward and backward on one
device as that rank runs them (`context_parallel.rank_attention`, what the op profiler times for the busiest rank;
no collectives), timed alone, against one SDPA over the whole sequence. The ratio measured / priced says
how much splitting one fused kernel into per-block calls and merging them by log-sum-exp costs. On CUDA the blocks
run on the kernel SDPA picks (`attention_blocks.cuda_kernel`) and on each of flash and cuDNN forced; one SDPA over the
whole sequence is timed on each backend too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshplan.regions import attention_blocks
from meshplan.regions.attention_blocks import SEQ, repeat_heads
from meshplan.regions.context_parallel import balanced_chunks, causal_pairs, rank_attention

LAYOUTS = ("ring", "ring_balanced", "allgather", "balanced")
FORCED = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
"""CUDA kernels the blocks are also timed on, forced, with the SDPA backend of the same kernel."""


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() (forward and backward) over `repeats` runs after 2 warm-ups."""
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device: torch.device, dtype: torch.dtype, seq: int, heads: int, kv_heads: int, head_dim: int,
            ranks_list: list[int], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, seq, head_dim, generator=gen).to(device, dtype).requires_grad_() for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, heads, seq, head_dim, generator=gen).to(device, dtype)

    def whole():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    full = timed(whole, device, repeats)
    chosen = attention_blocks.cuda_kernel(q, k, v, True) if device.type == "cuda" else "cpu flash"
    # the blocks repeat the KV heads, and SDPA may pick another kernel for those shapes than for the whole (GQA) call
    per_block = attention_blocks.cuda_kernel(q, *(repeat_heads(x, heads) for x in (k, v)), True) if device.type == "cuda" else chosen
    whole_by_backend = {}
    kernels = {f"SDPA's pick ({per_block})": None}
    if device.type == "cuda":
        for name, backend in FORCED.items():
            try:
                with sdpa_kernel([backend]):
                    whole_by_backend[name] = timed(whole, device, repeats)
            except RuntimeError as e:  # a backend that does not take these shapes
                whole_by_backend[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            kernels[name] = name
    rows_out = []
    original = attention_blocks.cuda_kernel
    for label, forced in kernels.items():
        if forced is not None:
            attention_blocks.cuda_kernel = lambda q, k, v, causal, forced=forced: forced
        try:
            for ranks in ranks_list:
                rows = seq // ranks
                total_pairs = seq * (seq + 1) // 2
                for layout in LAYOUTS:
                    per_rank = []
                    for rank in range(ranks):
                        size = rows // 2 if layout.endswith("balanced") else rows
                        starts = [j * size for j in balanced_chunks(rank, ranks)] if layout.endswith("balanced") else [rank * rows]
                        g = torch.cat([grad.narrow(SEQ, s, size) for s in starts], dim=SEQ)
                        per_rank.append(timed(lambda: rank_attention(layout, q, k, v, rank, ranks, True).backward(g), device, repeats))
                    priced = full * causal_pairs(layout, ranks, rows) / total_pairs
                    rows_out.append({"kernel": label, "ranks": ranks, "layout": layout, "busiest_s": max(per_rank),
                                     "per_rank_s": per_rank, "priced_s": priced, "measured_over_priced": max(per_rank) / priced})
        finally:
            attention_blocks.cuda_kernel = original
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "dtype": str(dtype).replace("torch.", ""), "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "whole_sdpa_s": full, "whole_sdpa_kernel": chosen, "whole_sdpa_by_backend_s": whole_by_backend,
            "repeats": repeats, "rows": rows_out}


class CausalAttention(torch.nn.Module):
    """One causal SDPA, the op the profiler's context-parallel timings are keyed by."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def profiler_check(device: torch.device, dtype: torch.dtype, seq: int, heads: int, head_dim: int, ranks: int) -> dict:
    """The profiler's own timing of each block kernel's busiest rank (`time_region_kernels`, what a profile measured on
    this device prices the kernels with) for one causal SDPA with the KV heads repeated to the query heads (as
    meshplan's and Hugging Face's Llama call it), traced on meta tensors: forward + backward seconds by kernel."""
    from meshplan.ir.mesh import CP_AXIS, MeshSpec
    from meshplan.ir.trace import trace
    from meshplan.profiling.calibrate import time_region_kernels

    metas = [torch.empty(1, heads, seq, head_dim, dtype=dtype, device="meta") for _ in range(3)]
    timings = time_region_kernels(trace(CausalAttention(), tuple(metas)), [MeshSpec((ranks,), (CP_AXIS,))], device=device)
    return {key.split("[")[1].split(" of ")[0]: t.forward_s + t.backward_s for key, t in timings.items()}


def markdown(r: dict) -> str:
    lines = [f"# Context-parallel blocks on {r['device']} (torch {r['torch']}, {r['dtype']})", "",
             f"One causal attention layer, sequence {r['seq']}, {r['heads']} query / {r['kv_heads']} KV heads of {r['head_dim']}: "
             f"one SDPA forward and backward {r['whole_sdpa_s'] * 1e3:.2f} ms on {r['whole_sdpa_kernel']} (median of {r['repeats']})"
             + "".join(f"; forced {name}: " + (f"{t * 1e3:.2f} ms" if isinstance(t, float) else t)
                       for name, t in r["whole_sdpa_by_backend_s"].items()) + ".", "",
             "| blocks on | ranks | kernel | busiest rank, measured | priced (pairs share of one SDPA) | measured / priced | each rank (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        each = " ".join(f"{t * 1e3:.2f}" for t in x["per_rank_s"])
        lines.append(f"| {x['kernel']} | {x['ranks']} | {x['layout']} | {x['busiest_s'] * 1e3:.2f} ms | {x['priced_s'] * 1e3:.2f} ms | "
                     f"{x['measured_over_priced']:.2f} | {each} |")
    if r.get("profiler"):
        lines += ["", f"The profiler's timing of the busiest rank (`time_region_kernels`, {r['profiler_ranks']} ranks, KV heads repeated): "
                  + "; ".join(f"{k} {t * 1e3:.2f} ms" for k, t in r["profiler"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write cp_blocks-<device>.json and .md here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu")
    if any(args.seq % (2 * p) for p in args.ranks):
        raise SystemExit(f"--seq {args.seq} must divide into 2 x each of --ranks {args.ranks}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = measure(device, dtype, args.seq, args.heads, args.kv_heads, args.head_dim, args.ranks, args.repeats)
    report["profiler_ranks"] = args.ranks[0]
    report["profiler"] = profiler_check(device, dtype, args.seq, args.heads, args.head_dim, args.ranks[0])
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"cp_blocks-{report['device'].replace(' ', '_')}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        stem.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
