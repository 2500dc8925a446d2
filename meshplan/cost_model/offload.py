"""Optimizer state offloaded to host memory (ZeRO-Offload): what it costs per step.

The runtime (`runtime/offload.py`) keeps an offloaded parameter's fp32 master copy and optimizer
state in host memory. Each step, after backward, it copies the gradient to the host, runs the
optimizer there, and copies the updated parameter back: nothing of this overlaps with compute,
so the time is charged in full.
"""

from __future__ import annotations

from meshplan.cost_model.memory import OPTIMIZER_STATES
from meshplan.cost_model.presets import DevicePreset

_FP32 = 4


def can_offload(device: DevicePreset) -> bool:
    return device.host_link_bandwidth is not None and device.host_memory_bandwidth is not None


def offload_step_time(numel: int, device: DevicePreset, *, optimizer: str, itemsize: int) -> float:
    """Seconds per step for `numel` offloaded elements on one device: gradient down, step on the
    host (memory-bound: read master, gradient and states, write master and states), parameter up."""
    if not can_offload(device):
        raise ValueError(f"device {device.name!r} has no host link or host memory figures: nothing to offload to")
    states = OPTIMIZER_STATES[optimizer]
    moved = numel * itemsize  # each way: the gradient down, the parameter up
    host_bytes = numel * _FP32 * (2 + 1 + 2 * states)  # master read + write, gradient read, states read + write
    return 2 * moved / device.host_link_bandwidth + host_bytes / device.host_memory_bandwidth
