"""Head-tail token order: how a plan with `token_order` holds a tensor split over its `cp` mesh axis.

Cut the split dimension into 2P equal chunks; place r of P holds chunks r and 2P-1-r, in that order (torch's
`context_parallel` calls it head-tail load balancing). Under a causal mask the two chunks' query rows see r and
2P-1-r chunks of keys before them, 2P-1 on every place, so causal attention's work is equal everywhere without
moving any query. Every tensor the plan splits on that axis is held so: the tokens as they are sliced, positions,
RoPE tables and labels as they are chunked from whole, every activation and its gradient. Ops run on these blocks
as on contiguous ones, because a sharding rule that keeps a dimension split computes each index of it on its own
(or sums over it); what reads a block's position (attention's mask, a masked lookup's offset) must know the order,
so the planner offers no such kernel on that axis but the token-order attention (planner/token_order.py).

These helpers are the only places the order is spelled out: the runtime's redistribution steps
(`collectives.run_step`) and the input slicing call them.
"""

from __future__ import annotations

import torch


def owned_chunks(place: int, n: int) -> tuple[int, int]:
    """The two of 2n chunks place `place` of `n` holds, in the order it holds them."""
    return place, 2 * n - 1 - place


def check_divisible(length: int, n: int, what: str) -> None:
    if length % (2 * n):
        raise ValueError(f"{what}: length {length} does not split into 2 x {n} = {2 * n} equal chunks, which head-tail "
                         "token order needs")


def take(x: torch.Tensor, dim: int, n: int, place: int) -> torch.Tensor:
    """Place `place`'s block of the whole `x` along `dim` (a new contiguous tensor)."""
    check_divisible(x.shape[dim], n, f"splitting dim {dim} of a {list(x.shape)} tensor over {n} places")
    chunks = x.chunk(2 * n, dim=dim)
    return torch.cat([chunks[c] for c in owned_chunks(place, n)], dim=dim)


def stacked(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Every place's block of the whole `x`, stacked on a new dim 0 (place p's at [p]): one copy, as a reduce-scatter
    or an all-to-all sends them, with no block made on its own first."""
    check_divisible(x.shape[dim], n, f"splitting dim {dim} of a {list(x.shape)} tensor over {n} places")
    chunks = x.chunk(2 * n, dim=dim)
    half = chunks[0].shape[dim]
    shape = list(x.shape)
    shape[dim] = 2 * half
    out = x.new_empty([n, *shape])
    for p in range(n):
        for i, c in enumerate(owned_chunks(p, n)):
            out[p].narrow(dim, i * half, half).copy_(chunks[c])
    return out


def put(block: torch.Tensor, dim: int, n: int, place: int) -> torch.Tensor:
    """The whole tensor that is zero but for place `place`'s block (the dual of `take`)."""
    shape = list(block.shape)
    shape[dim] *= n
    out = block.new_zeros(shape)
    half = block.shape[dim] // 2
    for i, c in enumerate(owned_chunks(place, n)):
        out.narrow(dim, c * half, half).copy_(block.narrow(dim, i * half, half))
    return out


def join(blocks: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """The whole tensor from every place's block, `blocks[p]` place p's (the inverse of `take` at every place)."""
    n = len(blocks)
    halves = [b.chunk(2, dim=dim) for b in blocks]
    return torch.cat([halves[p][0] for p in range(n)] + [halves[p][1] for p in reversed(range(n))], dim=dim)
