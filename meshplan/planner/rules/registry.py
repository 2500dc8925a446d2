"""The registry of meshplan's own op rules, keyed by ATen op name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshplan.ir.placement import Placement

Row = list[Placement | None]
RuleFn = Callable[[Sequence[object], dict], list[Row]]
"""(args, kwargs) with tensors given as `torch.Tensor` metas -> single-axis rows [outs..., ins...]."""

RULES: dict[str, RuleFn] = {}
KEEP: dict[str, Callable[[object], bool]] = {}
"""Per op, a test on the full-mesh strategies its rows expand to: combinations across mesh axes
that the op's runtime does not execute are dropped (e.g. experts sharded on two axes)."""


class KernelRow(list):
    """A row the op can only run as the sharded kernel `kernel` (see `Strategy.kernel`)."""

    def __init__(self, placements, kernel: str) -> None:
        super().__init__(placements)
        self.kernel = kernel


def register_rule(*ops: object, keep: Callable[[object], bool] | None = None) -> Callable[[RuleFn], RuleFn]:
    """Register `fn` as the rule of each op (an OpOverload or its string name); `keep(strategy)`
    filters the expanded strategies."""

    def wrap(fn: RuleFn) -> RuleFn:
        for op in ops:
            name = str(op)
            assert name not in RULES, f"two meshplan rules for {name}"
            RULES[name] = fn
            if keep is not None:
                KEEP[name] = keep
        return fn

    return wrap


def tensor_args(args: Sequence[object], kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    torch.utils._pytree.tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, (list(args), kwargs))
    return found
