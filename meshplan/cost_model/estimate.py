"""Time and memory of one node under one layout choice, and of moving a tensor between layouts.

These are the numbers the solver minimises. Compute is a roofline on the local share of the work;
backward is `BACKWARD_FACTOR` x forward where gradients flow; communication is the alpha-beta time
of exactly the steps `redistribution_steps` lists (forward and, where gradients flow, backward).

With a measured profile on the cluster (`ClusterPreset.profile`), an op's time is its measured
forward + backward on the local shapes, on a GPU no less than the host takes to issue them
(`Profile.host_op_run_s`), plus the measured in-program overhead of its runs (`Profile.overhead_line`),
times the measured compute contention of the world size;
a collective's time is its fitted alpha + bytes * beta for that group and world size, and the
runtime's local copies around collectives (chunk, pad, cat, stack, clone: see
`runtime/collectives.py`) are priced at the measured copy rate. What the profile lacks falls back
to the presets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.cost_model.collectives import collective_time
from meshplan.cost_model.compute import BACKWARD_FACTOR, op_bytes, op_flops, roofline_time
from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.profile import OpTiming, Profile, axis_label
from meshplan.cost_model.redistribution import COMMUNICATING, DUAL_KIND, CommStep, backward_steps, redistribution_steps, step_cuts
from meshplan.ir.graph import TensorMeta
from meshplan.ir.placement import Partial, Placements, Replicate, Shard, local_shape


def work_split(outputs: Sequence[Placements | None], mesh_shape: tuple[int, ...], inputs: Sequence[Placements] | None = None) -> int:
    """Devices sharing one op's work: an axis splits it when an output is sharded there, or partial there from an
    input sharded there (a matmul over a split contraction dim). A pointwise op on partial sums (a residual add
    of two partial tensors) gives partial sums from whole-sized local tensors: every device does all of its work.
    Without `inputs`, a partial output counts as split."""
    split = 1
    for a, n in enumerate(mesh_shape):
        sharded = any(p is not None and isinstance(p[a], Shard) for p in outputs)
        partial = any(p is not None and isinstance(p[a], Partial) for p in outputs)
        if sharded or partial and (inputs is None or any(isinstance(p[a], Shard) for p in inputs)):
            split *= n
    return split


def measured_seconds(timing: OpTiming, backward: bool) -> float:
    """A profiled op's forward, plus its backward when gradients flow (`BACKWARD_FACTOR` x forward if that was not timed)."""
    if not backward:
        return timing.forward_s
    return timing.forward_s + (timing.backward_s if timing.backward_s is not None else BACKWARD_FACTOR * timing.forward_s)


def host_floored(seconds: float, runs: int, host_op_run_s: float | None) -> float:
    """`seconds` of an op's `runs` (1, or 2 with its backward), on a GPU (`host_op_run_s` measured) no less than the host
    takes to issue them: kernels shorter than their launch leave the GPU waiting for the host (an H200 ran a GPT's
    10.6 ms of kernels in a 30.8 ms step, 5.8 ms in 33.7 at a quarter of the batch: run 14 of benchmarks/results)."""
    return seconds if host_op_run_s is None else max(seconds, runs * host_op_run_s)


def profiled_seconds(prof: Profile, seconds: float, runs: int) -> float:
    """`seconds` of an op's `runs` (isolated) as a step on `prof`'s device spends them: floored by the host
    (`host_floored`), plus the in-program overhead of runs of that size (`Profile.overhead_line`)."""
    per_run, per_second = prof.overhead_line
    return host_floored(seconds, runs, prof.host_op_run_s) + runs * per_run + per_second * seconds


def compute_time(
    target: str,
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta | None],
    out_layouts: Sequence[Placements | None],
    mesh_shape: tuple[int, ...],
    cluster: ClusterPreset,
    *,
    backward: bool,
    in_layouts: Sequence[Placements] | None = None,
    causal: bool = False,
) -> float:
    """Seconds one device spends on this op per step (forward, plus backward when `backward`).

    `in_layouts` (the strategy's input layouts) lets a measured profile find the op's local shapes. `causal`: attention
    called with `is_causal=True`, whose roofline counts the pairs the mask keeps (`compute.attention_pairs`); a profile
    timed the traced op itself, its mask included (`profiling/op_profiler.py` calls the node), so it stands as measured."""
    prof = cluster.profile
    if prof is not None and in_layouts is not None:
        loc_in = [_local_meta(m, p, mesh_shape) for m, p in zip(inputs, in_layouts)]
        loc_out = [_local_meta(m, p, mesh_shape) for m, p in zip(outputs, out_layouts)]
        t = prof.op(target, loc_in, loc_out)
        if t is not None:
            runs = 2 if backward else 1  # the op runs in forward, and its backward node in backward
            return profiled_seconds(prof, measured_seconds(t, backward), runs) * prof.slowdown(math.prod(mesh_shape))
    split = work_split(out_layouts, mesh_shape, in_layouts)
    flops = op_flops(target, list(inputs), list(outputs), causal=causal) / split
    nbytes = op_bytes(target, list(inputs), list(outputs)) / split
    dtype = next((m.dtype for m in outputs if m is not None), "float32")
    fwd = roofline_time(flops, nbytes, cluster.device, dtype)
    if prof is not None:  # not profiled: the roofline plus the dispatch cost every measured op pays
        fwd += prof.op_overhead_s or 0.0
        runs = 2 if backward else 1
        return profiled_seconds(prof, fwd * (1.0 + BACKWARD_FACTOR if backward else 1.0), runs) * prof.slowdown(math.prod(mesh_shape))
    return fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd


def _local_meta(meta: TensorMeta | None, layout: Placements | None, mesh_shape: tuple[int, ...]) -> TensorMeta | None:
    if meta is None or layout is None:
        return meta
    return TensorMeta(local_shape(meta.shape, layout, mesh_shape), meta.dtype)


def group_collective_time(kind: str, nbytes: int, axes: tuple[int, ...], mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    """One collective over the mesh `axes`: the profile's fit for this mesh axis (else this group
    size and world size) if it has one, else the alpha-beta ring model on the axes' link."""
    group = math.prod(mesh_shape[a] for a in axes)
    if group == 1 or nbytes == 0:
        return 0.0
    # the label names a profile's fit: not built when there is no profile (pricing a plan asks this for every move)
    label = axis_label(mesh_shape, axes[0]) if len(axes) == 1 and cluster.profile is not None else ""
    return measured_collective_time(kind, nbytes, group, math.prod(mesh_shape), cluster.link_for_axes(mesh_shape, axes), cluster, label)


def measured_collective_time(kind: str, nbytes: int, group: int, world: int, link, cluster: ClusterPreset, axis: str = "") -> float:
    """One collective over `group` of the `world` ranks: the profile's fit (of this mesh axis if `axis`
    names one measured) if it has one, else the alpha-beta ring model on `link`."""
    if group == 1 or nbytes == 0:
        return 0.0
    fit = cluster.profile.collective(kind, group, world, axis) if cluster.profile is not None else None
    return fit.time(nbytes) if fit is not None else collective_time(kind, nbytes, group, link)


def local_copy_bytes(step: CommStep, n: int) -> float:
    """Bytes the runtime copies on the device around one step on an axis of `n` ranks
    (runtime/collectives.py `run_step` / `_communicate`)."""
    b = step.nbytes
    if n == 1:
        return 0.0
    if step.kind == "chunk":  # chunk(...)[me].contiguous(): a copy unless the chunk is already contiguous (dim 0)
        return b / n if step.dim > 0 else 0.0
    if step.kind == "pad":  # new_zeros of the full tensor, then the shard copied in
        return b * n + b
    if step.kind == "to_partial":  # zeros_like on every rank but the first
        return b
    extra = b if step.reduce == "avg" else 0.0  # out / n
    if step.kind == "all_reduce":  # clone into the buffer reduced in place
        return b + extra
    if step.kind in ("all_gather", "reduce_scatter"):  # cat of the blocks when the dim is not 0
        return (b if step.dim > 0 else 0.0) + extra
    if step.kind == "all_to_all":  # stack of the pieces, cat of what arrived
        return 2 * b + extra
    return 0.0


def steps_time(steps: Sequence[CommStep], mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    total = sum(group_collective_time(s.kind, s.nbytes, (s.axis,), mesh_shape, cluster) for s in steps if s.communicates)
    rate = cluster.profile.copy_seconds_per_byte if cluster.profile is not None else None
    if rate:
        total += rate * sum(local_copy_bytes(s, mesh_shape[s.axis]) for s in steps)
    return total


def transfer_times(meta: TensorMeta, src: Placements, dst: Placements, mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> tuple[float, float]:
    """(Seconds of the forward move, seconds of its gradient's move back): one redistribution plan for both.

    `steps_time` of `redistribution_steps` and of their `backward_steps`, the same sums in the same order, read off
    the move's `step_cuts` (the planner asks this for every layout pair of every edge, mostly for tensors it has not
    priced that pair for: building the steps themselves was most of it)."""
    rate = cluster.profile.copy_seconds_per_byte if cluster.profile is not None else None
    if rate:  # the copies around each step are priced by the steps themselves
        fwd = redistribution_steps(meta, src, dst, mesh_shape)
        return steps_time(fwd, mesh_shape, cluster), steps_time(backward_steps(fwd), mesh_shape, cluster)
    found = step_cuts(src, dst, mesh_shape)
    if isinstance(found, Exception):
        raise type(found)(*found.args)
    forward, backward = [], []
    itemsize = meta.itemsize if found else 0
    for kind, axis, _, _, cuts in found:
        if kind in COMMUNICATING:  # so is its dual: the local kinds are each other's duals
            local = list(meta.shape)
            for d, n in cuts:
                local[d] //= n
            nbytes = itemsize
            for size in local:
                nbytes *= size
            forward.append(group_collective_time(kind, nbytes, (axis,), mesh_shape, cluster))
            backward.append(group_collective_time(DUAL_KIND[kind], nbytes, (axis,), mesh_shape, cluster))
    return sum(forward), sum(reversed(backward))


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
    fixed = group_collective_time("all_reduce", 1, axes, mesh_shape, cluster)
    share = min(1.0, nbytes / bucket_bytes)
    return bucket_time(nbytes, axes, mesh_shape, cluster) - fixed + fixed * share


def bucket_time(nbytes: int, axes: tuple[int, ...], mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    """One bucket's all-reduce over `axes`, as runtime/grad_buckets.py runs it: the gradients are
    copied into the bucket's flat buffer, all-reduced, and copied back (copies priced with a profile).

    No overlap with backward is discounted: the runtime does launch each bucket asynchronously as
    soon as it is full, but the solver has no backward timeline to hide it under (and on a CPU whose
    cores the ranks share, gloo's communication thread competes with backward for them)."""
    group = math.prod(mesh_shape[a] for a in axes)
    if group == 1:
        return 0.0
    t = group_collective_time("all_reduce", nbytes, axes, mesh_shape, cluster)
    rate = cluster.profile.copy_seconds_per_byte if cluster.profile is not None else None
    return t + (2 * nbytes * rate if rate else 0.0)


def local_bytes(meta: TensorMeta, layout: Placements, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.itemsize


_OPTIMIZER_BYTES_PER_ELEMENT = {"adam": 28, "adamw": 28, "sgd": 12, "sgd_momentum": 20, "adagrad": 20, "rmsprop": 20}
"""Bytes an optimizer step reads + writes per fp32 element without a profile (Adam: reads param,
grad, exp_avg, exp_avg_sq, writes param, exp_avg, exp_avg_sq)."""


def optimizer_step_time(numels: Sequence[int], optimizer: str, mesh_shape: tuple[int, ...], cluster: ClusterPreset,
                        *, dtensor: bool = False) -> float:
    """Seconds of one `optimizer.step()` over this device's parameter tensors (`numels`, local
    elements each): the profile's per-tensor + per-element rate (times contention), else memory
    traffic at the device's bandwidth. The planner prices each trainable parameter's step on its
    local shard (`Plan.optimizer_s`), so sharding optimizer state also shortens the step.
    `dtensor`: the parameters are DTensors (the runtime's sharded parameters), which costs the
    profile's measured dispatch overhead per tensor more."""
    prof = cluster.profile
    if prof is not None and optimizer in prof.optimizer_steps:
        per_tensor, per_element = prof.optimizer_steps[optimizer]
        if dtensor:
            per_tensor += prof.dtensor_optimizer_s.get(optimizer, 0.0)
        return (per_tensor * len(numels) + per_element * sum(numels)) * prof.slowdown(math.prod(mesh_shape))
    if optimizer not in _OPTIMIZER_BYTES_PER_ELEMENT:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(_OPTIMIZER_BYTES_PER_ELEMENT)}")
    return _OPTIMIZER_BYTES_PER_ELEMENT[optimizer] * sum(numels) / cluster.device.memory_bandwidth


def dtensor_view_time(mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    """Seconds one trainable parameter costs per forward + backward as a DTensor rather than a plain tensor: the
    per-rank program reads it through `runtime.local_view` (the profile's measured `dtensor_view_s`, times
    contention; 0 without a profile)."""
    prof = cluster.profile
    if prof is None or not prof.dtensor_view_s:
        return 0.0
    return prof.dtensor_view_s * prof.slowdown(math.prod(mesh_shape))


def dtensor_step_overhead(optimizer: str, mesh_shape: tuple[int, ...], cluster: ClusterPreset) -> float:
    """Seconds one parameter tensor's optimizer step costs more as a DTensor than as a plain tensor
    (the profile's measured dispatch; 0 without a profile)."""
    return optimizer_step_time([0], optimizer, mesh_shape, cluster, dtensor=True) - optimizer_step_time([0], optimizer, mesh_shape, cluster)
