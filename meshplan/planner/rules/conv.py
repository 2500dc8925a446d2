"""Convolution: shard the batch, the output channels or (without bias) the input channels.

DTensor's single-dim rule for `aten.convolution` shards only the batch; channel sharding is the
convolutional form of Megatron's column (output channels) and row (input channels, partial
output) parallelism.
"""

from __future__ import annotations

import torch

from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.planner.rules.registry import Row


def conv_rule(args, kwargs) -> list[Row]:
    bias = args[2]
    transposed, groups = args[6], args[8]
    r = Replicate()
    has_bias = isinstance(bias, torch.Tensor)
    rows: list[Row] = [[Shard(0), Shard(0), r] + ([r] if has_bias else [])]  # [out, x, weight, (bias)]: batch
    if not transposed and groups == 1:
        # output channels: weight [Cout, Cin, *k] split on Cout, every device sees the whole input
        rows.append([Shard(1), r, Shard(0)] + ([Shard(0)] if has_bias else []))
        if not has_bias:  # input channels: each device sums over its channels, the output is partial
            rows.append([Partial(), Shard(1), Shard(1)])
    return rows
