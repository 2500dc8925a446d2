"""Vocabulary-parallel lookups as a region op: `embedding` / `gather` with the table split along
the looked-up dim, run as the kernel `masked`.

DTensor's own rule gives these layouts (its MaskPartial; `planner/masked.py` turns them into an
ordinary layout plus `kernel="masked"`). The ids arrive whole; each device shifts them into its
own block of the table, looks up those it holds and zeroes the rest, so the outputs are partial
sums over the axes that split the table. The kernel communicates nothing itself.
"""

from __future__ import annotations

import torch
from torch import nn

from meshplan.ir.placement import Placements, Shard
from meshplan.ir.regions import RegionOp
from meshplan.runtime.collectives import MeshComm

aten = torch.ops.aten


def block_range(layout: Placements, dim: int, size: int, mesh_shape: tuple[int, ...], coord: tuple[int, ...]) -> tuple[int, int]:
    """[start, stop) of this device's block of a dim of `size` split by `layout` (outer axes take the outer blocks)."""
    index, parts = 0, 1
    for a, p in enumerate(layout):
        if p == Shard(dim):
            index = index * mesh_shape[a] + coord[a]
            parts *= mesh_shape[a]
    rows = size // parts
    return index * rows, (index + 1) * rows


class MaskedLookup(nn.Module):
    """embedding / gather on this device's block [start, stop) of the looked-up dim; other ids give zeros."""

    def __init__(self, op, start: int, stop: int) -> None:
        super().__init__()
        self.op, self.start, self.stop = op, start, stop

    def forward(self, *args, **kwargs):
        if self.op is aten.embedding.default:
            weight, ids, *rest = args
            padding_idx = rest.pop(0) if rest else kwargs.pop("padding_idx", -1)
            outside = (ids < self.start) | (ids >= self.stop)
            local = (ids - self.start).masked_fill(outside, 0)
            # the padding row gets no gradient: it is a row of this block only if it falls inside it
            pad = padding_idx - self.start if self.start <= padding_idx < self.stop else -1
            return aten.embedding.default(weight, local, pad, *rest, **kwargs).masked_fill(outside.unsqueeze(-1), 0.0)
        x, dim, index, *rest = args
        outside = (index < self.start) | (index >= self.stop)
        local = (index - self.start).masked_fill(outside, 0)
        return aten.gather.default(x, dim, local, *rest, **kwargs).masked_fill(outside, 0.0)

    def extra_repr(self) -> str:
        return f"{self.op}, rows [{self.start}, {self.stop})"


class MaskedLookupOp(RegionOp):
    """The masked kernel of one lookup op (embedding: the table's dim 0; gather: its `dim` argument)."""

    def __init__(self, name: str, op) -> None:
        self.name, self.ops = name, (op,)

    def reads_block_positions(self, strategy, args, axis: int) -> bool:
        """The kernel shifts the ids by the table block's offset along the looked-up dim: only a table split over
        `axis` along that dim reads where its block lies (the cross-entropy's gather with its rows split over `axis`
        does not)."""
        table = strategy.inputs[0][axis]
        if not isinstance(table, Shard):
            return False
        if self.ops[0] is not aten.gather.default:
            return table.dim == 0
        return table.dim == args[1] % args[0].meta["val"].ndim

    def local_module(self, strategy, comm: MeshComm, args) -> MaskedLookup | None:
        if strategy.kernel != "masked":
            return None
        op, table = self.ops[0], args[0]
        dim = args[1] % table.ndim if op is aten.gather.default else 0
        return MaskedLookup(op, *block_range(strategy.inputs[0], dim, table.shape[dim], comm.mesh.shape, comm.coord))


MASKED_EMBEDDING_REGION = MaskedLookupOp("masked_embedding", aten.embedding.default)
MASKED_GATHER_REGION = MaskedLookupOp("masked_gather", aten.gather.default)
