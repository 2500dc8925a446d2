"""Analytic cost model: compute roofline, alpha-beta collectives, resharding steps, memory."""

from meshplan.cost_model.collectives import COLLECTIVE_KINDS, LOCAL_KINDS, collective_time
from meshplan.cost_model.compute import BACKWARD_FACTOR, is_view, op_bytes, op_flops, op_time, roofline_time
from meshplan.cost_model.memory import MemoryBreakdown, format_bytes, optimizer_state_bytes
from meshplan.cost_model.presets import CLUSTERS, ClusterPreset, DevicePreset, LinkPreset, get_cluster
from meshplan.cost_model.redistribution import CommStep, backward_steps, redistribution_steps

__all__ = [
    "BACKWARD_FACTOR", "CLUSTERS", "COLLECTIVE_KINDS", "ClusterPreset", "CommStep", "DevicePreset", "LOCAL_KINDS",
    "LinkPreset", "MemoryBreakdown", "backward_steps", "collective_time", "format_bytes", "get_cluster", "is_view",
    "op_bytes", "op_flops", "op_time", "optimizer_state_bytes", "redistribution_steps", "roofline_time",
]
