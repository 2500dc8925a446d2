"""The IR: a flat list of nodes in topological order, each producing one or more tensors.

One node type for everything (inputs, parameters, ops, the output) keeps every pass a loop over
`Graph.nodes`. Multi-output ops (layer norm, split) are single nodes; consumers name the output
they read with a `TensorRef`, so there are no `getitem` nodes.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from meshplan.ir.precision import MixedPrecision

NodeKind = Literal["input", "param", "buffer", "constant", "op", "output"]


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(map(int, t.shape)), _dtype_name(t.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Output `index` of node `node`."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"


@dataclass(frozen=True, slots=True)
class Node:
    """One operation (or graph input/parameter/output) of the traced model."""

    name: str
    """Unique name, equal to the torch.fx node name it came from."""
    kind: NodeKind
    target: str
    """The ATen op (`aten.mm.default`), the parameter FQN, or the input name."""
    inputs: tuple[TensorRef, ...]
    """Tensor arguments, flattened in argument order."""
    outputs: tuple[TensorMeta | None, ...]
    """Tensors produced; None for a non-tensor output of a multi-output op."""
    module_path: str = ""
    """FQN of the innermost user module that issued the op ("" at top level)."""
    fqns: tuple[str, ...] = ()
    """For parameters and buffers: every FQN that names this tensor (tied weights have several)."""
    requires_grad: tuple[bool, ...] = ()
    """Per output: does a gradient flow back into it (found by running the graph on meta tensors)."""
    attrs: tuple = ()
    """Static (non-tensor) arguments of meshplan's own region ops (e.g. the moe op's top_k); for ATen ops only
    `(("is_causal", True),)` on attention called with a causal mask, else empty. Not in `fingerprint`."""

    def grad(self, index: int = 0) -> bool:
        return bool(self.requires_grad and self.requires_grad[index])

    @property
    def out(self) -> TensorMeta:
        meta = self.outputs[0]
        if meta is None:
            raise AssertionError(f"node {self.name} has no tensor output 0")
        return meta

    @property
    def layer(self) -> str | None:
        """The repeated layer this node belongs to (`layers.3`), if any."""
        return layer_of(self.module_path or (self.fqns[0] if self.fqns else ""))


@functools.lru_cache(maxsize=None)
def _group_of(layer: str) -> str:
    """`layers.3` -> `layers.*`."""
    return re.sub(r"\.\d+$", ".*", layer)


@functools.lru_cache(maxsize=None)  # called per node many times per solve; paths repeat across solves
def layer_of(path: str) -> str | None:
    """`layers.3.attn.q_proj` -> `layers.3`: the outermost numbered module on a module path."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", path)
    return m.group(1) if m else None


@dataclass(slots=True)
class Graph:
    """Nodes in topological order plus the traced torch program the runtime rewrites."""

    nodes: list[Node]
    fx: Any = field(default=None, repr=False, compare=False)
    """The torch.fx GraphModule (ATen level) the nodes were read from; not serialised."""
    input_names: tuple[str, ...] = ()
    """User-input nodes in call order (flattened)."""
    precision: MixedPrecision | None = None
    """The mixed-precision policy whose casts the program carries (ir/precision.py); None: the model's dtypes."""
    _index: dict[str, Node] = field(default_factory=dict, repr=False, compare=False)
    _consumers: dict[str, list[tuple[str, int]]] | None = field(default=None, init=False, repr=False, compare=False)
    weight_casts: frozenset[str] = field(init=False, repr=False, compare=False)
    """Op nodes that cast a parameter (mixed precision): their output is a working copy of the weight,
    made once per step and kept for backward, counted with the parameters (not per microbatch)."""
    param_values: frozenset[str] = field(init=False, repr=False, compare=False)
    """The parameters and their working copies (`weight_casts`): what a plan in head-tail token order keeps in
    contiguous blocks where it splits them (planner/token_order.py)."""

    def __post_init__(self) -> None:
        self._index = {n.name: n for n in self.nodes}
        self.weight_casts = frozenset(
            n.name for n in self.nodes
            if n.kind == "op" and n.target == "aten._to_copy.default" and len(n.inputs) == 1 and self[n.inputs[0].node].kind == "param"
        )
        self.param_values = frozenset(n.name for n in self.nodes if n.kind == "param") | self.weight_casts

    def __getitem__(self, name: str) -> Node:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the graph") from None

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def meta(self, ref: TensorRef) -> TensorMeta:
        meta = self[ref.node].outputs[ref.index]
        if meta is None:
            raise AssertionError(f"{ref} is not a tensor")
        return meta

    def consumers(self) -> dict[str, list[tuple[str, int]]]:
        """node name -> [(consumer name, input position)]. Computed once: the caller must not change it."""
        if self._consumers is None:
            users: dict[str, list[tuple[str, int]]] = {n.name: [] for n in self.nodes}
            for n in self.nodes:
                for i, ref in enumerate(n.inputs):
                    users[ref.node].append((n.name, i))
            self._consumers = users
        return self._consumers

    @property
    def output(self) -> Node:
        last = self.nodes[-1]
        if last.kind != "output":
            raise AssertionError("graph must end with its output node")
        return last

    def loss_outputs(self) -> frozenset[TensorRef]:
        """The outputs that are the model's own loss: scalars that receive a gradient (a Hugging Face model given
        `labels=`); empty when the loss is computed outside the model."""
        return frozenset(r for r in self.output.inputs if self[r.node].grad(r.index) and self.meta(r).shape == ())

    def layer_groups(self) -> dict[str, list[str]]:
        """Repeated layers: `layers.*` -> [`layers.0`, `layers.1`, ...], in order."""
        groups: dict[str, list[str]] = {}
        for n in self.nodes:
            layer = n.layer
            if layer is None:
                continue
            key = _group_of(layer)
            if layer not in groups.setdefault(key, []):
                groups[key].append(layer)
        return groups

    def fingerprint(self) -> str:
        """Stable hash of structure and shapes: a plan is valid only for the graph it was made for."""
        import hashlib

        h = hashlib.sha256()
        for n in self.nodes:
            h.update(f"{n.name}|{n.kind}|{n.target}|{n.inputs}|{n.outputs}\n".encode())
        return h.hexdigest()[:16]
