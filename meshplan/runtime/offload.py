"""The optimizer a plan asks for: on-device for most parameters, on the host for offloaded ones.

For a parameter the plan offloads (`ParamChoice.offload`), an fp32 master copy lives in host
memory (pinned when a GPU is present) and the wrapped optimizer keeps its state next to it. A step
copies the gradient down, steps on the host, and copies the result back into the device
parameter: the round trip `cost_model/offload.py` prices. Other parameters step where they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class PlannedOptimizer:
    """Two instances of the user's optimizer class: one over device parameters, one over host copies."""

    def __init__(self, params: list[nn.Parameter], offloaded: list[nn.Parameter], make: Callable[[list], torch.optim.Optimizer]) -> None:
        pin = torch.cuda.is_available()
        self._pairs = []
        for p in offloaded:  # p: a DTensor; its host copy holds this rank's shard
            local = p.detach().to_local()
            host = nn.Parameter(torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=pin))
            host.data.copy_(local)
            self._pairs.append((p, host))
        self.device = make(params) if params else None
        self.host = make([h for _, h in self._pairs]) if self._pairs else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.device, self.host) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        for p, host in self._pairs:
            host.grad = None if p.grad is None else p.grad.to_local().to("cpu", torch.float32, non_blocking=True)
        if self._pairs and torch.cuda.is_available():
            torch.cuda.synchronize()  # the gradients are on the host before the host optimizer reads them
        for o in self.optimizers:
            o.step()
        for p, host in self._pairs:
            p.to_local().copy_(host, non_blocking=True)


def make_optimizer(module: nn.Module, plan, leaves: dict[str, torch.Tensor], optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> PlannedOptimizer:
    offload = {id(leaves[p.node]) for p in plan.params if p.offload and p.node in leaves}
    device, host, seen = [], [], set()
    for p in module.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (host if id(p) in offload else device).append(p)
    return PlannedOptimizer(device, host, lambda ps: optimizer_cls(ps, **kwargs))
