"""Placements of a tensor on a device mesh, the same model as DTensor's.

`Shard(dim)`, `Replicate()` and `Partial(op)` per mesh axis. A tensor's layout on an n-axis mesh is a
tuple of n placements (`Placements`), printed compactly as `S(0)R` or `RP`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Union

from torch.distributed.tensor import placement_types as dt


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split evenly along tensor dimension `dim` over the mesh axis."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device of the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every device holds a partial value; the tensor is their sum (or average)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in ("sum", "avg"):
            raise ValueError(f"Partial op {self.op!r} is not supported; allowed: 'sum', 'avg'")

    def __str__(self) -> str:
        return "P" if self.op == "sum" else "P(avg)"


Placement = Union[Shard, Replicate, Partial]
Placements = tuple[Placement, ...]


def fmt(placements: Placements) -> str:
    """Compact form: `S(0)R`."""
    return "".join(str(p) for p in placements)


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


def replicated(ndim: int) -> Placements:
    return (Replicate(),) * ndim


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


def is_even(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    for p in placements:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            return False
    return all(s % shard_factor(placements, mesh_shape, d) == 0 for d, s in enumerate(shape))


def to_dtensor(p: Placement) -> dt.Placement:
    if isinstance(p, Shard):
        return dt.Shard(p.dim)
    if isinstance(p, Partial):
        return dt.Partial(p.op)
    return dt.Replicate()


def from_dtensor(p: dt.Placement) -> Placement | None:
    """DTensor placement -> ours; None for kinds meshplan does not execute (strided, masked, max/min)."""
    if type(p) is dt.Shard:
        return Shard(p.dim)
    if type(p) is dt.Replicate:
        return Replicate()
    if type(p) is dt.Partial and p.reduce_op in ("sum", "avg"):
        return Partial(p.reduce_op)
    return None
