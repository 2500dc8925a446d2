"""A model's trace at another batch size, derived from its traces at two sizes instead of exported again.

The pipeline search prices stage profiles at several microbatch sizes, and each torch.export of a big model takes
seconds (the cut Llama-3-8B at 1, 2, 4 and 8 sequences, 1.6-2.4 s each, in a 24 s default call at 131k tokens). Two traces of one model
at batch sizes a and b show how its program depends on the batch: every shape, stride and integer argument is
either the same in both or grows in proportion to the batch (a view to `[n * s, h]`). The trace at n is then the
first with each proportional integer scaled to n. Anything else (another op sequence, a float or a constant that
changed, an integer that changed out of proportion or that n does not scale to a whole number) says the program
depends on the batch some other way: `rebatched` returns None and the caller traces.

torch.export specialises a batch of 1: a copy that makes a tensor contiguous (`aten.clone`) is left out where the
tensor already is, as a slice of a [1, s] tensor is (Hugging Face's causal-LM loss shifts its labels so). The larger
batch's trace is therefore the template, and a copy only it holds (with a batch of 1 beside it) pairs with its
input in the other: the copy's value equals its input's. Nodes pair by op and inputs, not by name (export numbers
names per op: a node left out shifts the later ones'). Without this the Llama-3-70B's pipeline search at 131,072
tokens exported the cut model at 1, 2 and 4 sequences.

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
        self.names: dict[str, str] = {}
        """A node's name in the trace at `b` -> its counterpart's at `a` (export numbers names per op: a node left out
        of one trace shifts the numbers of later nodes of its op)."""
        self.copies: dict[str, str] = {}
        """Name of a copy only the trace at `a` holds -> the name of the node standing for it there (its input)."""

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
            if nodes is None or self.copies.get(x.name, x.name) != self.names.get(y.name):
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
    if a < b:  # the larger batch's program is the template (export may leave copies out of a batch of 1)
        first, a, second, b = second, b, first, a
    scale = _Scaler(a, b, n)
    try:
        return _rebatched(first, second, scale)
    except _Differs:
        return None


COPY = "aten.clone.default"


def _paired(xs: list, ys: list, same, copy_of, scale: _Scaler) -> list[tuple[Any, Any]]:
    """(x, y) pairs of two node lists in order, recording each pair's names in `scale.names`: nodes that are the `same`,
    and a node of `xs` that `copy_of` names a copy (of the node it returns the name of) and `ys` lacks, with the node of
    `ys` standing for it (its input's counterpart, followed through copies), recorded in `scale.copies`."""
    counterpart = {scale.names[y.name]: y for y in ys if y.name in scale.names}  # paired in an earlier pass
    pairs, j = [], 0
    for x in xs:
        if j < len(ys) and same(x, ys[j]):
            pairs.append((x, ys[j]))
            scale.names[ys[j].name] = x.name
            counterpart[x.name] = ys[j]
            j += 1
            continue
        source = copy_of(x)
        if source is None or scale.copies.get(source, source) not in counterpart:
            raise _Differs(f"node {x.name} against {ys[j].name if j < len(ys) else 'none'}")
        scale.copies[x.name] = scale.copies.get(source, source)
        pairs.append((x, counterpart[scale.copies[x.name]]))
    if j != len(ys):
        raise _Differs("other nodes")
    return pairs


def _rebatched(first: Graph, second: Graph, scale: _Scaler) -> Graph:
    if first.input_names != second.input_names:
        raise _Differs("other inputs")
    outputs_of = {n.name: n.outputs for n in first.nodes}

    def same(x, y) -> bool:
        return (x.kind, x.target, x.module_path, x.fqns, x.requires_grad) == (y.kind, y.target, y.module_path, y.fqns, y.requires_grad) and (
            [(scale.copies.get(r.node, r.node), r.index) for r in x.inputs] == [(scale.names.get(r.node), r.index) for r in y.inputs])

    def copy_of(x) -> str | None:  # a copy of one tensor, its output that tensor's meta, left out of a batch of 1 only
        if scale.b != 1 or x.target != COPY or len(x.inputs) != 1 or outputs_of[x.inputs[0].node][x.inputs[0].index] != x.outputs[0]:
            return None
        return x.inputs[0].node

    nodes = []
    for x, y in _paired(first.nodes, second.nodes, same, copy_of, scale):
        if x.name in scale.copies:  # its value is its input's: scaled as the input's counterpart
            nodes.append(dataclasses.replace(x, outputs=scale.value(x.outputs, (y.outputs[x.inputs[0].index],))))
        else:
            nodes.append(dataclasses.replace(x, outputs=scale.value(x.outputs, y.outputs), attrs=scale.value(x.attrs, y.attrs)))
    program, other = first.fx, second.fx
    for name, t in program.constants.items():
        theirs = other.constants.get(name)
        if not isinstance(theirs, torch.Tensor) or tuple(t.shape) != tuple(theirs.shape):
            raise _Differs(f"constant {name}")
    if (program.mutations, program.fixed, program.in_spec, program.out_spec) != (other.mutations, other.fixed, other.in_spec,
                                                                               other.out_spec):
        raise _Differs("another call")

    def same_op(x: fx.Node, y: fx.Node) -> bool:  # their arguments are compared as they are scaled
        return (x.op, x.target) == (y.op, y.target) and (x.op != "placeholder" or x.name == y.name)

    def program_copy_of(x: fx.Node) -> str | None:  # the IR's copies are the program's, under the same names
        return x.args[0].name if x.name in scale.copies and isinstance(x.args[0], fx.Node) else None

    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    for x, y in _paired(list(program.gm.graph.nodes), list(other.gm.graph.nodes), same_op, program_copy_of, scale):
        new = copied[x] = graph.node_copy(x, lambda node: copied[node])
        if x.name not in scale.copies:  # a copy's arguments are its input and a memory format: nothing to scale
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
