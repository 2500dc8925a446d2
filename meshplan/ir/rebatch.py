"""A model's trace at another batch size, derived from its traces at two sizes instead of exported again.

The pipeline search prices stage profiles at several microbatch sizes, and each torch.export of a big model takes
seconds (the cut Llama-3-8B at 1, 2, 4 and 8 sequences, 1.6-2.4 s each, in a 24 s default call at 131k tokens). Two traces of one model
at batch sizes a and b show how its program depends on the batch: every shape, stride and integer argument is
either the same in both or grows in proportion to the batch (a view to `[n * s, h]`). The trace at n is then the
first with each proportional integer scaled to n. Anything else (another op sequence, a float or a constant that
changed, an integer that changed out of proportion or that n does not scale to a whole number) says the program
depends on the batch some other way: `rebatched` returns None and the caller traces.

The IR nodes' tensor metas, the ATen program's arguments and its nodes' `val` metas (meta tensors of the new
shapes and strides, what the sharding rules read) are scaled together; tests/test_rebatch.py compares the result
with a fresh trace, node by node.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from meshplan.ir.graph import Graph, TensorMeta
from meshplan.ir.verify import verify


class _Differs(Exception):
    """The two traces differ other than in proportion to the batch."""


class _Scaler:
    """Maps a value of the trace at `a` and its counterpart at `b` to the value at `n`."""

    def __init__(self, a: int, b: int, n: int) -> None:
        self.a, self.b, self.n = a, b, n

    def int(self, x: int, y: int) -> int:
        if x == y:
            return x
        if x * self.b != y * self.a or (x * self.n) % self.a:
            raise _Differs(f"{x} at batch {self.a}, {y} at batch {self.b}")
        return x * self.n // self.a

    def value(self, x: Any, y: Any, nodes: dict[fx.Node, fx.Node] | None = None) -> Any:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):  # a traced FakeTensor against a derived meta tensor
            return self.tensor(x, y)
        if type(x) is not type(y):
            raise _Differs(f"{type(x).__name__} against {type(y).__name__}")
        if isinstance(x, fx.Node):
            if nodes is None or x.name != y.name:
                raise _Differs(f"node {x.name} against {y.name}")
            return nodes[x]
        if isinstance(x, int) and not isinstance(x, bool):
            return self.int(x, y)
        if isinstance(x, (list, tuple)):
            if len(x) != len(y):
                raise _Differs(f"{len(x)} items against {len(y)}")
            out = [self.value(u, v, nodes) for u, v in zip(x, y)]
            return type(x)(out) if not hasattr(x, "_fields") else type(x)(*out)
        if isinstance(x, dict):
            if list(x) != list(y):
                raise _Differs("other keys")
            return {k: self.value(x[k], y[k], nodes) for k in x}
        if isinstance(x, TensorMeta):
            if x.dtype != y.dtype or len(x.shape) != len(y.shape):
                raise _Differs(f"{x} against {y}")
            return TensorMeta(tuple(self.int(u, v) for u, v in zip(x.shape, y.shape)), x.dtype)
        if x != y:
            raise _Differs(f"{x!r} against {y!r}")
        return x

    def tensor(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A meta tensor of the shape and strides at n (contiguous where both are: a size-1 dim's stride is arbitrary)."""
        if x.dtype != y.dtype or x.dim() != y.dim():
            raise _Differs(f"{x.dtype} {tuple(x.shape)} against {y.dtype} {tuple(y.shape)}")
        shape = [self.int(u, v) for u, v in zip(x.shape, y.shape)]
        if x.is_contiguous() and y.is_contiguous():
            return torch.empty(shape, dtype=x.dtype, device="meta")
        stride = [self.int(u, v) for u, v in zip(x.stride(), y.stride())]
        return torch.empty_strided(shape, stride, dtype=x.dtype, device="meta")


def rebatched(first: Graph, a: int, second: Graph, b: int, n: int) -> Graph | None:
    """The trace at batch `n` of the model that `first` (at batch `a`) and `second` (at batch `b`) trace, or None when
    they differ other than in proportion to the batch (see the module doc)."""
    if a == b or first.fx is None or second.fx is None:
        return None
    scale = _Scaler(a, b, n)
    try:
        return _rebatched(first, second, scale)
    except _Differs:
        return None


def _rebatched(first: Graph, second: Graph, scale: _Scaler) -> Graph:
    if len(first.nodes) != len(second.nodes) or first.input_names != second.input_names:
        raise _Differs("other nodes")
    nodes = []
    for x, y in zip(first.nodes, second.nodes):
        if (x.name, x.kind, x.target, x.inputs, x.module_path, x.fqns, x.requires_grad) != (
                y.name, y.kind, y.target, y.inputs, y.module_path, y.fqns, y.requires_grad):
            raise _Differs(f"node {x.name} against {y.name}")
        nodes.append(dataclasses.replace(x, outputs=scale.value(x.outputs, y.outputs), attrs=scale.value(x.attrs, y.attrs)))
    program, other = first.fx, second.fx
    for name, t in program.constants.items():
        theirs = other.constants.get(name)
        if not isinstance(theirs, torch.Tensor) or tuple(t.shape) != tuple(theirs.shape):
            raise _Differs(f"constant {name}")
    if (program.mutations, program.fixed, program.in_spec, program.out_spec) != (other.mutations, other.fixed, other.in_spec,
                                                                               other.out_spec):
        raise _Differs("another call")
    mine, theirs = list(program.gm.graph.nodes), list(other.gm.graph.nodes)
    if len(mine) != len(theirs):
        raise _Differs("other program nodes")
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    for x, y in zip(mine, theirs):
        if (x.op, x.target, x.name) != (y.op, y.target, y.name):
            raise _Differs(f"program node {x.name} against {y.name}")
        new = copied[x] = graph.node_copy(x, lambda node: copied[node])
        new.args = scale.value(x.args, y.args, copied)
        new.kwargs = scale.value(x.kwargs, y.kwargs, copied)
        new.meta.pop("tensor_meta", None)  # batch a's shapes: nothing reads it that `val` does not answer
        if "val" in x.meta:
            new.meta["val"] = scale.value(x.meta["val"], y.meta.get("val"))
    gm = fx.GraphModule(program.gm, graph)
    out = Graph(nodes, fx=dataclasses.replace(program, gm=gm), input_names=first.input_names, precision=first.precision)
    verify(out)
    return out


__all__ = ["rebatched"]
