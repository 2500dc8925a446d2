"""Rewrite the traced ATen graph for one rank: local ops plus the plan's explicit collectives.

Each resharding the plan lists becomes a `Redistribute` submodule call in front of the op that
needs it; ops whose arguments spell out a global shape (view, expand, new_zeros, ...) get their
rank-local shape. The result is an ordinary `fx.GraphModule`: printable (`print(gm.code)`),
differentiable by autograd, and usable under `torch.compile`.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.graph import Graph, layer_of
from meshplan.ir.placement import Placements, Replicate, local_shape
from meshplan.ir.regions import region_op
from meshplan.ir.trace import STRIDE_SAFE
from meshplan.plans.plan import Plan, Transfer
from meshplan.runtime.collectives import MeshComm, StepFunction, scale_grad
from meshplan.runtime.local_view import local_view

SOURCE = "meshplan_source"
"""fx meta key on rewritten nodes: the traced node an op came from, or the consumer a move feeds."""

# ops whose argument at this index is the (global) shape of their output; DTensor keeps the same table
SHAPE_ARG = dict(DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx)


class Redistribute(nn.Module):
    """Moves one tensor between layouts with the plan's steps (each differentiable). `head_tail_axis`: the mesh axis
    whose splits are in head-tail token order (`Plan.head_tail_axis`), or None."""

    def __init__(self, steps: tuple[CommStep, ...], comm: MeshComm, what: str, head_tail_axis: int | None = None) -> None:
        super().__init__()
        self.steps = steps
        self.comm = comm
        self.what = what
        self.head_tail_axis = head_tail_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = StepFunction.apply(x, step, self.comm, step.axis == self.head_tail_axis)
        return x

    def extra_repr(self) -> str:
        return f"{self.what}: " + " -> ".join(str(s) for s in self.steps)


def local_program(graph: Graph, plan: Plan, comm: MeshComm) -> fx.GraphModule:
    """The per-rank program of `graph`'s traced program: same placeholders, local tensors throughout.

    Parameters and buffers come in as the module's DTensors; each op that reads one first takes its
    local view (`local_view`, differentiable into a DTensor gradient) right where it runs. Taken
    there rather than before the program starts, the view's backward node is as recent as its user,
    so autograd, which runs the most recently created ready node first, accumulates each gradient as
    soon as it is complete and its bucket's all-reduce overlaps the rest of backward."""
    traced, out_scales = graph.fx, output_grad_scales(plan, output_layouts(graph, plan))
    leaves = {p.node for p in plan.params}
    param_values = graph.param_values  # `graph` names the fx graph below
    transfers: dict[tuple[str, int], Transfer] = {(t.consumer, t.position): t for t in plan.transfers}
    out_layout = {n.name: n.strategy.outputs for n in plan.nodes}
    strategy = {n.name: n.strategy for n in plan.nodes}
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    recomputed = set(plan.recompute)
    layer = {n.name: layer_of(n.module_path) for n in plan.nodes}
    in_layer: dict[str, list[fx.Node]] = {lay: [] for lay in plan.recompute}  # new nodes a checkpoint replaces

    def tag(new: fx.Node, lay: str | None) -> fx.Node:
        if lay in recomputed:
            in_layer[lay].append(new)
        return new

    def moved(consumer: str):
        position = iter(range(1 << 30))

        def move(arg: fx.Node) -> fx.Node:
            new = env[arg]
            if arg.op == "placeholder" and arg.name in leaves:
                new = tag(graph.call_function(local_view, (new,)), layer.get(consumer))
                new.meta[SOURCE] = consumer  # in its user's pipeline stage: a tied weight's second user takes its own
            t = transfers.get((consumer, next(position)))
            if t is None or not t.forward:
                return new
            name = f"move_{len(root._modules)}"
            ordered = plan.move_order_axis(t.tensor, param_values)
            root.add_module(name, Redistribute(t.forward, comm, f"{t.tensor} {t.src}->{t.dst}".replace("Shard", "S"), ordered))
            node = graph.call_module(name, (new,))
            node.meta[SOURCE] = consumer  # a move belongs to its consumer (pipeline stages cut by it)
            return tag(node, layer.get(consumer))

        return move

    for n in traced.gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
        elif n.op == "call_function" and n.target is operator.getitem:
            env[n] = tag(graph.call_function(operator.getitem, (env[n.args[0]], n.args[1])), layer.get(n.args[0].name))
        elif n.op == "call_function":
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), moved(n.name))
            args = _localise_shape(n, list(args), out_layout.get(n.name), plan.mesh.shape)
            if isinstance(kwargs.get("device"), torch.device):
                # a tensor made inside the model lands on this rank's device, wherever the model was traced (meta, cpu)
                kwargs = {**kwargs, "device": comm.device}
            local = _region_module(n, strategy.get(n.name), comm)
            if local is not None:  # a region op (moe, SyncBN, a sharded kernel): this rank's part, built from its strategy
                name = f"region_{len(root._modules)}"
                root.add_module(name, local)
                env[n] = tag(graph.call_module(name, tuple(args), kwargs), layer.get(n.name))
            else:
                env[n] = tag(graph.call_function(STRIDE_SAFE.get(n.target, n.target), tuple(args), kwargs), layer.get(n.name))
            env[n].meta[SOURCE] = n.name
        elif n.op == "output":
            outs = fx.node.map_arg(n.args[0], moved("output"))
            scales = iter(out_scales)
            outs = fx.node.map_arg(outs, lambda x: graph.call_function(scale_grad, (x, next(scales))))
            graph.output(outs)
        else:
            raise AssertionError(f"unexpected node {n.format_node()}")
    graph.lint()
    gm = fx.GraphModule(root, graph, class_name=f"Rank{comm.rank}Program")
    if plan.recompute:
        _checkpoint_layers(gm, in_layer)
    return gm


class Recomputed(nn.Module):
    """One layer run under non-reentrant activation checkpointing: backward runs its forward again."""

    def __init__(self, layer: str, body: fx.GraphModule) -> None:
        super().__init__()
        self.layer = layer
        self.body = body

    def forward(self, *args):
        # no early stop: the whole layer runs again, so every forward collective the plan lists for it does
        with set_checkpoint_early_stop(False):
            return checkpoint(self.body, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"recomputes {self.layer}"


def _checkpoint_layers(gm: fx.GraphModule, in_layer: dict[str, list[fx.Node]]) -> None:
    """Fold each recomputed layer's nodes (ops, their moves, their getitems) into one `Recomputed` call."""
    layers = [lay for lay, nodes in in_layer.items() if nodes]
    fuse_by_partitions(gm, [dict.fromkeys(in_layer[lay]) for lay in layers], prefix="recompute_")
    for i, lay in enumerate(layers):
        name = f"recompute_{i}"
        gm.add_submodule(name, Recomputed(lay, getattr(gm, name)))
    gm.recompile()


def output_layouts(graph: Graph, plan: Plan) -> list[Placements]:
    """The layout each output of `graph` leaves the program in under `plan`: a move's into the output, else its
    producer's."""
    into_output = {t.position: t.dst for t in plan.transfers if t.consumer == graph.output.name}
    made = plan.value_layouts()
    whole = (Replicate(),) * plan.mesh.ndim  # a constant
    return [into_output.get(i, made[r.node][r.index] if r.node in made else whole) for i, r in enumerate(graph.output.inputs)]


def output_grad_scales(plan: Plan, layouts: list[Placements]) -> list[float]:
    """What each output's incoming gradient is scaled by to be our partial form. The user's loss sees whole outputs
    (with inputs="local", each rank its own, averaged as DDP does): the gradient arrives identical on every rank, and
    1/devices makes the ranks' sum the gradient. An output handed out sharded (`PlanOptions.loss_only`: a DTensor)
    gets the exact gradient of its block, identical only over the mesh axes it is replicated on."""
    if plan.inputs_mode != "global":
        return [1.0 / plan.mesh.size] * len(layouts)
    return [1.0 / math.prod(size for size, p in zip(plan.mesh.shape, layout) if isinstance(p, Replicate)) for layout in layouts]


def _region_module(n: fx.Node, strategy, comm: MeshComm) -> nn.Module | None:
    """The region op's per-rank module for fx node `n` (ir/regions.py), or None for the plain op."""
    region = region_op(n.target)
    local = None
    if region is not None and strategy is not None:
        local = region.local_module(strategy, comm, fx.node.map_arg(n.args, lambda a: a.meta.get("val")))
    if local is None and strategy is not None and strategy.kernel:
        raise ValueError(f"{n.name} ({n.target}): the plan runs it as the sharded kernel {strategy.kernel!r}, and no region op "
                         "registered for this op builds that kernel; running the plain op on shards would give wrong numbers")
    return local


def _localise_shape(n: fx.Node, args: list, layouts, mesh_shape: tuple[int, ...]) -> list:
    idx = SHAPE_ARG.get(n.target)
    if idx is None or layouts is None or layouts[0] is None:
        return args
    if isinstance(idx, tuple):
        idx = idx[0]
    global_shape = tuple(n.meta["val"].shape)
    args[idx] = list(local_shape(global_shape, layouts[0], mesh_shape))
    return args
