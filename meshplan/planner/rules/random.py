"""Random ops (dropout masks, noise): drawn whole on every device.

Every rank holds the same generator state (ParallelModule broadcasts rank 0's at start) and runs
the same random ops in the same order as the single-device model, so drawing each random tensor
whole reproduces the single-device draw exactly: ranks holding replicas get identical masks, and
a sharded consumer takes its slice of the very mask one device would have drawn. Sharding the
draw itself would make each rank draw a smaller tensor from the start of the same stream, which
is a different mask. The cost is generating the whole mask on every device (cheap next to the
matmuls around it); see docs/regions.md.
"""

from __future__ import annotations

import torch

from meshplan.planner.rules.registry import Row, register_rule

aten = torch.ops.aten

RANDOM_OPS = tuple(
    op
    for op in (
        aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.native_dropout.default,
        aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.uniform_.default, aten.normal_.default,
        aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
        aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.multinomial.default,
    )
)


def is_random(target: str) -> bool:
    return target in RANDOM_NAMES


RANDOM_NAMES = frozenset(str(op) for op in RANDOM_OPS)


@register_rule(*RANDOM_OPS)
def random_rule(args, kwargs) -> list[Row]:
    return []  # only the replicated strategy (the generator adds it for every op)
