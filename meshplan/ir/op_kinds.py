"""ATen ops that the layers above treat apart from the rest: random ops and batch norm in training.

- Random ops (dropout masks, noise) are drawn whole on every device from one generator state, so a
  plan reproduces the single-device draw (planner/rules/random.py says why; the runtime seeds them).
- Batch norm in training normalises with batch statistics: sharding the batch needs synchronised
  statistics, the op's own collectives (planner/rules/batch_norm.py, cost_model/batch_norm.py,
  runtime/batch_norm.py).
"""

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


BATCH_NORM = aten._native_batch_norm_legit_functional.default
