"""The public entry points: `plan` (no devices needed) and `auto_parallelize` (inside torchrun)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshplan.cost_model.memory import format_bytes, parse_bytes
from meshplan.cost_model.presets import ClusterPreset, get_cluster
from meshplan.cost_model.profile import Profile, resolve_profile
from meshplan.ir.graph import Graph
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.mutations import assigned
from meshplan.ir.precision import MixedPrecision, resolve_precision
from meshplan.ir.trace import example_call, trace
from meshplan.planner.annotations import AnnotationError, module_annotations
from meshplan.planner.constraints import Annotations
from meshplan.planner.context_parallel_search import context_parallel_plans, searches_context_parallel
from meshplan.planner.meshes import Devices, resolve_mesh
from meshplan.planner.pipeline import PipelineOptions, microbatch_call, pipeline_options, plan_pipeline
from meshplan.planner.planner import MemoryBudgetError, PlanOptions, make_plan
from meshplan.planner.solver import InfeasiblePlan, SolveTimeout
from meshplan.plans.axes import warn_wasted
from meshplan.plans.plan import Plan
from meshplan.progress import phase
from meshplan.runtime.checkpoint import INFO_FILE, load_checkpoint
from meshplan.runtime.collectives import resolve_timeout
from meshplan.runtime.init_on_meta import FromInit
from meshplan.runtime.launch import init_torchrun_group
from meshplan.runtime.parallel_module import ParallelModule, check_model_device, default_weights, group_device
from meshplan.runtime.weights import Empty, FromSafetensors, WeightSource

log = logging.getLogger("meshplan")

def plan(
    model: nn.Module,
    devices: Devices,
    example_inputs: tuple = (),
    *,
    example_kwargs: dict | None = None,
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    cluster: str | ClusterPreset | None = None,
    mode: str = "auto",
    inputs: str = "global",
    strict: bool = False,
    param_layouts: dict | None = None,
    input_layouts: dict | None = None,
    optimizer: str = "adam",
    memory_budget: int | str | None = None,
    search: str | None = None,
    parameter_plan: dict | None = None,
    parallelize_plan: dict | None = None,
    recompute: str = "auto",
    offload: str = "never",
    profile: Profile | str | os.PathLike | None = None,
    pipeline: int | str | PipelineOptions | None = "multi_node",
    stage_config: dict[str, int] | None = None,
    time_limit_s: float = 60.0,
    mixed_precision: str | MixedPrecision = "auto",
    context_parallel: bool = True,
    token_order: bool | None = None,
) -> Plan:
    """Plan `model` for `devices` without running anything (meta or fake tensors are fine).

    With `mesh_shape=None` and an int `devices`, every factorisation into up to three axes (the
    innermost within a node of the cluster) is planned and the plan with the lowest predicted step
    time is returned. `memory_budget` bounds the predicted peak per device ('80GB', '16GiB' or
    bytes; default: the cluster device's memory); if no plan fits, the `MemoryBudgetError` says
    the smallest budget that would. `recompute` lets the solve recompute repeated layers' activations
    in backward when that beats other ways of fitting the budget ('auto'), or 'never' / 'always';
    `offload` ('never', 'auto', 'always') may keep optimizer state in host memory instead (train with
    `ParallelModule.make_optimizer`).
    Meshes that give no plan (the annotations cannot hold there, the budget is too small, the solve
    ran out of time) are skipped; the plan's `solver.skipped` says which and why. A returned plan with mesh axes that
    split nothing (their devices compute the same) warns with a `ReplicatedWorkWarning` saying why and which device
    counts the batch would split over (plans/axes.py).

    `time_limit_s`: seconds each mesh's solve may take. A solve stopped by it returns the best plan it
    has (at worst the propagation plan), labelled not proven optimal with its gap; meshes too large
    for one exact solve are searched one axis at a time (planner/neighbourhood.py) and labelled 'local'.

    Modes (`mode=`), `search=` and the annotations (`meshplan.shard` on submodules,
    `parameter_plan`, `parallelize_plan`, `input_layouts`) are described in docs/modes.md.

    `pipeline`: 'multi_node' (default) searches pipeline stages, schedule and microbatches (docs/pipeline.md)
    when an int `devices` spans more than one node of the cluster in mode 'auto' without layout
    annotations, and plans without a pipeline otherwise; 'auto' searches them for any device count, an int
    fixes the degree, a `PipelineOptions` says everything, None turns pipelines off. `stage_config` pins
    units to stages. A pipelined plan's `mesh` is one stage's sub-mesh and `plan.pipeline` holds the rest.

    `profile`: measured costs (a `Profile`, a profile JSON path, or "local" for this machine's
    database entry; see docs/cost_model.md). Without one the cluster's presets price everything,
    and a warning says so once.

    `mixed_precision`: 'bf16' computes in bf16 with fp32 master weights, optimizer state and gradient
    reduction; 'fp32' runs the model's own dtypes; or a `MixedPrecision` policy.
    'auto' (default): bf16 on clusters whose device has a bf16 peak above its fp32 peak (the GPU
    presets), else fp32. The plan records and prints which (ir/precision.py, docs/precision.md).

    `context_parallel`: whether the default mesh search and the pipeline search may add a `cp` axis (attention split
    along the sequence, docs/long_context.md) where it is priced cheaper; False plans without one unless you
    name one (`axis_names`, `PipelineOptions(context_degrees=)`).

    `token_order`: whether a mesh with a `cp` axis holds every tensor split over it in head-tail token order (rank r
    of P holds sequence chunks r and 2P-1-r of 2P), so causal attention does equal work on every rank with no
    exchange of queries (docs/long_context.md). None (default): the default mesh search plans its `cp` mesh both
    ways and keeps the cheaper; a named mesh keeps the contiguous order, and the pipeline search does as
    `PipelineOptions.token_order` says (contiguous by default; None: both). True: every `cp` mesh in token order,
    the pipeline search's too (a named mesh must have a `cp` axis). False: never.
    """
    if not isinstance(context_parallel, bool):
        raise ValueError(f"context_parallel must be True or False; got {context_parallel!r}")
    if token_order is not None and not isinstance(token_order, bool):
        raise ValueError(f"token_order must be True, False or None; got {token_order!r}")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be a positive number of seconds; got {time_limit_s!r}")
    example_inputs, example_kwargs = example_call(example_inputs, example_kwargs)
    if isinstance(cluster, str):
        cluster = get_cluster(cluster).name  # any case; an unknown name fails before the presets warning
    if profile is None and isinstance(cluster, ClusterPreset) and cluster.profile is not None:
        cluster_preset = cluster  # already calibrated
    else:
        default = "h100" if torch.cuda.is_available() else "cpu"
        measured = resolve_profile(profile, cluster if isinstance(cluster, str) or cluster is None else cluster.name, default)
        cluster_preset = get_cluster(cluster or (measured.cluster if measured is not None else default)).with_profile(measured)
    precision = resolve_precision(mixed_precision, auto=cluster_preset.device.default_precision)
    shard_annotations = module_annotations(model)  # meshplan.shard on submodules: layout annotations too
    annotated = bool(param_layouts or input_layouts or parameter_plan or parallelize_plan or shard_annotations)
    if pipeline == MULTI_NODE:
        pipeline = multi_node_pipeline(devices, mesh_shape, mode, annotated, cluster_preset)
    if pipeline is not None or stage_config:
        if not isinstance(devices, int) or mesh_shape is not None or mode != "auto" or annotated:
            raise ValueError("pipeline search takes an int `devices` and mode='auto' without mesh_shape or layout annotations; "
                             f"got devices={devices!r}, mesh_shape={mesh_shape!r}, mode={mode!r}"
                             f"{', layout annotations' if annotated else ''}; pass pipeline=None to plan without one")
        budget = None if memory_budget is None else float(parse_bytes(memory_budget))
        opts = pipeline_options("auto" if pipeline is None else pipeline, stage_config, optimizer, budget, float(time_limit_s))
        if not context_parallel and opts.context_degrees is None:
            opts = dataclasses.replace(opts, context_degrees=(1,))
        if token_order is not None:
            opts = dataclasses.replace(opts, token_order=token_order)
        result = plan_pipeline(model, devices, example_inputs, cluster=cluster_preset, options=opts, example_kwargs=example_kwargs,
                               precision=precision).plan
        warn_wasted(result)
        return result
    meshes = resolve_mesh(devices, mesh_shape, axis_names, cluster_preset.devices_per_node)
    # the default search: a cp axis is tried too, in the token orders asked for (a named mesh takes the order given)
    searched = context_parallel and isinstance(devices, int) and mesh_shape is None and not axis_names
    options = PlanOptions(
        mode=mode, inputs=inputs, strict=strict, param_layouts=dict(param_layouts or {}),
        input_layouts=dict(input_layouts or {}), optimizer=optimizer, memory_budget=memory_budget, search=search,
        recompute=recompute, offload=offload, time_limit_s=float(time_limit_s), token_order=bool(token_order) and not searched,
        annotations=Annotations(
            parameter_plan=dict(parameter_plan or {}), parallelize_plan=dict(parallelize_plan or {}), modules=shard_annotations
        ),
    )
    phase(f"tracing {type(model).__name__}")
    graph = trace(model, example_inputs, example_kwargs, precision=precision)
    # left to the search, token order is tried where it can be: it hands over whole tensors only (planner/token_order.py)
    orders = ((False, True) if inputs == "global" else (False,)) if token_order is None else (token_order,)
    result = search_meshes(graph, meshes, cluster_preset, options, model_name=type(model).__name__, context_parallel=searched,
                           token_orders=orders)
    warn_wasted(result)
    return result


MULTI_NODE = "multi_node"
"""`plan(pipeline=)`'s default: search pipeline stages when the devices span more than one node."""


def multi_node_pipeline(devices: Devices, mesh_shape: Sequence[int] | None, mode: str, annotated: bool,
                        cluster: ClusterPreset) -> str | None:
    """`pipeline='multi_node'` resolved: 'auto' (search) when an int `devices` spans more than one node of
    `cluster` and the search is free to choose the mesh, else None. Crossing nodes puts the slow link inside
    any mesh axis it splits, where a pipeline's point-to-point sends cost least."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices <= cluster.devices_per_node:
        return None
    if mesh_shape is not None or mode != "auto" or annotated:
        log.info("%d devices span %d-device nodes of %r, but pipeline stages are searched only in mode='auto' without "
                 "mesh_shape or layout annotations; planning without a pipeline", devices, cluster.devices_per_node, cluster.name)
        return None
    return "auto"


SEARCH_ERRORS = (MemoryBudgetError, AnnotationError, InfeasiblePlan, SolveTimeout)
"""What a mesh that gives no plan raises: the search skips it."""


def search_meshes(graph: Graph, meshes: list[MeshSpec], cluster: ClusterPreset, options: PlanOptions, *, model_name: str,
                  context_parallel: bool = False, token_orders: tuple[bool, ...] = (False,)) -> Plan:
    """The plan of least predicted step time over `meshes`. With several meshes, one that gives no
    plan (over the memory budget, annotations that cannot hold, no consistent choice, a solve out of
    time) is skipped with a logged reason, and the returned plan lists the skipped meshes and why.
    `context_parallel`: try the best mesh again with a `cp` axis (planner/context_parallel_search.py), in each of
    `token_orders` (`PlanOptions.token_order`)."""
    found: list[Plan] = []
    failed: list[tuple[MeshSpec, Exception]] = []
    for mesh in meshes:
        try:  # the plans found so far start the search of meshes too large to solve exactly
            p = make_plan(graph, mesh, cluster, options, model_name=model_name, earlier=found)
        except SEARCH_ERRORS as e:
            if len(meshes) == 1:
                raise
            log.info("mesh %s skipped: %s", mesh, e)
            failed.append((mesh, e))
            continue
        log.info("mesh %s: predicted step %.3f ms, peak %s (%s)", mesh, p.step_time_s * 1e3, format_bytes(p.memory.total), p.solver.status)
        found.append(p)
    notes: list[str] = []
    if context_parallel and searches_context_parallel(graph, options):
        def solve(mesh: MeshSpec, ordered: bool) -> Plan:
            return make_plan(graph, mesh, cluster, dataclasses.replace(options, token_order=ordered), model_name=model_name,
                             earlier=found)

        kept, notes = context_parallel_plans(meshes, found, solve, SEARCH_ERRORS, token_orders)
        found += kept
    skipped = tuple(f"mesh {mesh.shape}: {type(e).__name__}: {e}" for mesh, e in failed) + tuple(notes)
    if not found:
        too_small = [e for _, e in failed if isinstance(e, MemoryBudgetError)]
        if too_small:
            raise min(too_small, key=lambda e: e.smallest)
        if all(isinstance(e, AnnotationError) for _, e in failed):
            raise AnnotationError("the annotations hold on none of the candidate meshes:\n  " + "\n  ".join(f"mesh {m.shape}: {e}" for m, e in failed))
        raise InfeasiblePlan("no candidate mesh gave a plan:\n  " + "\n  ".join(skipped))
    best = min(found, key=lambda p: p.step_time_s)
    return dataclasses.replace(best, solver=dataclasses.replace(best.solver, skipped=skipped)) if skipped else best


def auto_parallelize(
    model: nn.Module,
    devices: Devices | None = None,
    example_inputs: tuple = (),
    *,
    plan: Plan | None = None,
    example_kwargs: dict | None = None,
    timeout: timedelta | float | None = None,
    loss_fn: Callable | None = None,
    group: dist.ProcessGroup | None = None,
    weights: str | os.PathLike | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    **plan_kwargs,
) -> ParallelModule:
    """Plan `model` (or take `plan`) and return this rank's `ParallelModule`, the one runtime type for every plan.

    Call on every rank of an initialised process group (torchrun's environment is used to
    initialise one when none exists), or of `group`. The group's first rank plans and sends the plan
    to the others, so a solve stopped by its time limit still gives every rank the same plan; each
    rank checks that the plan fits its own model.

    Weights: by default the model's own tensors (the group's first rank's win). A model built on the
    meta device materialises only this rank's shards: from `weights` (a Hugging Face `save_pretrained`
    directory or a `.safetensors` file, read slice by slice; or a `meshplan.save_checkpoint` directory),
    else from its own initialisation (`init_fn(model)`, else `model.init_weights()`, else every
    submodule's `reset_parameters()`), one parameter at a time (runtime/init_on_meta.py). Call
    `torch.manual_seed(s)` with the same `s` on every rank first: the shards then equal one process
    initialising the whole model.
    `timeout` (seconds or a timedelta; default $MESHPLAN_TIMEOUT, else 10 minutes) bounds every
    collective the runtime runs: a rank that dies, never joins or skips a collective makes the
    others raise `CollectiveError` instead of hanging.

    `loss = pmodel.step(*batch, target=y)` (with `loss_fn(output, target)` given here or to `step`) then the
    user's `optimizer.step()` trains every plan; a plan without a pipeline also takes `pmodel(x)` and
    `backward()`. A plan with a pipeline (`pipeline=` in the plan options) is traced at one microbatch and runs
    on every rank of the job (docs/runtime.md).
    """
    timeout = resolve_timeout(timeout)
    _ensure_process_group(timeout)
    world = dist.get_world_size(group)
    if devices is None:
        devices = world
    if isinstance(devices, int) and devices != world:
        raise ValueError(f"devices={devices} but the process group has {world} ranks; they must be equal")
    example_inputs, example_kwargs = example_call(example_inputs, example_kwargs)
    # before planning: a model the runtime cannot take fails the same way on every rank, at once
    check_model_device(dict(model.named_parameters()) | dict(model.named_buffers()), group_device(group))
    source, checkpoint_dir = weight_source(model, weights, init_fn, group)
    if plan is None:
        plan = plan_once(lambda: globals()["plan"](model, devices, example_inputs, example_kwargs=example_kwargs, **plan_kwargs), group)
    if plan.pipeline is not None:
        micro, batch = plan.pipeline.microbatches, int(example_inputs[0].shape[0])
        if batch % micro:
            raise ValueError(f"the example batch of {batch} does not split into the plan's {micro} microbatches")
        # traced as the planner traced it: the plan's fingerprint is of that microbatch's graph
        example_inputs, example_kwargs = microbatch_call(example_inputs, example_kwargs, batch // micro)
    elif plan.mesh.size != world:
        raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.size} devices but the process group has {world} ranks")
    graph = trace(model, example_inputs, example_kwargs, precision=plan.precision)
    eval_source = functools.partial(_eval_program, model, example_inputs, example_kwargs, graph, plan, group)
    pmodel = ParallelModule(model, graph, plan, group=group, timeout=timeout, eval_source=eval_source, weights=source,
                            loss_fn=loss_fn)
    if checkpoint_dir is not None:
        load_checkpoint(checkpoint_dir, pmodel)
    return pmodel


def weight_source(model: nn.Module, weights: str | os.PathLike | None, init_fn: Callable | None,
                  group: dist.ProcessGroup | None) -> tuple[WeightSource | None, str | None]:
    """The source of the shards `weights` / `init_fn` ask for (None: the default) and a checkpoint directory to
    load after setup (its shards start empty)."""
    if weights is not None and init_fn is not None:
        raise ValueError("give weights= (a checkpoint to load) or init_fn= (how to initialise), not both")
    if init_fn is not None:
        return FromInit(model, init_fn), None
    if weights is None:
        return None, None
    path = os.fspath(weights)
    if os.path.isfile(os.path.join(path, INFO_FILE)):
        return Empty(), path
    # buffers the file lacks because the model never saves them: from the model (its init, on the meta device)
    rest = default_weights(model, group_device(group))
    return FromSafetensors(path, set(model.state_dict()), rest), None


def _eval_program(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None, graph: Graph, plan: Plan,
                  group: dist.ProcessGroup | None, *, training: bool = False,
                  attributes: dict[str, Any] | None = None) -> tuple[Graph, Plan] | None:
    """The model traced in eval mode (`training`: train mode) and planned with `plan`'s parameter and input layouts,
    or None when eval mode traces to the same program. `attributes`: module attributes (`path.name`) to trace it with,
    those an earlier forward left (runtime/model_state.py). Every rank of `group` calls this (the first rank plans)."""
    was_training = model.training
    model.train(training)
    try:
        with assigned(model, attributes or {}):
            eval_graph = trace(model, example_inputs, example_kwargs, precision=plan.precision)
    finally:
        model.train(was_training)
    if not attributes and eval_graph.fingerprint() == graph.fingerprint():
        return None
    options = PlanOptions(
        inputs=plan.inputs_mode, recompute="never", loss_only=plan.pipeline is not None, token_order=plan.token_order,
        param_layouts={p.fqns[0]: p.layout for p in plan.params}, input_layouts={i.name: i.layout for i in plan.inputs},
    )
    phase(f"planning {type(model).__name__} in {'train' if training else 'eval'} mode"
          f"{' from the attributes an earlier forward left' if attributes else ''} with the training plan's layouts")
    eval_plan = plan_once(lambda: make_plan(eval_graph, plan.mesh, get_cluster(plan.cluster), options,
                                            model_name=type(model).__name__), group)
    return eval_graph, eval_plan


PLAN_WAIT = timedelta(hours=1)
"""How long the other ranks wait for the first rank's plan (planning is no collective: the runtime's
`timeout` does not bound it)."""


def plan_once(make: Callable[[], Plan], group: dist.ProcessGroup | None = None) -> Plan:
    """`make()` on the group's first rank, whose plan (or error) every other rank receives over a host
    (gloo) group whose timeout is `PLAN_WAIT`, whatever the job's backend."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    src = ranks[0]
    waiting = dist.new_group(ranks, backend="gloo", timeout=PLAN_WAIT, use_local_synchronization=True)
    message: list = [None]
    if dist.get_rank() == src:
        try:
            made = make()
        except Exception as e:
            kind = "bad input" if isinstance(e, ValueError) else "error"
            dist.broadcast_object_list([(kind, f"{type(e).__name__}: {e}")], src=src, group=waiting)
            raise
        message = [("plan", made.to_json())]
    dist.broadcast_object_list(message, src=src, group=waiting)
    kind, payload = message[0]
    if kind != "plan":  # the same kind of error as on the planning rank: a ValueError for bad input
        raise (ValueError if kind == "bad input" else RuntimeError)(f"rank {src} could not plan, so this rank has no plan either: {payload}")
    return made if dist.get_rank() == src else Plan.from_json(payload)


def _ensure_process_group(timeout: timedelta) -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_torchrun_group(timeout=timeout)
        log.info("initialised process group from the torchrun environment")
        return
    raise ValueError(
        "auto_parallelize needs a torch.distributed process group: run under torchrun, call "
        "torch.distributed.init_process_group first, or use meshplan.plan(...) to plan without devices"
    )
