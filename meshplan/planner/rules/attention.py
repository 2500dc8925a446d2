"""Scaled-dot-product attention: shard the batch or the heads; the whole op stays local."""

from __future__ import annotations

from meshplan.ir.placement import Replicate, Shard
from meshplan.planner.rules.registry import Row, tensor_args


def sdpa_rule(args, kwargs) -> list[Row]:
    q, k, v, *rest = tensor_args(args, kwargs)
    mask = rest[0] if rest else None
    rows: list[Row] = []
    for dim in (0, 1):  # batch, heads: attention never mixes either
        row: list = [Shard(dim), Shard(dim), Shard(dim), Shard(dim)]
        if mask is not None:
            # a mask broadcast along this dim stays whole on every device
            lead = mask.ndim - 4 + dim
            row.append(Shard(lead) if lead >= 0 and mask.shape[lead] > 1 else Replicate())
        rows.append(row)
    return rows
