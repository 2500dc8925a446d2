"""The registry of meshplan's own rules for ordinary ops, keyed by ATen op name (a region op,
ir/regions.py, carries its rule itself)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshplan.ir.regions import Row

RuleFn = Callable[[Sequence[object], dict], list[Row]]
"""(args, kwargs) with tensors given as `torch.Tensor` metas -> single-axis rows [outs..., ins...]."""

RULES: dict[str, RuleFn] = {}


def register_rule(*ops: object) -> Callable[[RuleFn], RuleFn]:
    """Register `fn` as the rule of each op (an OpOverload or its string name)."""

    def wrap(fn: RuleFn) -> RuleFn:
        for op in ops:
            name = str(op)
            if name in RULES:
                raise AssertionError(f"two meshplan rules for {name}")
            RULES[name] = fn
        return fn

    return wrap


def tensor_args(args: Sequence[object], kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    torch.utils._pytree.tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, (list(args), kwargs))
    return found
