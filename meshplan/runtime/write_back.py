"""Writing back what a model's forward updates in place: batch norm's running statistics, weights it rescales.

The traced program is functional: each parameter or buffer the forward writes into comes out as one of the
program's leading outputs, holding the new value (`TracedProgram.mutations`, ir/mutations.py). After each
forward this rank's part of that value, in the tensor's own layout, goes into the module's tensor, so the module
holds what one process's model holds after the same call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshplan.ir.graph import Graph
from meshplan.ir.placement import Placements, Replicate
from meshplan.plans.plan import ParamChoice, Plan
from meshplan.runtime.local_view import local_of
from meshplan.runtime.weights import block_slices


@dataclass(frozen=True, slots=True)
class Update:
    """One parameter or buffer the program writes, and how this rank takes its part of the new value."""

    fqn: str
    stored: ParamChoice
    """the module's tensor (its node, layout and whether it is a buffer), as the training plan stores it"""
    whole: bool
    """the program returns the whole new value (this rank takes its block); False: this rank's block already"""


def updates(graph: Graph, plan: Plan, stored: Sequence[ParamChoice]) -> tuple[Update, ...]:
    """The updates of `graph`'s program run under `plan`, written into the tensors `stored` describes.

    A ValueError names the tensor and the op computing its new value where the update cannot be honoured: the plan
    returns the value in a layout from which a rank cannot take its part without a collective the plan does not
    list, or recomputes layers in backward, which would read a parameter's updated value instead of the one the
    forward read."""
    by_fqn = {f: p for p in stored for f in p.fqns}
    moved = {t.position: t.dst for t in plan.transfers if t.consumer == "output"}
    layouts = {n.name: n.strategy.outputs for n in plan.nodes}
    out = []
    for i, fqn in enumerate(graph.fx.mutations):
        ref, p = graph.output.inputs[i], by_fqn[fqn]
        got: Placements = moved.get(i) or layouts[ref.node][ref.index]
        what = _update(graph, i, "buffer" if p.is_buffer else "parameter")
        if got != p.layout and any(not isinstance(a, Replicate) for a in got):
            raise ValueError(
                f"{what}; the plan returns its new value as {got}, but it is stored as {p.layout}, and no collective in "
                "the plan moves one into the other: plan with inputs='global' (every update comes back whole) or with "
                "its layout fixed to the update's (param_layouts=)"
            )
        if plan.recompute and not p.is_buffer:
            raise ValueError(f"{what}, and the plan recomputes layers in backward ({', '.join(plan.recompute)}), which "
                             "would read the updated value instead of the one the forward read: plan with recompute='never'")
        out.append(Update(fqn, p, got != p.layout))
    return tuple(out)


def refuse_in_pipeline(graph: Graph) -> None:
    """A ValueError naming what `graph`'s forward updates, if anything: a pipeline's stages hand on only the model's
    outputs, and its microbatches after the first would run in the state the first one leaves."""
    if graph.fx.mutations:
        raise ValueError(f"{_update(graph, 0, 'tensor')}; pipelined plans do not write updates back: plan with pipeline=None")
    if graph.fx.state_changes:
        key, value = next(iter(graph.fx.state_changes.items()))
        raise ValueError(f"the forward sets the model's attribute {key} to {value!r}, which changes what later forwards "
                         "compute, and a pipeline runs each microbatch with the program traced before it: plan with "
                         "pipeline=None")


def _update(graph: Graph, i: int, kind: str) -> str:
    """'the forward updates parameter fc1.weight in place (aten.div.Tensor at <top>)': the program's update `i`."""
    op = graph[graph.output.inputs[i].node]
    op = graph[op.inputs[0].node] if op.target == "aten.detach.default" else op  # ir/mutations.py's own detach
    return f"the forward updates {kind} {graph.fx.mutations[i]} in place ({op.target} at {op.module_path or '<top>'})"


@torch.no_grad()
def write_back(module: nn.Module, program_updates: tuple[Update, ...], values: Sequence[torch.Tensor]) -> None:
    """Put this rank's part of each new value into `module`'s tensor (a `ParallelModule`: `_leaf`, `comm`, `plan`).

    A parameter is written in place, so optimizers and user references keep seeing it (and its offloaded host copy
    with it, else the next optimizer step would put the old value back); as in one process, a backward that needs
    the old value then fails autograd's version check. A buffer gets a new tensor: the step's backward may still
    read the old running statistics."""
    mesh, rank = module.plan.mesh, module.comm.rank
    for u, value in zip(program_updates, values):
        node = u.stored.node
        part = value[block_slices(tuple(value.shape), u.stored.layout, mesh, rank)] if u.whole else value
        old = module._leaf[node]
        if not u.stored.is_buffer:
            local_of(old).copy_(part)
            host = next((module.offload_copies[f] for f in u.stored.fqns if f in module.offload_copies), None)
            if host is not None:
                local_of(host).copy_(part)
            continue
        part = part.clone(memory_format=torch.contiguous_format)
        new = DTensor.from_local(part, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                                 stride=old.stride()) if isinstance(old, DTensor) else part
        for alias in u.stored.fqns:
            owner = module.get_submodule(alias.rpartition(".")[0])
            owner._buffers[alias.rpartition(".")[2]] = new
        module._leaf[node] = new

