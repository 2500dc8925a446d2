"""Random ATen ops, which the layers above treat apart from the rest: dropout masks and noise are
drawn whole on every device from one generator state, so a plan reproduces the single-device draw
(planner/rules/random.py says why; the runtime seeds them)."""

from __future__ import annotations

import torch

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

