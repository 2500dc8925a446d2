"""Per-device memory: the four things training keeps resident, and how to print them.

Sizes are bytes per device after sharding (ZeRO/FSDP shards params, grads and optimizer state;
tensor/sequence parallelism shards activations). Byte counts print in binary units (KiB, MiB,
GiB), the convention device capacities and `torch.cuda.memory_summary` use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

# Optimizer state tensors per parameter element, each kept in fp32 (also for bf16 models, as
# mixed-precision training does).
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
"""optimizer name -> fp32 state tensors per parameter (adam: exp_avg and exp_avg_sq; adagrad: sum;
rmsprop: square_avg, without momentum)."""
_STATE_ITEMSIZE = 4  # fp32

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """`1536` -> `"1.5 KiB"`; whole bytes below 1 KiB (`"512 B"`); one decimal above."""
    sign, value = ("-" if n < 0 else ""), float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{sign}{value:.1f} {_UNITS[unit]}"


_PARSE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """`"80GB"` -> 80e9, `"80GiB"` -> 80 * 2**30, `512` -> 512 (decimal GB as vendors write it, binary GiB as torch prints)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"a memory size must be bytes (int) or a string like '80GB' / '16GiB'; got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _PARSE_UNITS:
            raise ValueError(f"memory size {value!r} is not understood; allowed: a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
        value = float(m.group(1)) * _PARSE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be positive; got {value!r}")
    return int(value)


def optimizer_state_bytes(param_numel: int, optimizer: str = "adam") -> int:
    """Bytes of optimizer state for `param_numel` parameter elements (on one device)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    if param_numel < 0:
        raise ValueError(f"param_numel must be >= 0; got {param_numel!r}")
    return OPTIMIZER_STATES[optimizer] * _STATE_ITEMSIZE * param_numel


ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages: 0 none, 1 optimizer state sharded, 2 + gradients, 3 + parameters (= FSDP full shard)."""


def training_state_bytes(
    param_numel: int, *, optimizer: str = "adam", param_itemsize: int = 4, grad_itemsize: int | None = None,
    master_weights: bool = False, param_shards: int = 1, grad_shards: int = 1, state_shards: int = 1,
) -> MemoryBreakdown:
    """Per-device bytes of parameters, gradients and optimizer state for `param_numel` elements.

    Mixed precision (`param_itemsize=2, master_weights=True`) keeps bf16 parameters and gradients
    plus an fp32 master copy, which counts as optimizer state (as in the ZeRO paper: K = 4 + 8 = 12
    bytes per element for Adam). Each part is divided by the number of devices it is sharded over.
    """
    if param_numel < 0:
        raise ValueError(f"param_numel must be >= 0; got {param_numel!r}")
    for name, v in (("param_shards", param_shards), ("grad_shards", grad_shards), ("state_shards", state_shards)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    grad_itemsize = param_itemsize if grad_itemsize is None else grad_itemsize
    state = optimizer_state_bytes(param_numel, optimizer) + (_STATE_ITEMSIZE * param_numel if master_weights else 0)
    return MemoryBreakdown(
        params=param_numel * param_itemsize // param_shards, grads=param_numel * grad_itemsize // grad_shards,
        optimizer=state // state_shards, activations=0,
    )


def zero_state_bytes(param_numel: int, dp: int, stage: int, *, optimizer: str = "adam", mixed_precision: bool = True) -> MemoryBreakdown:
    """Model state per device under ZeRO `stage` over `dp` data-parallel ranks (Rajbhandari et al.
    2020, fig. 1). For mixed-precision Adam (Psi = `param_numel`): 16 Psi, 4 Psi + 12 Psi / N,
    2 Psi + 14 Psi / N, 16 Psi / N for stages 0-3. FSDP's FULL_SHARD is stage 3, SHARD_GRAD_OP stage 2."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage!r} is not one of {ZERO_STAGES}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int; got {dp!r}")
    return training_state_bytes(
        param_numel, optimizer=optimizer, param_itemsize=2 if mixed_precision else 4, master_weights=mixed_precision,
        state_shards=dp if stage >= 1 else 1, grad_shards=dp if stage >= 2 else 1, param_shards=dp if stage >= 3 else 1,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Peak memory of one device during a training step, by what holds it."""

    params: int
    """Bytes of parameters resident on the device (its shards, or unsharded copies)."""
    grads: int
    """Bytes of gradients held until the optimizer step."""
    optimizer: int
    """Bytes of optimizer state (see `optimizer_state_bytes`)."""
    activations: int
    """Bytes of activations saved for backward at the peak (after recomputation)."""
    workspace: int = 0
    """Bytes the device's math libraries hold throughout (`DevicePreset.library_workspace_bytes`)."""

    def __post_init__(self) -> None:
        for name in _BREAKDOWN_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"MemoryBreakdown.{name} must be a non-negative number of bytes; got {value!r}")

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(**{name: getattr(self, name) + getattr(other, name) for name in _BREAKDOWN_FIELDS})

    @property
    def total(self) -> int:
        return sum([getattr(self, name) for name in _BREAKDOWN_FIELDS])

    def __str__(self) -> str:
        parts = " + ".join(f"{f.name} {format_bytes(getattr(self, f.name))}" for f in fields(self)
                           if f.name != "workspace" or self.workspace)
        return f"{parts} = {format_bytes(self.total)}"

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> MemoryBreakdown:
        expected = {f.name for f in fields(MemoryBreakdown)}
        if not expected - {"workspace"} <= set(data) <= expected:  # plans saved before the workspace was counted lack it
            raise ValueError(
                f"MemoryBreakdown needs the keys {sorted(expected - {'workspace'})} (and optionally 'workspace'); got {sorted(data)}"
            )
        return MemoryBreakdown(**data)


_BREAKDOWN_FIELDS = tuple(f.name for f in fields(MemoryBreakdown))
"""Every part of a breakdown, in order: what `total`, `+` and the checks go over."""
