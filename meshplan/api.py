"""The public entry points: `plan` (no devices needed) and `auto_parallelize` (inside torchrun)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshplan.cost_model.presets import ClusterPreset, get_cluster
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.trace import trace
from meshplan.planner.plan import Plan
from meshplan.planner.planner import PlanOptions, make_plan
from meshplan.progress import phase
from meshplan.runtime.parallel_module import ParallelModule

log = logging.getLogger("meshplan")

Devices = int | Sequence[int] | DeviceMesh


def resolve_mesh(devices: Devices, mesh_shape: Sequence[int] | None = None, axis_names: Sequence[str] | None = None) -> list[MeshSpec]:
    """The mesh(es) to consider: one when the shape is known, every factorisation into <= 2 axes otherwise."""
    names = tuple(axis_names) if axis_names else ()
    if isinstance(devices, DeviceMesh):
        shape = tuple(devices.shape)
        names = names or tuple(devices.mesh_dim_names or ())
        if not torch.equal(devices.mesh.flatten(), torch.arange(devices.size())):
            raise ValueError(f"DeviceMesh {devices} must hold ranks 0..{devices.size() - 1} in row-major order")
        return [MeshSpec(shape, names)]
    if isinstance(devices, (tuple, list)):
        shape = tuple(int(d) for d in devices)
        if mesh_shape is not None and tuple(mesh_shape) != shape:
            raise ValueError(f"devices={shape} and mesh_shape={tuple(mesh_shape)} disagree; give one of them")
        return [MeshSpec(shape, names)]
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive int, a mesh shape tuple or a DeviceMesh; got {devices!r}")
    if mesh_shape is not None:
        shape = tuple(int(s) for s in mesh_shape)
        n = 1
        for s in shape:
            n *= s
        if n != devices:
            raise ValueError(f"mesh_shape {shape} has {n} devices but devices={devices}; their product must equal devices")
        return [MeshSpec(shape, names)]
    meshes = [MeshSpec((devices,), names[:1] if names else ())]
    for outer in range(2, devices):
        if devices % outer == 0:
            meshes.append(MeshSpec((outer, devices // outer), names if len(names) == 2 else ()))
    return meshes


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
) -> Plan:
    """Plan `model` for `devices` without running anything (meta or fake tensors are fine).

    With `mesh_shape=None` and an int `devices`, every factorisation into one or two axes is
    planned and the plan with the lowest predicted step time is returned.
    """
    meshes = resolve_mesh(devices, mesh_shape, axis_names)
    cluster_preset = get_cluster(cluster or ("h100" if torch.cuda.is_available() else "cpu"))
    options = PlanOptions(
        mode=mode, inputs=inputs, strict=strict, param_layouts=dict(param_layouts or {}),
        input_layouts=dict(input_layouts or {}), optimizer=optimizer,
    )
    phase(f"tracing {type(model).__name__}")
    graph = trace(model, example_inputs if isinstance(example_inputs, tuple) else (example_inputs,), example_kwargs)
    best: Plan | None = None
    for mesh in meshes:
        p = make_plan(graph, mesh, cluster_preset, options, model_name=type(model).__name__)
        log.info("mesh %s: predicted step %.3f ms", mesh, p.step_time_s * 1e3)
        if best is None or p.step_time_s < best.step_time_s:
            best = p
    assert best is not None
    return best


def auto_parallelize(
    model: nn.Module,
    devices: Devices | None = None,
    example_inputs: tuple = (),
    *,
    plan: Plan | None = None,
    example_kwargs: dict | None = None,
    **plan_kwargs,
) -> ParallelModule:
    """Plan `model` (or take `plan`) and return this rank's `ParallelModule`.

    Call on every rank of an initialised process group (torchrun's environment is used to
    initialise one when none exists). Every rank plans identically; hashes are compared.
    """
    _ensure_process_group()
    world = dist.get_world_size()
    if devices is None:
        devices = world
    if isinstance(devices, int) and devices != world:
        raise ValueError(f"devices={devices} but the process group has world size {world}; they must be equal")
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    graph = trace(model, example_inputs, example_kwargs)
    if plan is None:
        plan = globals()["plan"](model, devices, example_inputs, example_kwargs=example_kwargs, **plan_kwargs)
    if plan.mesh.size != world:
        raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.size} devices but the world size is {world}")
    return ParallelModule(model, graph, plan)


def _ensure_process_group() -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        log.info("initialised process group from the torchrun environment")
        return
    raise ValueError(
        "auto_parallelize needs a torch.distributed process group: run under torchrun, call "
        "torch.distributed.init_process_group first, or use meshplan.plan(...) to plan without devices"
    )
