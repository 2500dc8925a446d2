"""Peak memory per rank while a model bigger than a rank's share sets up: meta device + safetensors
slices, and meta device + the model's own initialisation.

    python benchmarks/meta_load_memory.py [--hidden 2048] [--layers 8] [--ranks 4]

A GPT of ~1.9 GB in fp32 (hidden 2048, 8 layers, vocabulary 32000) is saved once as safetensors
(the parent process builds and saves it, then frees it). Then `--ranks` gloo processes each build
the model on the meta device and call `auto_parallelize` with an FSDP-style plan (every parameter
stored sharded on every rank), once with `weights=` the file and once from the model's own
`reset_parameters()`. Each rank reports its resident memory before setup (torch imported, the
process group up), its peak during setup (`ru_maxrss`, measured in a fresh process per source so
one source's peak does not hide the other's), and the bytes of its shards. A rank that held the
whole model would peak at least the model's size above its starting point.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout

import torch

import meshplan
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.launch import run_local

MB = 2**20


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def worker(rank: int, world: int, cfg: GPTConfig, source: str) -> dict:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    tokens = torch.zeros(world, cfg.seq_len, dtype=torch.long)
    before = rss_mb()
    with torch.device("meta"):
        model = GPT(cfg)
    t0 = time.perf_counter()
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), mesh_shape=(world,),
                                       param_layouts={"*": "S(0)"}, weights=None if source == "init" else source)
    seconds = time.perf_counter() - t0
    shards = sum(v.to_local().numel() * v.element_size() for v in pmodel.state_dict().values()) / MB
    return {"before": before, "peak": peak_mb(), "shards": shards, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=128, hidden=args.hidden, heads=16, layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        model = GPT(cfg)
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
        total = sum(v.numel() * v.element_size() for v in state.values()) / MB
        save_file(state, path)
        del model, state
        print(f"GPT hidden {cfg.hidden}, {cfg.layers} layers, vocabulary {cfg.vocab_size}: {total:,.0f} MB in fp32, saved in "
              f"{time.perf_counter() - t0:.1f} s; {args.ranks} ranks, every parameter stored sharded (S(0))")
        print(f"{'source':<14}{'rank':>5}{'RSS before MB':>15}{'peak MB':>10}{'peak - before':>15}{'shards MB':>11}{'setup s':>9}")
        for source, label in ((path, "safetensors"), ("init", "own init")):
            for rank, r in enumerate(run_local(args.ranks, worker, cfg, source, timeout=1800)):
                print(f"{label:<14}{rank:>5}{r['before']:>15,.0f}{r['peak']:>10,.0f}{r['peak'] - r['before']:>15,.0f}"
                      f"{r['shards']:>11,.0f}{r['seconds']:>9.1f}")
        print(f"(the whole model is {total:,.0f} MB; a rank's share is {total / args.ranks:,.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
