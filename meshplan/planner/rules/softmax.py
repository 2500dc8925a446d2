"""`_log_softmax`: DTensor's rows (any layout that keeps the softmax dim whole) plus the
vocabulary-parallel row: the softmax dim split, run as the `log_softmax(dim=d)` kernel, whose
max/sum all-reduces (`cost_model/kernels.py`) replace gathering the whole logits."""

from __future__ import annotations

import torch

from meshplan.ir.placement import Shard
from meshplan.planner.rules.registry import KernelRow, Row, register_rule, tensor_args

aten = torch.ops.aten


@register_rule(aten._log_softmax.default)
def log_softmax_rule(args, kwargs) -> list[Row]:
    (x,) = tensor_args(args, kwargs)[:1]
    dim = args[1] % x.ndim
    rows: list[Row] = [[Shard(d), Shard(d)] for d in range(x.ndim) if d != dim]
    if x.dtype in (torch.float32, torch.float64):  # the kernel keeps the input's dtype (no half_to_float)
        rows.append(KernelRow([Shard(dim), Shard(dim)], f"log_softmax(dim={dim})"))
    return rows
