"""Batch norm in training (`_native_batch_norm_legit_functional`): shard the channels, or the batch
with synchronised statistics.

- channels: every statistic is per channel, so each device normalises its channels exactly;
- batch (SyncBN): each device holds part of the batch; the per-channel sums are all-reduced over
  the batch-sharded axes before normalising (and the gradient sums in backward), so the output
  and the running statistics equal the single-device ones. Those all-reduces are the op's own
  collectives (cost_model/batch_norm.py, runtime/batch_norm.py).
Outputs: out, saved mean, saved inverse std, new running mean, new running var.
"""

from __future__ import annotations

import torch

from meshplan.ir.op_kinds import BATCH_NORM
from meshplan.ir.placement import Replicate, Shard
from meshplan.planner.rules.registry import Row, register_rule


@register_rule(BATCH_NORM)
def batch_norm_rule(args, kwargs) -> list[Row]:
    x, weight, bias, running_mean, running_var = args[:5]
    present = [isinstance(t, torch.Tensor) for t in (weight, bias, running_mean, running_var)]
    r, c = Replicate(), Shard(0)
    rows: list[Row] = []
    for out, stats, inp, per_channel in ((Shard(0), r, Shard(0), r), (Shard(1), c, Shard(1), c)):
        rows.append([out, stats, stats, stats, stats, inp] + [per_channel for p in present if p])
    return rows
