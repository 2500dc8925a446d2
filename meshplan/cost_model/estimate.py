"""Time and memory of one node under one layout choice, and of moving a tensor between layouts.

These are the numbers the solver minimises. Compute is a roofline on the local share of the work;
backward is `BACKWARD_FACTOR` x forward where gradients flow; communication is the alpha-beta time
of exactly the steps `redistribution_steps` lists (forward and, where gradients flow, backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.cost_model.collectives import collective_time
from meshplan.cost_model.compute import BACKWARD_FACTOR, op_bytes, op_flops, roofline_time
from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.redistribution import CommStep, backward_steps, redistribution_steps
from meshplan.ir.graph import TensorMeta
from meshplan.ir.placement import Partial, Placements, Replicate, Shard, local_shape


def work_split(outputs: Sequence[Placements | None], mesh_shape: tuple[int, ...]) -> int:
    """Devices sharing one op's work: an axis splits it when the op's outputs are sharded or partial there."""
    split = 1
    for a, n in enumerate(mesh_shape):
        if any(p is not None and isinstance(p[a], (Shard, Partial)) for p in outputs):
            split *= n
    return split


def compute_time(
    target: str,
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta | None],
    out_layouts: Sequence[Placements | None],
    mesh_shape: tuple[int, ...],
    cluster: ClusterPreset,
    *,
    backward: bool,
) -> float:
    """Seconds one device spends on this op per step (forward, plus backward when `backward`)."""
    split = work_split(out_layouts, mesh_shape)
    flops = op_flops(target, list(inputs), list(outputs)) / split
    nbytes = op_bytes(target, list(inputs), list(outputs)) / split
    dtype = next((m.dtype for m in outputs if m is not None), "float32")
    fwd = roofline_time(flops, nbytes, cluster.device, dtype)
    return fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd


def steps_time(steps: Sequence[CommStep], mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    return sum(
        collective_time(s.kind, s.nbytes, mesh_shape[s.axis], cluster.link_for_axis(mesh_shape, s.axis))
        for s in steps
        if s.communicates
    )


def transfer_time(
    meta: TensorMeta, src: Placements, dst: Placements, mesh_shape: tuple[int, ...], cluster: ClusterPreset, *, backward: bool
) -> float:
    """Seconds to move a tensor from `src` to `dst` layout (and its gradient back, when `backward`)."""
    fwd = redistribution_steps(meta, src, dst, mesh_shape)
    total = steps_time(fwd, mesh_shape, cluster)
    if backward:
        total += steps_time(backward_steps(fwd), mesh_shape, cluster)
    return total


def grad_sync_axes(layout: Placements) -> tuple[int, ...]:
    """Mesh axes over which a parameter's gradient is summed: those where the parameter is replicated."""
    return tuple(a for a, p in enumerate(layout) if isinstance(p, Replicate))


GRAD_BUCKET_BYTES = 25 * 2**20
"""Gradients are all-reduced in buckets of about this size (DDP's default `bucket_cap_mb=25`)."""


def grad_sync_time(
    meta: TensorMeta, layout: Placements, mesh_shape: tuple[int, ...], cluster: ClusterPreset, *, bucket_bytes: int = GRAD_BUCKET_BYTES
) -> float:
    """A parameter's share of the bucketed gradient all-reduce over its replicated axes: all of its
    bandwidth term, and the fixed (latency + call) part in proportion to the bucket it fills."""
    axes = grad_sync_axes(layout)
    group = math.prod(mesh_shape[a] for a in axes)
    if group == 1:
        return 0.0
    nbytes = math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.itemsize
    link = cluster.link_for_axes(mesh_shape, axes)
    fixed = collective_time("all_reduce", 1, group, link)
    share = min(1.0, nbytes / bucket_bytes)
    return collective_time("all_reduce", nbytes, group, link) - fixed + fixed * share


def bucket_time(nbytes: int, axes: tuple[int, ...], mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    """One bucket's all-reduce over `axes`."""
    group = math.prod(mesh_shape[a] for a in axes)
    return collective_time("all_reduce", nbytes, group, cluster.link_for_axes(mesh_shape, axes)) if group > 1 else 0.0


def local_bytes(meta: TensorMeta, layout: Placements, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.itemsize
