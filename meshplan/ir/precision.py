"""Mixed precision as part of the traced program: what the model computes in, and where casts go.

A `MixedPrecision` policy (in the spirit of FSDP2's `MixedPrecisionPolicy`) keeps every parameter in
its own dtype (the fp32 master copy the optimizer steps) and traces the model with each floating
parameter and floating input cast to `param_dtype` on entry and each floating output cast to
`output_dtype`. The casts are ops of the IR like any other, so one mechanism serves everything:

- the cost model prices bf16 compute at the device's bf16 peak, bf16 activations and collectives,
  and fp32 parameters, gradients and optimizer state, because those are the graph's dtypes;
- the solver places each cast: a sharded parameter can be cast on its shard and all-gathered in
  bf16 (what FSDP2 does), and the gradient then flows back through that gather in bf16;
- the runtime runs the traced program unchanged: the master weights stay fp32 DTensors, their
  gradients arrive in fp32 and the data-parallel buckets reduce them in fp32 (`reduce_dtype`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

DTYPES = ("float32", "bfloat16")
"""dtype names a policy takes (not float16: its gradients need loss scaling, which the runtime lacks)."""

REDUCE_DTYPES = ("float32",)
"""Gradient buckets reduce the fp32 master weights' gradients as they are (no cast before the sum)."""


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """Compute in `param_dtype`, keep parameters (and so optimizer state) in their own dtype."""

    param_dtype: str = "bfloat16"
    """dtype every floating parameter and floating input is cast to as it enters the program."""
    reduce_dtype: str = "float32"
    """dtype of the data-parallel gradient all-reduce (the master weights' gradients)."""
    output_dtype: str = "float32"
    """dtype floating outputs are cast to, so the user's loss runs in fp32."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            if isinstance(getattr(self, name), torch.dtype):  # torch.bfloat16 -> "bfloat16"
                object.__setattr__(self, name, str(getattr(self, name)).removeprefix("torch."))
        for name in ("param_dtype", "output_dtype"):
            value = getattr(self, name)
            if value not in DTYPES:
                raise ValueError(f"MixedPrecision.{name}={value!r} is not supported; allowed: {', '.join(DTYPES)}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"MixedPrecision.reduce_dtype={self.reduce_dtype!r} is not supported; allowed: "
                             f"{', '.join(REDUCE_DTYPES)} (the fp32 master weights' gradients are reduced as they are)")

    @property
    def name(self) -> str:
        """Short name: 'bf16' (what the plan summary and `mixed_precision=` use)."""
        return SHORT[self.param_dtype]

    def describe(self) -> str:
        return (f"{self.name} mixed precision: compute in {self.param_dtype} (parameters cast from their own dtype, "
                f"which the optimizer steps), gradients reduced in {self.reduce_dtype}, outputs in {self.output_dtype}")

    @staticmethod
    def from_dict(data: dict) -> MixedPrecision:
        return MixedPrecision(**data)

    def check_device(self, device: torch.device) -> None:
        """A ValueError when `device` cannot compute in `param_dtype`."""
        if self.param_dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"the plan computes in bfloat16 but {device} ({torch.cuda.get_device_name(device)}) has no "
                             "bf16 support; plan with mixed_precision='fp32'")


SHORT = {"float32": "fp32", "bfloat16": "bf16"}
CHOICES = ("auto", "fp32", "bf16")
"""What `mixed_precision=` takes besides a `MixedPrecision`."""


def resolve_precision(value: str | MixedPrecision, *, auto: str) -> MixedPrecision | None:
    """The policy `value` names (None: the model's own dtypes, no casts); 'auto' means `auto` (the
    cluster device's `default_precision`)."""
    if isinstance(value, MixedPrecision):
        return value
    if value == "auto":
        value = auto
    if value == "fp32":
        return None
    if value == "bf16":
        return MixedPrecision("bfloat16")
    raise ValueError(f"mixed_precision={value!r} is not supported; allowed: {', '.join(map(repr, CHOICES))} or a "
                     "meshplan.MixedPrecision(param_dtype=, reduce_dtype=, output_dtype=)")


@contextlib.contextmanager
def cast_for_tracing(model: nn.Module, policy: MixedPrecision | None) -> Iterator[None]:
    """Within the block, `model`'s forward casts as `policy` says (nothing when None), so a trace
    records the casts as ops of the program."""
    if policy is None:
        yield
        return
    compute, output = getattr(torch, policy.param_dtype), getattr(torch, policy.output_dtype)
    forward = model.forward
    had, old = "forward" in model.__dict__, model.__dict__.get("forward")  # a region patch, say

    def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    @functools.wraps(forward)  # torch.export reads the forward's signature for the input names
    def casting_forward(*args, **kwargs):
        # one cast per name: a tied weight's two users (embedding, head) each cast it where they run, so a
        # pipeline stage holds the copy it uses rather than receiving another stage's
        params = {fqn: cast(p, compute) for fqn, p in model.named_parameters(remove_duplicate=False)}
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: cast(t, compute), (args, kwargs))
        with _reparametrize_module(model, params):
            out = forward(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: cast(t, output), out)

    model.forward = casting_forward
    try:
        yield
    finally:
        if had:
            model.forward = old
        else:
            del model.forward
