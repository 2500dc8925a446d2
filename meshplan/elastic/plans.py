"""Plans kept per world size and mesh beside the checkpoint, so a world seen before re-plans instantly.

`PlanStore(root)` holds one JSON plan file per (world size, mesh shape, model and options): the first
time a world appears the group's first rank plans and writes it; every later start on that world
reads it back (`Plan.from_json`, checked against the model by `auto_parallelize`). A world for which
no plan fits is a `ValueError` naming the smallest larger world that has one.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import torch

from meshplan.api import plan as make_plan
from meshplan.elastic.batch import split_batch
from meshplan.planner.planner import MemoryBudgetError
from meshplan.planner.solver import InfeasiblePlan
from meshplan.plans.plan import Plan

__all__ = ["PlanStore", "plan_for_world"]

_DOES_NOT_FIT = (MemoryBudgetError, InfeasiblePlan)


class PlanStore:
    """A directory of plans, one file per world size, mesh and model (`world4-auto-<key>.json`)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)

    def path(self, world: int, mesh_shape, key: str) -> str:
        mesh = "x".join(map(str, mesh_shape)) if mesh_shape else "auto"
        return os.path.join(self.root, f"world{world}-{mesh}-{key}.json")

    def get(self, world: int, mesh_shape, key: str) -> Plan | None:
        try:
            with open(self.path(world, mesh_shape, key)) as f:
                return Plan.from_json(f.read())
        except FileNotFoundError:
            return None

    def put(self, world: int, mesh_shape, key: str, plan: Plan) -> None:
        os.makedirs(self.root, exist_ok=True)
        path = self.path(world, mesh_shape, key)
        plan.save(path + ".tmp")
        os.replace(path + ".tmp", path)  # a reader never sees half a plan


def model_key(model: torch.nn.Module, example_inputs: tuple, options: dict[str, Any]) -> str:
    """What a stored plan was made for, besides the world: the model's class, parameter names and shapes,
    the example inputs' shapes and dtypes, and the planning options (a plan of another model is never reused)."""
    what = {
        "model": type(model).__qualname__,
        "state": [(k, list(v.shape), str(v.dtype)) for k, v in model.state_dict().items()],
        "inputs": [(list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs],
        "options": {k: repr(v) for k, v in sorted(options.items())},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def plan_for_world(model: torch.nn.Module, world: int, example_for: Callable[[int], tuple], *, global_batch: int,
                   micro_batch: int | None, max_world: int, **options: Any) -> Plan:
    """`meshplan.plan(model, world, example_for(world), **options)`; where no plan fits `world` (the memory budget,
    or no consistent layout), a `ValueError` that names the smallest world up to `max_world` with a plan (and a
    batch split), found by planning each larger world in turn."""
    try:
        return make_plan(model, devices=world, example_inputs=example_for(world), **options)
    except _DOES_NOT_FIT as e:
        why = e
    for w in range(world + 1, max_world + 1):
        try:
            split_batch(global_batch, w, micro_batch)
        except ValueError:
            continue
        try:
            make_plan(model, devices=w, example_inputs=example_for(w), **options)
        except _DOES_NOT_FIT:
            continue
        raise ValueError(f"no plan fits {_ranks(world)} ({why}); the smallest world that works is {w} ranks: "
                         f"launch at least {w} ranks (torchrun --nnodes MIN:MAX with MIN x nproc-per-node >= {w})") from why
    raise ValueError(f"no plan fits {_ranks(world)} ({why}), nor any world up to {max_world} ranks; "
                     "raise the memory budget or shrink the model") from why
