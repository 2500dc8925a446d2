"""Mixture of experts as one op: `meshplan::moe`, its reference computation, and the adapter that
traces Hugging Face's `MixtralSparseMoeBlock` with it.

`moe(x [..., H], router_weight [E, H], gate_up [E, 2I, H], down [E, H, I], top_k, normalize, act)`:
each token picks its `top_k` experts by softmax(x @ router_weight.T) (weights renormalised to sum
to 1 when `normalize`); each expert is a gated MLP `down @ (act(gate) * up)`; a token's output is
the weighted sum of its experts' outputs. Nothing is dropped (no capacity limit), as in Mixtral.

Which tokens reach which expert is data, so the op is traced whole (see regions.py) and sharded
by its own rules: tokens over a mesh axis (data parallel), experts over a mesh axis with tokens
exchanged all-to-all (expert parallel), or experts over an axis with tokens replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.ir.regions import RegionAdapter, register_region

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
"""Expert activations the op supports, by the name its `act` argument takes."""


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) of every token, as Mixtral's router computes them."""
    probs = F.softmax(F.linear(x, router_weight).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mlp(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One expert's gated MLP on the rows `h` it received."""
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(ACTIVATIONS[act](gate) * up, down)


def experts_local(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str, first: int
) -> torch.Tensor:
    """Sum over the experts held here (global ids first .. first+len(gate_up)-1) of weight x expert(x):
    the whole output when every expert is here, a partial sum otherwise."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == first + e)
        if token.numel() == 0:
            continue
        y = expert_mlp(x[token], gate_up[e], down[e], act) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def moe_reference(x, router_weight, gate_up, down, top_k: int, normalize: bool, act: str) -> torch.Tensor:
    """The op on one device (differentiable with ordinary autograd)."""
    _check(x, router_weight, gate_up, down, top_k, act)
    tokens = x.reshape(-1, x.shape[-1])
    weights, ids = route(tokens, router_weight, top_k, normalize)
    return experts_local(tokens, weights, ids, gate_up, down, act, 0).reshape(x.shape)


def _check(x, router_weight, gate_up, down, top_k, act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"moe activation {act!r} is not supported; allowed: {', '.join(ACTIVATIONS)}")
    e, h = router_weight.shape
    if x.ndim < 2 or x.shape[-1] != h or gate_up.shape[0] != down.shape[0] or gate_up.shape[2] != h or down.shape[1] != h:
        raise ValueError(
            f"moe shapes do not fit: x {list(x.shape)} (want [..., {h}]), router {list(router_weight.shape)}, "
            f"gate_up {list(gate_up.shape)} (want [E, 2I, {h}]), down {list(down.shape)} (want [E, {h}, I])"
        )
    if not 1 <= top_k <= e:
        raise ValueError(f"moe top_k={top_k} must be between 1 and the number of experts ({e})")


@torch.library.custom_op("meshplan::moe", mutates_args=())
def moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, normalize: bool, act: str) -> torch.Tensor:
    with torch.no_grad():
        return moe_reference(x, router_weight, gate_up, down, top_k, normalize, act)


@moe.register_fake
def _moe_fake(x, router_weight, gate_up, down, top_k, normalize, act):
    _check(x, router_weight, gate_up, down, top_k, act)
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.static = inputs[4:]


def _backward(ctx, grad):
    # recompute with autograd: the routing is cheap next to the experts, and this keeps one definition
    tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = moe_reference(*tensors, *ctx.static)
        wanted = [t for t in tensors if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in tensors) + (None, None, None)


moe.register_autograd(_backward, setup_context=_setup)

MOE_OP = torch.ops.meshplan.moe.default
MOE_TARGET = str(MOE_OP)
"""The op's name as graph nodes and plans spell it."""


# ---------------------------------------------------------------- Hugging Face adapters


def _activation_name(fn: object) -> str:
    kind = type(fn).__name__.lower()
    for name, known in (("silu", ("silu", "swish")), ("gelu", ("gelu",)), ("relu", ("relu",))):
        if any(k in kind for k in known):
            return name
    raise ValueError(f"expert activation {type(fn).__name__} is not supported by meshplan's moe op; allowed: {', '.join(ACTIVATIONS)}")


def _is_mixtral_block(module: nn.Module) -> bool:
    return type(module).__name__ == "MixtralSparseMoeBlock"


def _mixtral_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if module.training and module.jitter_noise > 0:
        raise ValueError(f"router_jitter_noise={module.jitter_noise}: random router noise is not supported by meshplan's moe op; set it to 0")
    # the op reads the block's input itself, so annotations on the block's input land on it
    return MOE_OP(
        hidden_states, module.gate.weight, module.experts.gate_up_proj, module.experts.down_proj, module.top_k, True,
        _activation_name(module.experts.act_fn),
    )


register_region(RegionAdapter("moe", _is_mixtral_block, _mixtral_forward))
