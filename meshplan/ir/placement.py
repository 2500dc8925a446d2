"""Placements of a tensor on a device mesh: DTensor's own types, with meshplan's compact text form.

`Shard(dim)`, `Replicate()` and `Partial(reduce_op)` per mesh axis are
`torch.distributed.tensor`'s classes, used as they are. A tensor's layout on an n-axis mesh is a
tuple of n placements (`Placements`), printed compactly as `S(0)R` or `RP`. meshplan executes only
even `Shard`s, `Replicate` and sum/avg `Partial`s: DTensor's other kinds (strided shards, masked
partials, max/min partials) are converted or rejected where they enter (`executable`).
"""

from __future__ import annotations

import functools
import math
from typing import Union

from torch.distributed.tensor import Partial, Replicate, Shard

Placement = Union[Shard, Replicate, Partial]
Placements = tuple[Placement, ...]

PARTIAL_OPS = ("sum", "avg")
"""The reductions of a partial value meshplan executes."""


def executable(p: object) -> Placement | None:
    """`p` when meshplan executes it (Shard, Replicate, Partial sum/avg), else None (strided shards, masked or max/min partials)."""
    if type(p) is Shard or type(p) is Replicate:
        return p
    if type(p) is Partial and p.reduce_op in PARTIAL_OPS:
        return p
    return None


def short(p: Placement) -> str:
    """`S(0)`, `R`, `P` (a sum) or `P(avg)`."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


def fmt(placements: Placements) -> str:
    """Compact form: `S(0)R`."""
    return "".join(short(p) for p in placements)


def parse(text: str) -> Placements:
    """Inverse of `fmt`: `"S(0)R"` -> (Shard(0), Replicate())."""
    out: list[Placement] = []
    i = 0
    while i < len(text):
        if text.startswith("R", i):
            out.append(Replicate())
            i += 1
        elif text.startswith("P(avg)", i):
            out.append(Partial("avg"))
            i += 6
        elif text.startswith("P", i):
            out.append(Partial())
            i += 1
        elif text.startswith("S(", i):
            j = text.index(")", i)
            out.append(Shard(int(text[i + 2 : j])))
            i = j + 1
        else:
            raise ValueError(f"cannot parse placements {text!r} at {text[i:]!r}; expected R, P, P(avg) or S(d)")
    return tuple(out)


def shard_factor(placements: Placements, mesh_shape: tuple[int, ...], dim: int) -> int:
    """How many pieces tensor dim `dim` is cut into."""
    return math.prod(n for p, n in zip(placements, mesh_shape) if p == Shard(dim))


@functools.lru_cache(maxsize=1 << 16)
def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one device's piece (meshplan only uses even sharding)."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            out[p.dim] //= n
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def is_even(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """Every sharded dim of `shape` splits evenly (candidate generation asks this of every layout of every tensor)."""
    for p in placements:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            return False
    return all(s % shard_factor(placements, mesh_shape, d) == 0 for d, s in enumerate(shape))
