"""Measure the interconnect: collectives per mesh axis over message sizes, fitted to alpha-beta.

`measure_cluster` runs on every rank of an initialised process group (torchrun, or
`runtime.launch.run_local`). For each mesh shape and axis it runs all_reduce, all_gather,
reduce_scatter, all_to_all and send/recv (a ring shift) with the same torch.distributed calls the
runtime issues (`all_gather_single`, `reduce_scatter_single`, `all_to_all_single`, in-place
`all_reduce`, `batch_isend_irecv`). Every group of the axis runs at once, as in a real step, so the
fit includes the contention between them (on a CPU: for cores, too). Per size the time is the
mean over repetitions of the slowest rank; `fit_alpha_beta` then fits alpha + bytes * beta with
relative weights, so that 4 KB and 256 MB messages count alike.

It also measures what the pipelining runtime costs per schedule action (profiling/pipeline_overhead.py),
what an optimizer step and a forward + backward cost more per parameter when parameters are DTensors, and compute
contention: the same small training-like workload on rank 0 alone and on all ranks at once; the
ratio is how much slower each rank computes when the world runs together (about world / cores when
ranks outnumber cores).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshplan.cost_model.collectives import COLLECTIVE_KINDS
from meshplan.cost_model.line_fit import nonnegative_line
from meshplan.cost_model.profile import CollectiveFit, Profile, axis_label, device_name, torch_version
from meshplan.profiling.op_profiler import OPTIMIZERS, Timer, dtensor_optimizer_overhead, dtensor_view_overhead
from meshplan.profiling.pipeline_overhead import measure_schedule_overhead

FULL_SIZES: tuple[int, ...] = tuple(4 * 2**10 * 4**k for k in range(10))
"""4 KiB, 16 KiB, ..., 256 MiB (bytes of the full tensor, as `collective_time` counts them)."""
QUICK_SIZES: tuple[int, ...] = (4 * 2**10, 64 * 2**10, 2**20)
"""A small range for CI and smoke tests."""


def fit_alpha_beta(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """(alpha_s, seconds_per_byte) minimising the squared RELATIVE error of alpha + beta * size,
    both clamped at >= 0 (a negative latency or bandwidth is noise, not physics)."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta needs >= 2 (size, time) pairs of equal length; got {len(sizes)} sizes, {len(times)} times")
    fit = nonnegative_line(sizes, times, [1.0 / max(t, 1e-12) ** 2 for t in times])
    if fit is None:
        raise ValueError(f"fit_alpha_beta needs at least two different sizes; got {sorted(set(sizes))}")
    return fit


def _groups(mesh_shape: tuple[int, ...], axis: int, rank: int) -> tuple[object, list[int]]:
    """Create (collectively) every group along `axis`; return this rank's group and its ranks."""
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    mine = None
    others = [a for a in range(len(mesh_shape)) if a != axis]
    for fixed in itertools.product(*(range(mesh_shape[a]) for a in others)):
        ranks = [r for r, c in enumerate(coords) if all(c[a] == v for a, v in zip(others, fixed))]
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = (pg, ranks)
    if mine is None:
        raise AssertionError((mesh_shape, axis, rank))
    return mine


def _device() -> torch.device:
    """NCCL needs CUDA tensors (the current device, which the launcher set per rank); gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(kind: str, nbytes: int, n: int, pg, ranks: list[int], rank: int):
    """A closure issuing one `kind` collective of `nbytes` (full-tensor bytes) on group `pg`."""
    numel = max(nbytes // 4 // n * n, n)
    torch.set_default_device(_device())
    if kind == "all_reduce":
        buf = torch.zeros(numel)
        return lambda: dist.all_reduce(buf, group=pg)
    if kind == "all_gather":
        out, inp = torch.empty(numel), torch.zeros(numel // n)
        return lambda: dist.all_gather_single(out, inp, group=pg)
    if kind == "reduce_scatter":
        out, inp = torch.empty(numel // n), torch.zeros(numel)
        return lambda: dist.reduce_scatter_single(out, inp, group=pg)
    if kind == "all_to_all":
        out, inp = torch.empty(numel), torch.zeros(numel)
        return lambda: dist.all_to_all_single(out, inp, group=pg)
    if kind != "send_recv":
        raise AssertionError(kind)
    me = ranks.index(rank)
    send, recv = torch.zeros(numel), torch.empty(numel)
    peer_to, peer_from = ranks[(me + 1) % n], ranks[(me - 1) % n]

    def ring_shift() -> None:
        ops = [dist.P2POp(dist.isend, send, peer_to, group=pg), dist.P2POp(dist.irecv, recv, peer_from, group=pg)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return ring_shift


def _issue(kind: str, nbytes: int, n: int, pg, ranks: list[int], rank: int):
    prev = torch.get_default_device()
    try:
        return _run(kind, nbytes, n, pg, ranks, rank)
    finally:
        torch.set_default_device(prev)


def _slowest_mean(samples: list[float]) -> float:
    """Mean of this rank's samples, then the largest over all ranks (a collective ends when the
    slowest does). The mean, not the median: a step runs many collectives and its time is their
    sum, whose typical value is the sum of their means. On a shared CPU the waits are heavy-tailed
    (most calls ~0.5 ms, a few 5-10 ms); medians missed a third to half of the collective time of
    FSDP steps here."""
    t = torch.tensor([statistics.fmean(samples)], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_axis(
    mesh_shape: tuple[int, ...], axis: int, *, sizes: Sequence[int] = FULL_SIZES, kinds: Sequence[str] = COLLECTIVE_KINDS,
    reps: int = 5, warmup: int = 1, budget_s: float = 0.3, gap_s: float = 1e-3,
) -> list[CollectiveFit]:
    """Fits for every kind on `axis` of `mesh_shape`; call on every rank. Each size gets at least
    `reps` timed runs after `warmup` (at least 2 when one run takes longer than `budget_s`), and up
    to 6x `reps` while they take less than `budget_s` together: small messages, the noisiest, get
    the most samples. Before each call every rank computes for `gap_s` (see `_compute`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(f"mesh shape {mesh_shape} has {math.prod(mesh_shape)} devices but the world size is {world}")
    pg, ranks = _groups(mesh_shape, axis, rank)
    n = mesh_shape[axis]
    for _ in range(3):  # a group connects on first use: keep that out of the timings
        dist.all_reduce(torch.zeros(1, device=_device()), group=pg)
    timer = Timer(_device())
    fits = []
    for kind in kinds:
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; allowed: {', '.join(COLLECTIVE_KINDS)}")
        measured = []
        for nbytes in sizes:
            fn = _issue(kind, nbytes, n, pg, ranks, rank)
            for _ in range(warmup):
                fn()
            samples: list[float] = []
            while True:
                # one call at a time after a stretch of compute, as a step issues them: ranks arrive
                # from work, not already waiting in the previous collective. Back-to-back calls
                # measured 2-4x less per call than the same collectives inside a step on gloo here
                _compute(gap_s)
                samples.append(timer(fn))
                # every rank must run the same number of collectives: rank 0 decides whether to go on
                more = torch.tensor([len(samples) < 2 or (len(samples) < 6 * reps and (len(samples) < reps or sum(samples) < budget_s))
                                     and not (len(samples) >= 2 and sum(samples) > budget_s * reps)], device=_device())
                dist.broadcast(more, src=0)
                if not bool(more.item()):
                    break
            measured.append(_slowest_mean(samples))
        alpha, beta = fit_alpha_beta(sizes, measured)
        label = axis_label(mesh_shape, axis)
        fits.append(CollectiveFit(kind=kind, group=n, world=world, axis=label, alpha_s=alpha, seconds_per_byte=beta,
                                  sizes=tuple(sizes), times=tuple(measured)))
    return fits


def _compute(seconds: float) -> None:
    """Busy this rank's cores for `seconds` with small matmuls (the ops between two collectives)."""
    if seconds <= 0:
        return
    a = torch.full((64, 64), 0.1)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def _workload(seconds: float = 0.4, *, median: bool = False, chunk_s: float = 0.02) -> float:
    """Seconds per iteration of a small MLP forward + backward (matmuls and small ops, like a tiny
    model), repeated for `seconds` of wall time so that ranks started together overlap throughout.
    By default the median over `chunk_s` windows of their mean iteration time: when ranks outnumber
    cores the scheduler time-slices them in slices of a few ms, so most short iterations run
    untouched and a few absorb all the waiting, which a window of many iterations (like a training
    step) averages; the median over windows ignores rare long stalls, as the median step time does.
    `median=True`: the median single iteration (undisturbed, like the op profiles' medians)."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(128, 256, requires_grad=True), torch.randn(256, 128, requires_grad=True)
    x = torch.randn(64, 128)
    times, chunks, start = [], [], time.perf_counter()
    chunk_start, chunk_n = start, 0
    while time.perf_counter() < start + seconds or len(times) < 5:
        t0 = time.perf_counter()
        y = torch.relu(x @ w1) @ w2
        y.square().mean().backward()
        times.append(time.perf_counter() - t0)
        chunk_n += 1
        if times[-1] + t0 - chunk_start >= chunk_s:
            chunks.append((t0 + times[-1] - chunk_start) / chunk_n)
            chunk_start, chunk_n = time.perf_counter(), 0
    if median or not chunks:
        return statistics.median(times)
    return statistics.median(chunks)


def measure_contention(pairs: int = 3, seconds: float = 0.3) -> float:
    """Per-rank compute slowdown when every rank works at once: the windowed iteration time of all
    ranks working together (see `_workload`) over the median (undisturbed) iteration of rank 0
    working alone. Op
    profiles are medians of undisturbed runs too, so this factor turns them into the wall time a
    rank sees in a real step, including time-slicing with other ranks and other load on the
    machine. Solo and together alternate `pairs` times; the median ratio is kept (the load of a
    shared machine drifts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ratios = []
    for _ in range(pairs):
        solo = torch.zeros(1, dtype=torch.float64, device=_device())
        dist.barrier()
        if rank == 0:
            solo[0] = _workload(seconds, median=True)
        dist.broadcast(solo, src=0)  # the others sleep in here (gloo waits on its socket)
        dist.barrier()
        together = torch.tensor([_workload(seconds)], dtype=torch.float64, device=_device())
        dist.all_reduce(together)
        ratios.append(float(together.item()) / world / float(solo.item()))
    return max(statistics.median(ratios), 1.0)


def mesh_shapes_for(world: int) -> list[tuple[int, ...]]:
    """The 1-D mesh and every 2-D factorisation: the axis sizes and concurrency a plan can use."""
    return [(world,)] + [(a, world // a) for a in range(2, world) if world % a == 0]


def _dtensor_overheads() -> tuple[dict[str, float], float]:
    """(`op_profiler.dtensor_optimizer_overhead` of every optimizer, `op_profiler.dtensor_view_overhead`), timed on
    rank 0 alone while the others wait (undisturbed, like the op profiles; contention is applied on top), sent to
    every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(_device().type, (dist.get_world_size(),))
    got = torch.zeros(len(OPTIMIZERS) + 1, dtype=torch.float64, device=_device())
    if dist.get_rank() == 0:
        got[:] = torch.tensor([dtensor_optimizer_overhead(name, mesh) for name in OPTIMIZERS] + [dtensor_view_overhead(mesh)],
                              dtype=torch.float64)
    dist.broadcast(got, src=0)
    *optimizers, view = got.tolist()
    return dict(zip(OPTIMIZERS, optimizers)), view


def measure_cluster(
    *, cluster: str = "cpu", sizes: Sequence[int] = FULL_SIZES, kinds: Sequence[str] = COLLECTIVE_KINDS, reps: int = 5,
    mesh_shapes: Sequence[tuple[int, ...]] | None = None,
) -> Profile:
    """Every rank: measure every axis of every mesh shape and the compute contention; returns the
    same `Profile` on every rank (the caller writes it from rank 0)."""
    world = dist.get_world_size()
    fits = []
    for shape in mesh_shapes or mesh_shapes_for(world):
        for axis in range(len(shape)):  # every axis: two axes of one size may sit on different links
            fits += measure_axis(tuple(shape), axis, sizes=sizes, kinds=kinds, reps=reps)
    contention = measure_contention() if world > 1 else 1.0
    overhead = measure_schedule_overhead() if world > 1 else {}
    dtensor_optimizer, dtensor_view = _dtensor_overheads()
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return Profile(
        device=device_name(dev), torch_version=torch_version(), cluster=cluster, threads=torch.get_num_threads(),
        collectives=tuple(fits), contention={world: contention}, backend=str(dist.get_backend()),
        pipeline_action_s={k: {world: a} for k, (a, _) in overhead.items()}, pipeline_step_s={k: {world: c} for k, (_, c) in overhead.items()},
        dtensor_optimizer_s=dtensor_optimizer, dtensor_view_s=dtensor_view,
    )
