"""The optimizer a plan asks for: the user's own optimizer class, with offloaded state on the host.

For a parameter the plan offloads (`ParamChoice.offload`), an fp32 master copy lives in host
memory (pinned when the parameter is on an accelerator), and the optimizer steps that copy, so
its state lives on the host too. Step hooks do the round trip `cost_model/offload.py` prices:
before the step the device gradient moves to the copy (the device parameter's `.grad` is then
None: the copy holds it), after the step the copy's values move back into the device parameter.
Other parameters step where they are.

The result is one ordinary `optimizer_cls` instance, so LR schedulers, `state_dict()` and
`meshplan.save_checkpoint` accept it. The copies are DTensors with the device parameter's layout
(a host local tensor on the same mesh, as FSDP2's CPU offload keeps them), so checkpoints of their
state load under any plan; `module.offload_copies` maps each offloaded FQN to its copy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshplan.runtime.local_view import local_of


def on_accelerator(t: torch.Tensor) -> bool:
    """Whether `t` lives on this machine's accelerator (CUDA, XPU, ...), whose copies to and from pinned host memory
    run asynchronously."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and t.device.type == accelerator.type


def host_copy(p: DTensor) -> nn.Parameter:
    """An fp32 copy of `p` whose local tensor lives in host memory, with `p`'s layout."""
    local = local_of(p.detach())
    host = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=on_accelerator(local))
    host.copy_(local)
    return nn.Parameter(DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()))


def make_optimizer(module: nn.Module, plan, leaves: dict[str, torch.Tensor], optimizer_cls: type[torch.optim.Optimizer],
                   **kwargs) -> torch.optim.Optimizer:
    """`optimizer_cls` over `module`'s parameters, each offloaded one replaced by its host copy."""
    offload = {id(leaves[p.node]) for p in plan.params if p.offload and p.node in leaves}
    fqn_of = {id(t): fqn for fqn, t in module.named_parameters()}
    params, pairs, seen = [], [], set()
    module.offload_copies = {}
    for p in module.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in offload:
            host = host_copy(p)
            module.offload_copies[fqn_of[id(p)]] = host
            pairs.append((p, host))
            p = host
        params.append(p)
    optimizer = optimizer_cls(params, **kwargs)
    if pairs:
        optimizer.register_step_pre_hook(lambda *_: _gradients_to_host(pairs))
        optimizer.register_step_post_hook(lambda *_: _values_to_device(pairs))
    return optimizer


@torch.no_grad()
def _gradients_to_host(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    devices = set()
    for p, host in pairs:
        if p.grad is None:
            continue
        grad = local_of(p.grad)
        if on_accelerator(grad):
            devices.add(grad.device)
        local = grad.to("cpu", torch.float32, non_blocking=True)
        host.grad = DTensor.from_local(local, host.device_mesh, host.placements, run_check=False, shape=host.shape, stride=host.stride())
        p.grad = None  # handed over: the host copy holds this step's gradient
    for device in devices:
        torch.accelerator.synchronize(device)  # the gradients are on the host before the optimizer reads them


@torch.no_grad()
def _values_to_device(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    for p, host in pairs:
        local_of(p).copy_(local_of(host), non_blocking=True)
