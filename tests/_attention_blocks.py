"""What each rank of a context-parallel kernel computes, simulated for P ranks on one device, against plain SDPA.

The kernels' per-rank math without their collectives (`regions/context_parallel.py`), as `rank_attention` computes
it for the profiler: with the sequence split into P chunks of L rows, rank r's query rows go against
- `ring`: every rank's key/value chunk in the order the ring brings them, each attended to as `_segments` says (its
  own a causal diagonal under a causal mask; earlier ranks' whole; later ranks' skipped), merged by log-sum-exp;
- `ring_balanced`: the same for query chunks 2r and 2P-1-2r of 2P (`balanced_chunks`), each merged on its own;
- `allgather`: the gathered keys, the r*L before its rows whole and the next L a causal diagonal (`_attend`);
- `balanced`: query chunks 2r and 2P-1-2r of 2P against the gathered keys (`balanced_chunks`, `_attend`).
The outputs of the P ranks, put back in sequence order, and the gradients of q, k and v through them must equal
plain SDPA's. Grouped-query heads (4 query, 2 key/value heads) are repeated per block as the kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshplan.regions.attention_blocks import SEQ
from meshplan.regions.context_parallel import BALANCED, balanced_chunks, rank_attention

LAYOUTS = ("ring", "ring_balanced", "allgather", "balanced")
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}
"""Against SDPA in fp32 on the same (rounded) inputs; a gradient's atol is scaled by its largest element. Measured
on the CPU (2 x 4 heads x 256 x 64, 4 ranks): fp32 errors up to 1.4e-6; bf16 up to 8e-3 in the output and 0.8 % of
the largest element in gradients, as plain bf16 SDPA's own errors there (a block left out errs by 0.1 to 1)."""


def simulate(layout: str, q, k, v, ranks: int, causal: bool, scale=None) -> torch.Tensor:
    """The whole attention output, each rank's rows computed as kernel `layout` computes them (`rank_attention`)."""
    size = q.shape[SEQ] // ranks // (2 if layout in BALANCED else 1)
    chunks = {}  # chunk start -> its output
    for r in range(ranks):
        out = rank_attention(layout, q, k, v, r, ranks, causal, scale)
        starts = [j * size for j in balanced_chunks(r, ranks)] if layout in BALANCED else [r * size]
        chunks.update({start: out.narrow(SEQ, i * size, size) for i, start in enumerate(starts)})
    return torch.cat([chunks[start] for start in sorted(chunks)], dim=SEQ)


def check_against_sdpa(layout: str, device: str, dtype: torch.dtype, causal: bool, *, ranks: int = 4, seq: int = 256,
                       head_dim: int = 64, scale: float | None = None) -> None:
    """Forward and q, k, v gradients of `layout` simulated over `ranks` ranks against SDPA in fp32 (same inputs)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, heads, seq, head_dim, generator=gen).to(device, dtype) for heads in (4, 2, 2, 4))
    got = [x.clone().requires_grad_() for x in (q, k, v)]
    out = simulate(layout, *got, ranks, causal, scale)
    out.backward(grad)
    ref = [x.float().clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=causal, scale=scale, enable_gqa=True)
    want.backward(grad.float())
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in got)
    tol = TOLERANCES[dtype]
    what = f"{layout} over {ranks} ranks, {dtype}, {'causal' if causal else 'no mask'}, on {device}"
    torch.testing.assert_close(out.float(), want, **tol, msg=lambda m: f"{what}, output: {m}")
    for name, a, b in zip("qkv", got, ref):
        # gradients sum over keys or queries: scale the tolerance by their size
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=tol["rtol"], atol=tol["atol"] * b.grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{what}, d{name}: {m}")
