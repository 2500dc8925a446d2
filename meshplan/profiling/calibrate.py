"""Measure a model's ops on this device for every shape its candidate plans would run.

    profile = profile_model(model, (tokens,), devices=(2, 4))   # every mesh of 2 and 4 devices
    profile.save("cpu.json");  meshplan.plan(model, 4, (tokens,), profile="cpu.json")

`profile_model` traces the model, lists the candidate strategies of every op on every mesh the
planner would search, collects the distinct (op, local input shapes, local output shapes, dtype)
they produce and times each once (`profiling/op_profiler.py`). It composes ir, planner and
cost_model, so it sits beside `api.py` rather than inside the cost model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import statistics
import warnings
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from meshplan.cost_model.estimate import host_floored
from meshplan.cost_model.program_overhead import mean_op_run_s, op_runs
from meshplan.profiling.op_profiler import (OPTIMIZERS, copy_rate, grad_call_overhead, make_tensor, op_overhead, optimizer_rate,
                                             time_function, time_op, time_program)
from meshplan.cost_model.profile import OpTiming, Profile, device_name, op_key, profile_path, save_merged, torch_version
from meshplan.ir.graph import Graph, TensorMeta
from meshplan.ir.regions import region_op
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import local_shape
from meshplan.progress import phase

log = logging.getLogger("meshplan")


def _local(meta: TensorMeta | None, layout, mesh_shape: tuple[int, ...]) -> TensorMeta | None:
    if meta is None or layout is None:
        return meta
    return TensorMeta(local_shape(meta.shape, layout, mesh_shape), meta.dtype)


def op_workload(graph: Graph, meshes: Iterable[MeshSpec], regions: dict | None = None) -> dict[str, tuple[str, tuple, tuple, tuple]]:
    """key -> (node name, local input metas, input needs-grad flags, local output metas): one entry
    per distinct op on local shapes over every candidate strategy on every mesh (and one device). `regions`, if
    given, collects key -> make of the region ops' own timed work on those candidates (`RegionOp.timed_work`)."""
    from meshplan.planner.strategies import UnsupportedOpWarning, generate

    work: dict[str, tuple[str, tuple, tuple, tuple]] = {}

    def add(node, ins, outs) -> None:
        key = op_key(node.target, ins, outs)
        if key not in work:
            needs = tuple(graph[r.node].grad(r.index) for r in node.inputs)
            work[key] = (node.name, ins, needs, outs)

    ops = [n for n in graph.nodes if n.kind == "op"]
    for node in ops:  # one device: global shapes (what a replicated strategy also runs)
        add(node, tuple(graph.meta(r) for r in node.inputs), node.outputs)
    for mesh in meshes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsupportedOpWarning)
            cands = generate(graph, mesh)
        for node in ops:
            in_metas = [graph.meta(r) for r in node.inputs]
            region = region_op(node.target) if regions is not None else None
            for s in cands.by_node[node.name]:
                ins = tuple(_local(m, p, mesh.shape) for m, p in zip(in_metas, s.inputs))
                outs = tuple(_local(m, p, mesh.shape) for m, p in zip(node.outputs, s.outputs))
                add(node, ins, outs)
                timed = region.timed_work(node, in_metas, s, mesh.shape) if region is not None else None
                if timed is not None:
                    regions.setdefault(*timed)
    return work


def profile_graph(
    graph: Graph, meshes: Iterable[MeshSpec], *, cluster: str = "cpu", device: str | torch.device | None = None,
    threads: int | None = 1, budget_s: float = 0.05, queued: int = 1, hide_launch: bool = True, programs: Sequence[Graph] = (),
) -> Profile:
    """Time every op of `graph` on every local shape its candidates on `meshes` produce, and the
    optimizer step on the graph's parameter sizes. `queued`, `hide_launch`: see `op_profiler.time_op`. `programs`: the
    same model traced at other batch sizes; their one-device programs are timed beside `graph`'s (and their ops where
    the meshes' shapes miss one), each a point of `Profile.program_overheads`."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels: dict = {}
    graphs = (graph, *programs)
    work = {key: (graph, *item) for key, item in op_workload(graph, meshes, kernels).items()}
    for other in programs:
        work.update({key: (other, *item) for key, item in op_workload(other, ()).items() if key not in work})
    fx_nodes = {id(g): {n.name: n for n in g.fx.gm.graph.nodes} for g in graphs}
    with _rank_threads(dev, threads) as used:
        timings = {}
        failed = []
        grad_call = grad_call_overhead(dev)
        samples: list[list[tuple[float, float]]] = [[] for _ in graphs]  # each program's (seconds, host seconds), spread over the op timings
        sample_at, sampling = {len(work) * j // PROGRAM_SAMPLES for j in range(PROGRAM_SAMPLES)}, True
        for i, (key, (owner, name, ins, needs, outs)) in enumerate(work.items()):
            if sampling and i in sample_at:
                sampling = all([_sample_program(g, dev, s) for g, s in zip(graphs, samples)])
            if i % 20 == 0:
                phase(f"timing op {i + 1}/{len(work)}")
            out_shape = outs[0].shape if outs and outs[0] is not None else None
            try:
                timings[key] = time_op(fx_nodes[id(owner)][name], ins, needs, out_shape, device=dev, budget_s=budget_s,
                                       grad_call_s=grad_call, queued=queued, hide_launch=hide_launch)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:  # an op that rejects made-up values
                failed.append(f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        timings.update(_time_kernels(kernels, dev, budget_s, grad_call, failed))
        if failed:
            log.warning("%d op shapes could not be timed (the roofline prices them): %s", len(failed), "; ".join(failed[:5]))
        overhead, copy = op_overhead(dev), copy_rate(dev)
        measured = [program_overhead(g, timings, s, dev) for g, s in zip(graphs, samples)]
        node_overhead, host_op_run, _ = measured[0]
        numels = [n.out.numel for n in graph.nodes if n.kind == "param" and n.grad(0)]
        optimizers = {name: optimizer_rate(name, dev, numels) for name in OPTIMIZERS}
    return Profile(
        device=device_name(dev), torch_version=torch_version(), cluster=cluster, threads=used,
        ops=timings, copy_seconds_per_byte=copy, op_overhead_s=overhead, optimizer_steps=optimizers, node_overhead_s=node_overhead,
        host_op_run_s=host_op_run, program_overheads=tuple((op_run, per_run) for per_run, _, op_run in measured if op_run is not None),
    )


@contextlib.contextmanager
def _rank_threads(device: torch.device, threads: int | None) -> Iterator[int]:
    """Time on `threads` CPU threads (None: as set), as each rank of run_local / torchrun on the CPU runs; yields the
    count in use, and puts the caller's back after."""
    before = torch.get_num_threads()
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield threads or before
    finally:
        torch.set_num_threads(before)


def _time_kernels(kernels: dict, device: torch.device, budget_s: float, grad_call_s: float, failed: list[str]) -> dict[str, OpTiming]:
    """Region ops' kernels of several ops (a context-parallel rank's blocks), timed: key -> timing; failures to `failed`."""
    timings = {}
    for key, make in kernels.items():
        try:
            run, leaves = make(device)
            timings[key] = time_function(run, leaves, device=device, budget_s=budget_s, grad_call_s=grad_call_s)
        except (RuntimeError, ValueError) as e:
            failed.append(f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return timings


def time_region_kernels(graph: Graph, meshes: Iterable[MeshSpec], *, device: str | torch.device = "cpu", threads: int | None = 1,
                        budget_s: float = 0.05) -> dict[str, OpTiming]:
    """Only the region ops' own kernels of `graph`'s candidates on `meshes` (what `profile_graph` times besides the
    ops), key -> timing: to add to a profile measured on other graphs (`dataclasses.replace(profile, ops=...)`)."""
    dev = torch.device(device)
    kernels: dict = {}
    op_workload(graph, meshes, kernels)
    failed: list[str] = []
    with _rank_threads(dev, threads):
        timings = _time_kernels(kernels, dev, budget_s, grad_call_overhead(dev), failed)
    if failed:
        log.warning("%d region kernels could not be timed (the roofline prices them): %s", len(failed), "; ".join(failed[:5]))
    return timings


PROGRAM_SAMPLES = 5
"""Timings of the whole one-device program per profile, spread evenly over the op timings; `program_overhead` keeps
their median. Its overhead is the difference of two large figures (the program, the sum of its ops), so a few per
cent on the program is tens of per cent on the overhead, and the program's speed drifts over seconds: in one process
with fixed op timings, 25 timings of 15 runs read 11.8-32.1 us per op run for the medium fidelity GPT, the median of
5 taken 5 s apart 14.0-16.8 (2026-11-27, docs/cost_model.md)."""


def one_device_program(graph: Graph, device: torch.device) -> tuple[torch.nn.Module, list]:
    """(the graph's one-device program, made-up inputs and parameters for it, made the way the op profiler makes its
    tensors)."""
    args = []
    for ph in graph.fx.gm.graph.nodes:
        if ph.op != "placeholder":
            continue
        if ph.name in graph.fx.constants:  # lifted tensor literals stay where the trace made them: move them
            args.append(graph.fx.constants[ph.name].to(device))
        else:
            node = graph[ph.name]
            args.append(make_tensor(node.out, device, requires_grad=node.kind == "param" and node.grad(0)))
    gm = graph.fx.gm
    if any(isinstance(n.kwargs.get("device"), torch.device) for n in gm.graph.nodes):
        # tensors the model makes (arange, zeros) keep the trace's device: put them on `device`, as the runtime's rewrite does
        gm = copy.deepcopy(gm)
        for n in gm.graph.nodes:
            if isinstance(n.kwargs.get("device"), torch.device):
                n.kwargs = {**n.kwargs, "device": device}
        gm.recompile()
    return gm, args


def _sample_program(graph: Graph, device: torch.device, samples: list[tuple[float, float]]) -> bool:
    """Time the graph's one-device program once more into `samples` (its made-up tensors freed after, so that they do
    not take a device's memory from the ops timed meanwhile); False (logged) if it fails on them."""
    try:
        samples.append(time_program(*one_device_program(graph, device)))
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # made-up values an op rejects
        log.warning("in-program overhead not measured: the one-device program failed on made-up inputs: %s", str(e).splitlines()[0][:200])
        return False
    return True


def program_overhead(graph: Graph, timings: dict, samples: Sequence[tuple[float, float]],
                     device: torch.device) -> tuple[float | None, float | None, float | None]:
    """(`Profile.node_overhead_s`, `Profile.host_op_run_s`, the ops' mean isolated seconds per run) of the graph's
    one-device program from `samples`, its forward + backward timings (`time_program`: seconds, host seconds), whose
    median is taken: on a GPU, the host's seconds per op run issuing it; the seconds per op run it takes beyond its
    ops' isolated timings (on a GPU, each no less than its runs' share of the host's: `estimate.profiled_seconds`).
    None where an op of it was not timed or the program did not run."""
    ops, missing = op_runs(graph, timings)  # (isolated seconds, runs) per op
    if missing:
        log.warning("in-program overhead not measured: op %s has no timing", missing[0])
        return None, None, None
    if not samples:
        return None, None, None
    runs = sum(r for _, r in ops)
    measured, host = statistics.median(s for s, _ in samples), statistics.median(h for _, h in samples)
    host_op_run = host / max(runs, 1) if device.type == "cuda" else None
    iso = sum(host_floored(s, r, host_op_run) for s, r in ops)
    per_run = max(measured - iso, 0.0) / max(runs, 1)
    log.info("one-device program: %.2f ms measured (median of %d, host %.2f ms), %.2f ms by its ops' profiles: %.1f us per "
             "op run (%d runs)", measured * 1e3, len(samples), host * 1e3, iso * 1e3, per_run * 1e6, runs)
    return per_run, host_op_run, mean_op_run_s(ops)


def profile_model(
    model: nn.Module, example_inputs: tuple = (), devices: Sequence[int] = (2, 4), *, example_kwargs: dict | None = None,
    cluster: str = "cpu", out: str | os.PathLike | None = None, budget_s: float = 0.05, mixed_precision: str = "auto",
) -> Profile:
    """Profile `model`'s ops for every mesh of each device count in `devices` (as `meshplan.plan`
    would search them, in the precision it would trace them in). With `out` (a path, or "local" for
    this machine's database file), the measurements are merged into that file."""
    from meshplan.planner.meshes import resolve_mesh
    from meshplan.cost_model.presets import get_cluster
    from meshplan.ir.precision import resolve_precision
    from meshplan.ir.trace import trace

    preset = get_cluster(cluster)
    for d in devices:
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise ValueError(f"devices must be positive ints; got {d!r} in {tuple(devices)!r}")
    meshes = [m for d in devices for m in resolve_mesh(d, devices_per_node=preset.devices_per_node)]
    phase(f"tracing {type(model).__name__}")
    precision = resolve_precision(mixed_precision, auto=preset.device.default_precision)
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    graph = trace(model, example_inputs, example_kwargs, precision=precision)
    profile = profile_graph(graph, meshes, cluster=preset.name, budget_s=budget_s,
                            programs=_smaller_batch(model, example_inputs, example_kwargs, max(devices), precision))
    if out is not None:
        path = profile_path() if str(out) == "local" else out
        profile = save_merged(profile, path)
        log.info("profile written to %s", path)
    return profile


def _smaller_batch(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None, devices: int, precision) -> tuple[Graph, ...]:
    """The model traced at the batch one of `devices` data-parallel ranks runs (none when that is the whole batch or
    less than a sample): a second program for the in-program overhead, whose dependence on the ops' size is what a
    sharded plan's ranks pay (`Profile.overhead_line`)."""
    from meshplan.ir.trace import trace
    from meshplan.planner.pipeline import microbatch_call

    first = example_inputs[0] if example_inputs else None
    batch = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 0
    if batch // devices < 1 or devices == 1:
        return ()
    inputs, kwargs = microbatch_call(example_inputs, example_kwargs, batch // devices)
    return (trace(model, inputs, kwargs, precision=precision),)


def _comm_worker(rank: int, world: int, cluster: str, sizes: tuple[int, ...], reps: int) -> dict:
    from meshplan.profiling.comm_profiler import measure_cluster

    return measure_cluster(cluster=cluster, sizes=sizes, reps=reps).to_json()


CONTENTION_LAUNCHES = 5
"""Launches whose compute contention `profile_comm` takes the median of, per world. Within one launch the probe is
stable; between launches it is not (4 ranks on this 2-core machine: 2.13 to 2.78 in 2026-11-27's calibrations, about
2.3 in most of 24 launches), and the plans are measured each in launches of their own."""


def _contention_worker(rank: int, world: int) -> float:
    from meshplan.profiling.comm_profiler import measure_contention

    return measure_contention()


def profile_comm(
    worlds: Sequence[int] = (2, 4), *, cluster: str = "cpu", sizes: Sequence[int] | None = None, reps: int = 5,
    out: str | os.PathLike | None = None, timeout: float = 1800.0,
) -> Profile:
    """Measure collectives and compute contention on `worlds` local gloo processes each
    (`runtime.launch.run_local`; the contention is the median of `CONTENTION_LAUNCHES` launches); merge into `out`
    ("local": this machine's database file)."""
    from meshplan.profiling.comm_profiler import FULL_SIZES
    from meshplan.runtime.launch import run_local

    sizes = tuple(sizes or FULL_SIZES)
    profile: Profile | None = None
    for w in worlds:
        if not isinstance(w, int) or isinstance(w, bool) or w < 2:
            raise ValueError(f"worlds must be ints >= 2 (a collective needs two ranks); got {w!r} in {tuple(worlds)!r}")
        phase(f"collectives on {w} local processes")
        got = Profile.from_json(run_local(w, _comm_worker, cluster, sizes, reps, timeout=timeout)[0])
        launches = [got.contention[w]] + [run_local(w, _contention_worker, timeout=timeout)[0] for _ in range(CONTENTION_LAUNCHES - 1)]
        log.info("compute contention on %d processes, %d launches: %s", w, len(launches), ", ".join(f"{c:.2f}" for c in launches))
        got = dataclasses.replace(got, contention={w: statistics.median(launches)})
        profile = got if profile is None else profile.merged(got)
    if profile is None:
        raise AssertionError("no world measured")
    if out is not None:
        profile = save_merged(profile, profile_path() if str(out) == "local" else out)
    return profile


def profile_comm_torchrun(*, cluster: str, sizes: Sequence[int], reps: int, out: str | os.PathLike | None) -> Profile:
    """Under torchrun: measure on the launched group; rank 0 merges into `out`."""
    import torch.distributed as dist

    from meshplan.profiling.comm_profiler import measure_cluster
    from meshplan.runtime.launch import init_torchrun_group

    if torch.cuda.is_available():  # before the group exists, so NCCL binds this rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        init_torchrun_group()
    profile = measure_cluster(cluster=cluster, sizes=tuple(sizes), reps=reps)
    if out is not None and dist.get_rank() == 0:
        profile = save_merged(profile, profile_path() if str(out) == "local" else out)
    dist.barrier()
    return profile
