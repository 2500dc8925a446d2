"""What a model's forward changes besides its outputs, traced so that the program computes what one process does.

Parameters updated in place (a weight rescaled under `torch.no_grad()`):

Functionalisation turns `w.mul_(c)` into `w2 = mul(w, c)` and every later read of `w` into a read of `w2`, so
autograd would differentiate through the update: the gradient of a later use would reach `w` multiplied by `c`.
In one process the update is not recorded (it runs without grad, or `w` needs none) and `w` stays the leaf that
later uses differentiate into. `rebind_updated_parameters` therefore makes every later read, before
functionalisation, read `w.detach() + (w0 - w0.detach())`, where `w0` is the parameter as the forward received it:
the updated value exactly (plus an exact zero), with the gradient going to the parameter unchanged.

Module attributes the forward reassigns (Hugging Face RWKV's `layers_are_rescaled`): torch.export undoes them after
tracing, and the program keeps the branch the attributes chose then. `attributes` and `forward_attributes` find them,
so `trace` can tell whether the program traced from the state they leave differs (ir/trace.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

aten = torch.ops.aten

REGION_OUTPUT = "meshplan_region_output"
"""fx meta key on the `detach` that inlining a no-grad region (ir/trace.py) puts on each of the region's outputs."""

PLAIN = (bool, int, float, str, type(None))
"""Attribute values that can steer a forward's control flow and are compared by value (flags, counters, names)."""

UNSET = object()
"""An attribute's value where it does not exist."""


def attributes(model: nn.Module) -> dict[str, Any]:
    """`model`'s plain-valued module attributes by `path.name` (the train/eval flag aside: modes trace apart)."""
    return {f"{path}.{k}" if path else k: v for path, m in model.named_modules() for k, v in vars(m).items()
            if isinstance(v, PLAIN) and k != "training"}


@contextlib.contextmanager
def forward_attributes(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Within the block, the dict yielded receives `model`'s attributes as each forward of it leaves them (before
    torch.export puts them back)."""
    left: dict[str, Any] = {}
    handle = model.register_forward_hook(lambda *_: left.update(attributes(model)))
    try:
        yield left
    finally:
        handle.remove()


@contextlib.contextmanager
def assigned(model: nn.Module, values: dict[str, Any]) -> Iterator[None]:
    """Within the block, `model`'s attributes (`path.name`) hold `values`; afterwards what they held before."""
    old = {}
    for key, value in values.items():
        path, _, name = key.rpartition(".")
        owner = model.get_submodule(path)
        old[key] = vars(owner).get(name, UNSET)
        setattr(owner, name, value)
    try:
        yield
    finally:
        for key, value in old.items():
            path, _, name = key.rpartition(".")
            owner = model.get_submodule(path)
            if value is UNSET:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _first_argument(n: fx.Node) -> tuple[bool, bool]:
    """(the op returns an alias of its first argument, the op writes into its first argument)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not n.args:
        return False, False
    arguments = n.target._schema.arguments
    info = arguments[0].alias_info if arguments else None
    return info is not None, info is not None and info.is_write


def rebind_updated_parameters(gm: fx.GraphModule, params: set[str]) -> None:
    """Rewrite the (not yet functional) graph so that reads of each parameter placeholder in `params` after the
    forward writes into it read the written value with the parameter's own gradient (see the module docstring)."""
    graph = gm.graph
    order = list(graph.nodes)
    first_op = next(n for n in order if n.op != "placeholder")
    for p in [n for n in order if n.op == "placeholder" and n.name in params]:
        whole, written, views = {p}, [], {p}  # the parameter itself, the ops writing it, everything aliasing it
        for n in order:
            aliases, writes = _first_argument(n)
            if not n.args or n.args[0] not in views:
                continue
            if writes:
                written.append(n)
            if aliases or n.meta.get(REGION_OUTPUT):
                views.add(n)
                if (writes or n.meta.get(REGION_OUTPUT)) and n.args[0] in whole:
                    whole.add(n)
        if not written:
            continue
        chain = set()  # the writes and the views they write through, which must keep reading the parameter
        for w in written:
            a = w
            while a is not p:
                chain.add(a)
                a = a.args[0]
        with graph.inserting_before(first_op):
            zero = graph.call_function(aten.sub.Tensor, (p, graph.call_function(aten.detach.default, (p,))))
        current = None
        for n in order[order.index(written[0]):]:
            if n in written:
                with graph.inserting_after(n):
                    value = graph.call_function(aten.detach.default, (p,))
                with graph.inserting_after(value):
                    current = graph.call_function(aten.add.Tensor, (value, zero))
            elif n not in chain:
                for a in [a for a in n.all_input_nodes if a in whole]:
                    n.replace_input_with(a, current)
        for n in whole:  # inlining's detach of the written parameter: replaced by the rebound value above
            if n.meta.get(REGION_OUTPUT) and not n.users:
                graph.erase_node(n)
    graph.lint()
    gm.recompile()


def detach_parameter_updates(gm: fx.GraphModule, positions: list[int]) -> None:
    """Detach the functional graph's outputs at `positions` (new values of parameters): the program hands them
    back to be written into the parameters, and no gradient flows through them."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    with gm.graph.inserting_before(out):
        for i in positions:
            d = gm.graph.call_function(aten.detach.default, (values[i],))
            d.meta.update({k: values[i].meta[k] for k in ("val", "tensor_meta") if k in values[i].meta})
            values[i] = d
    out.args = (type(out.args[0])(values),)
    gm.recompile()
