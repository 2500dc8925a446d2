"""Derived traces against fresh ones on every model of the mesh-search zoo (ir/rebatch.py).

    python benchmarks/rebatch_zoo.py [--only hf_llama mixtral]

For each model of `benchmarks/mesh_search.py` (meshplan's own, ResNet with batch norm, Mixtral, Hugging Face GPT-2,
Llama, BERT, T5, ViT and RWKV), its example call widened to a batch of 8 and traced at 1, 2, 4 and 8 samples (the
pipeline search's `microbatch_call` slices), and for each pair of traced sizes and target size below, whether the
trace `rebatched` derives is the fresh trace (IR nodes, the program's code, every node's `val` shape and strides
equal: EQUAL), is something else (WRONG: a bug) or is refused (None: the pipeline search exports that size).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from meshplan.ir.rebatch import rebatched  # noqa: E402
from meshplan.ir.trace import trace  # noqa: E402
from meshplan.planner.pipeline import microbatch_call  # noqa: E402

SIZES = (1, 2, 4, 8)
DERIVED = ((1, 2, 4), (1, 2, 8), (2, 4, 8), (4, 8, 2), (2, 8, 4))
"""(traced size a, traced size b, size derived)"""


def program_vals(graph) -> list:
    """Every program node's `val` meta as (shape, stride, dtype)."""
    out = []
    for n in graph.fx.gm.graph.nodes:
        v = n.meta.get("val")
        leaves = v if isinstance(v, (tuple, list)) else [v]
        out.append(tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves))
    return out


def verdict(derived, fresh) -> str:
    if derived is None:
        return "refused"
    same = derived.nodes == fresh.nodes and derived.fx.gm.code == fresh.fx.gm.code and program_vals(derived) == program_vals(fresh)
    return "EQUAL" if same else "WRONG"


def widened(inputs: tuple, kwargs: dict, batch: int) -> tuple[tuple, dict]:
    """The call with every batch-sized tensor repeated up to `batch` samples."""
    first = int(inputs[0].shape[0])
    reps = -(-batch // first)
    return pytree.tree_map_only(torch.Tensor, lambda x: torch.cat([x] * reps)[:batch] if x.dim() and x.shape[0] == first else x,
                                (inputs, kwargs))


def main(argv: list[str] | None = None) -> int:
    from mesh_search import MODELS, _unpack  # the zoo (benchmarks/ is on the path of a script run from it)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(MODELS))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    print("| model | " + " | ".join(f"{a}, {b} -> {n}" for a, b, n in DERIVED) + " |")
    print("|---|" + "---|" * len(DERIVED))
    wrong = 0
    for name in args.only or MODELS:
        model, inputs, kwargs = _unpack(MODELS[name]())
        inputs, kwargs = widened(inputs, kwargs or {}, max(SIZES))
        traced = {n: trace(model, *microbatch_call(inputs, kwargs, n)) for n in SIZES}
        cells = [verdict(rebatched(traced[a], a, traced[b], b, n), traced[n]) for a, b, n in DERIVED]
        wrong += cells.count("WRONG")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
