"""`meshplan.load_plan(path, model, example_inputs)`: a saved strategy file, checked against the model.

A plan is only valid for the graph it was made for (its fingerprint covers every op, shape and
dtype) and the number of devices it was made for; both are checked here so a wrong file fails
with a clear `ValueError` before any process starts, instead of deep inside the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from meshplan.ir.trace import trace
from meshplan.plans.plan import Plan


def load_plan(
    path: str, model: nn.Module, example_inputs: tuple = (), *, example_kwargs: dict | None = None,
    devices: int | Sequence[int] | None = None,
) -> Plan:
    """Read the plan at `path` and check it fits `model` (traced with `example_inputs`) and `devices`.

    `devices` (an int or a mesh shape) defaults to the world size of the initialised process group,
    if any. Run the plan with `meshplan.auto_parallelize(model, example_inputs=..., plan=plan)`.
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read plan file {path!r}: {e.strerror}") from None
    plan = Plan.from_json(text)
    graph = trace(model, example_inputs, example_kwargs, precision=plan.precision)
    if graph.fingerprint() != plan.graph_fingerprint:
        raise ValueError(
            f"plan file {path!r} was made for another model or other input shapes (plan model {plan.model}, graph "
            f"{plan.graph_fingerprint}; {type(model).__name__} with these inputs traces to {graph.fingerprint()}): re-plan"
        )
    if devices is None and dist.is_available() and dist.is_initialized():
        devices = dist.get_world_size()
    if devices is not None:
        if isinstance(devices, int):
            if devices != plan.mesh.size:
                raise ValueError(f"plan file {path!r} is for {plan.mesh.size} devices (mesh {plan.mesh}); got devices={devices}")
        elif tuple(devices) != plan.mesh.shape:
            raise ValueError(
                f"plan file {path!r} is for mesh shape {plan.mesh.shape} ({plan.mesh.size} devices); got {tuple(devices)} "
                f"({math.prod(devices)} devices)"
            )
    return plan
