"""User annotations and how each one becomes placements on a mesh.

Three forms, as MindSpore and torchtitan users write them:

- MindSpore strategy tuples: ``meshplan.shard(model.mlp.fc1, in_strategy=((2, 1), (4, 1)))``,
  one split factor per tensor dim;
- MindSpore's ``Layout((2, 4), ("dp", "tp"))`` called as ``layout("dp", "None")``: a device matrix
  with alias names and, per tensor dim, the aliases that split it;
- placements: meshplan's or DTensor's ``(Replicate(), Shard(0))``, or the string ``"RS(0)"``,
  with ``None`` for an axis left to the search.

Name-pattern plans (``{"layers.*.mlp.fc1": "colwise"}``) are bound to the graph in
`constraints.py`, which also turns every annotation into a constraint on candidate strategies.

Split tuples -> placements (the device-matrix rule). A strategy's split factors > 1, read in
order, form its device matrix; as in MindSpore, that matrix is right-aligned to the mesh: the
last factor takes the innermost mesh axis (or run of consecutive axes whose sizes multiply to
it), the factor before it the next axes outward, and mesh axes left over on the outside repeat
the computation (Replicate). So on a (2, 4) mesh ``(4, 1)`` is Shard(0) on the size-4 axis and
on a (2, 2) mesh ``(2, 1)`` is Shard(0) on the inner axis, never the outer one. For an
``nn.Linear`` the ``in_strategy`` ``(x, weight[, bias])`` reads as MindSpore's MatMul with
``transpose_b=True``: its device matrix is ``x``'s factors followed by the factor of the output
features, so ``((2, 1), (4, 1))`` puts the batch on the outer size-2 axis and the output
features on the inner size-4 axis.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import placement_types as dt

from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Partial, Placement, Replicate, Shard, executable, fmt, parse

NONE_ALIAS = "None"
"""MindSpore's alias for a tensor dim that is not split."""

ATTR = "_meshplan_shard"
"""Attribute under which `shard` records its annotation on the module."""

MaybePlacements = tuple[Placement | None, ...]
"""A layout with holes: None leaves that mesh axis to the search."""


class AnnotationError(ValueError):
    """An annotation that cannot hold on this mesh or model; the message names it and the rule."""


# ---------------------------------------------------------------- MindSpore Layout


@dataclass(frozen=True, slots=True)
class Layout:
    """MindSpore's device matrix with one alias name per axis: ``Layout((2, 4), ("dp", "tp"))``.

    Call it with one entry per tensor dim: an alias, a tuple of aliases (the dim is split over
    all of them, outer first) or ``"None"``. The device matrix must equal the mesh shape; alias i
    names mesh axis i.
    """

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]

    def __init__(self, device_matrix: Sequence[int], alias_name: Sequence[str]) -> None:
        dm, names = tuple(device_matrix), tuple(alias_name)
        if not dm or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in dm):
            raise ValueError(f"Layout device_matrix {device_matrix!r} must be a non-empty tuple of positive ints")
        if len(names) != len(dm) or len(set(names)) != len(names) or NONE_ALIAS in names:
            raise ValueError(
                f"Layout alias_name {alias_name!r} must hold one distinct name per device-matrix axis "
                f"({len(dm)} for {dm}), none of them {NONE_ALIAS!r}"
            )
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "alias_name", names)

    def __call__(self, *tensor_map: str | Sequence[str]) -> TensorLayout:
        dims = []
        for entry in tensor_map:
            aliases = (entry,) if isinstance(entry, str) else tuple(entry)
            for a in aliases:
                if a != NONE_ALIAS and a not in self.alias_name:
                    raise ValueError(f"layout{tensor_map!r}: {a!r} is not an alias of {self}; allowed: {', '.join(self.alias_name)}, 'None'")
            if len(aliases) > 1 and NONE_ALIAS in aliases:
                raise ValueError(f"layout{tensor_map!r}: 'None' cannot be combined with other aliases in one dim")
            dims.append(entry if isinstance(entry, str) else aliases)
        used = [a for d in dims for a in ((d,) if isinstance(d, str) else d) if a != NONE_ALIAS]
        if len(used) != len(set(used)):
            raise ValueError(f"layout{tensor_map!r} uses a device-matrix axis twice; each alias may split one tensor dim")
        return TensorLayout(self, tuple(dims))

    def __repr__(self) -> str:
        return f"Layout({self.device_matrix!r}, {self.alias_name!r})"


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One tensor's layout: a `Layout` and, per tensor dim, the aliases splitting it."""

    layout: Layout
    tensor_map: tuple[str | tuple[str, ...], ...]

    def placements(self, mesh: MeshSpec, ndim: int, what: str) -> tuple[Placement, ...]:
        if self.layout.device_matrix != mesh.shape:
            raise AnnotationError(
                f"{what}: {self} has device matrix {self.layout.device_matrix} but the mesh is {mesh.shape} ({mesh}); "
                "the device matrix must equal the mesh shape"
            )
        if len(self.tensor_map) != ndim:
            raise AnnotationError(f"{what}: {self} gives {len(self.tensor_map)} dims but the tensor has {ndim}")
        out: list[Placement] = [Replicate()] * mesh.ndim
        for dim, entry in enumerate(self.tensor_map):
            aliases = () if entry == NONE_ALIAS else ((entry,) if isinstance(entry, str) else entry)
            axes = [self.layout.alias_name.index(a) for a in aliases]
            if axes != sorted(axes):
                # DTensor nests a dim split over several axes outer-axis-first; the other order is a strided shard
                raise AnnotationError(
                    f"{what}: {self} splits dim {dim} over {aliases} against the mesh order {self.layout.alias_name}; "
                    "list the aliases of one dim from the outer mesh axis to the inner one"
                )
            for a in axes:
                out[a] = Shard(dim)
        return tuple(out)

    def __str__(self) -> str:
        return "layout(" + ", ".join(repr(d) for d in self.tensor_map) + ")"

    __repr__ = __str__


# ---------------------------------------------------------------- meshplan.shard


@dataclass(frozen=True, slots=True)
class ShardAnnotation:
    """What `meshplan.shard` recorded on one module."""

    in_strategy: tuple | None
    out_strategy: tuple | None
    parameter_plan: tuple[tuple[str, Any], ...]
    """(name glob relative to the module, spec) pairs."""
    linear: bool
    """The module is an nn.Linear: `in_strategy` reads as MindSpore's MatMul (x, weight[, bias])."""


def shard(
    module: nn.Module,
    in_strategy: Sequence | None = None,
    out_strategy: Sequence | None = None,
    parameter_plan: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Annotate `module` as MindSpore's ``Cell.shard`` does; planning reads it by the module's path.

    `in_strategy`: one entry per tensor entering the module (for an ``nn.Linear``: ``(x, weight)``
    or ``(x, weight, bias)`` as MindSpore's MatMul primitive, or ``(x,)``); `out_strategy`: one per
    tensor leaving it; `parameter_plan`: parameter name (glob, relative to the module) -> layout.
    An entry is a split tuple, a ``layout(...)``, placements or ``None`` (searched). Calling it again
    on the same module replaces the earlier annotation. Returns the module.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"meshplan.shard annotates an nn.Module; got {type(module).__name__}")
    ins = _strategy_tuple(in_strategy, "in_strategy", module)
    outs = _strategy_tuple(out_strategy, "out_strategy", module)
    plan = dict(parameter_plan or {})
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    for key, spec in plan.items():
        if not isinstance(key, str) or not any(fnmatch.fnmatchcase(n, key) for n in names):
            raise ValueError(
                f"meshplan.shard({type(module).__name__}) parameter_plan key {key!r} matches no parameter of the module; "
                f"its parameters are {', '.join(names) or 'none'}"
            )
        check_spec(spec, f"parameter_plan[{key!r}]")
    if ins is None and outs is None and not plan:
        raise ValueError("meshplan.shard needs at least one of in_strategy, out_strategy, parameter_plan")
    setattr(module, ATTR, ShardAnnotation(ins, outs, tuple(plan.items()), isinstance(module, nn.Linear)))
    return module


def _strategy_tuple(strategy, name: str, module: nn.Module) -> tuple | None:
    if strategy is None:
        return None
    if not isinstance(strategy, (tuple, list)):
        raise ValueError(f"meshplan.shard({type(module).__name__}) {name} must be a tuple with one entry per tensor; got {strategy!r}")
    for i, spec in enumerate(strategy):
        if spec is not None:
            check_spec(spec, f"{name}[{i}]")
    return tuple(tuple(s) if isinstance(s, list) else s for s in strategy)


def module_annotations(model: nn.Module) -> dict[str, ShardAnnotation]:
    """Module path -> annotation, for every annotated submodule (under every path that reaches it)."""
    found = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        ann = mod.__dict__.get(ATTR)
        if ann is not None:
            found[path] = ann
    return found


# ---------------------------------------------------------------- specs -> placements


def spec_kind(spec) -> str:
    """'split', 'layout', 'placements' or 'string'; ValueError for anything else."""
    if isinstance(spec, TensorLayout):
        return "layout"
    if isinstance(spec, str):
        return "string"
    if isinstance(spec, (tuple, list)):
        if all(isinstance(f, int) and not isinstance(f, bool) for f in spec):
            return "split"
        if all(p is None or isinstance(p, (Shard, Replicate, Partial, dt.Placement)) for p in spec):
            return "placements"
    raise ValueError(
        f"layout {spec!r} is not understood; give a split tuple such as (2, 1), a Layout(...)(...) tensor layout, "
        "placements such as (Replicate(), Shard(0)) (meshplan's or DTensor's; None = searched) or a string such as 'RS(0)'"
    )


def check_spec(spec, what: str) -> None:
    """Reject a malformed spec early, when the user writes it, not at planning time."""
    try:
        kind = spec_kind(spec)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if kind == "split" and any(f < 1 for f in spec):
        raise ValueError(f"{what}: split factors must be >= 1; got {tuple(spec)}")
    if kind == "string":
        parse(spec)


def to_placements(spec, shape: tuple[int, ...], mesh: MeshSpec, what: str) -> MaybePlacements:
    """One tensor's layout from any annotation form (split tuples use the right-aligned rule)."""
    kind = spec_kind(spec)
    if kind == "layout":
        return spec.placements(mesh, len(shape), what)
    if kind == "split":
        split = tuple(spec)
        if len(split) != len(shape):
            raise AnnotationError(f"{what}: strategy {split} has {len(split)} dims but the tensor {list(shape)} has {len(shape)}")
        return split_placements([split], mesh, what)[0]
    if kind == "string":
        layout: MaybePlacements = parse(spec)
    else:
        layout = tuple(None if p is None else _own(p, what) for p in spec)
    if len(layout) != mesh.ndim:
        raise AnnotationError(f"{what}: layout {show(layout)} has {len(layout)} placements but the mesh {mesh} has {mesh.ndim} axes")
    for p in layout:
        if isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape):
            raise AnnotationError(f"{what}: {show(layout)} shards dim {p.dim} but the tensor {list(shape)} has {len(shape)} dims")
    return tuple(Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in layout)


def _own(p, what: str) -> Placement:
    own = executable(p)
    if own is None:
        raise AnnotationError(f"{what}: DTensor placement {p!r} is not supported; allowed: Shard(d), Replicate(), Partial('sum'|'avg')")
    return own


def assign_axes(factors: Sequence[int], mesh: MeshSpec, what: str) -> list[tuple[int, ...]]:
    """Mesh axes of each split factor by the right-aligned device-matrix rule (see the module doc)."""
    pos = mesh.ndim
    out: list[tuple[int, ...]] = [()] * len(factors)
    for i in reversed(range(len(factors))):
        f = factors[i]
        if f == 1:
            continue
        axes: list[int] = []
        prod = 1
        while prod < f and pos > 0:
            pos -= 1
            axes.insert(0, pos)
            prod *= mesh.shape[pos]
        if prod != f:
            raise AnnotationError(
                f"{what}: split factors {tuple(factors)} do not fit the mesh {mesh.shape} ({mesh}): factors > 1 are "
                "matched to mesh axes from the innermost outward, each taking one axis or consecutive axes whose sizes "
                f"multiply to it, and factor {f} (position {i}) meets "
                + (f"axes {tuple(axes)} of sizes {tuple(mesh.shape[a] for a in axes)}" if axes else "no axis left")
            )
        out[i] = tuple(axes)
    return out


def split_placements(splits: Sequence[tuple[int, ...]], mesh: MeshSpec, what: str) -> list[tuple[Placement, ...]]:
    """Placements of several tensors whose split tuples form one device matrix (concatenated in order)."""
    flat = [f for s in splits for f in s]
    axes = assign_axes(flat, mesh, what)
    out = []
    k = 0
    for split in splits:
        layout: list[Placement] = [Replicate()] * mesh.ndim
        for dim in range(len(split)):
            for a in axes[k + dim]:
                layout[a] = Shard(dim)
        k += len(split)
        out.append(tuple(layout))
    return out


def linear_placements(
    x: tuple[int, ...], weight: tuple[int, ...], bias: tuple[int, ...] | None, mesh: MeshSpec, what: str
) -> tuple[tuple[Placement, ...], tuple[Placement, ...], tuple[Placement, ...] | None]:
    """MindSpore MatMul(transpose_b=True): x (..., K), weight (N, K), bias (N,); device matrix x's factors + N."""
    if len(weight) != 2:
        raise AnnotationError(f"{what}: the weight strategy {weight} must have 2 dims (out_features, in_features)")
    if weight[1] != x[-1]:
        raise AnnotationError(
            f"{what}: x strategy {x} splits in_features by {x[-1]} but the weight strategy {weight} splits them by "
            f"{weight[1]}; a matmul needs the same split of the contracted dim on both"
        )
    if bias is not None and tuple(bias) != (weight[0],):
        raise AnnotationError(f"{what}: bias strategy {bias} must split out_features as the weight strategy {weight} does: ({weight[0]},)")
    axes = assign_axes(tuple(x) + (weight[0],), mesh, what)
    k_axes, n_axes = axes[len(x) - 1], axes[-1]

    def build(dims: Sequence[tuple[int, ...]]) -> tuple[Placement, ...]:
        layout: list[Placement] = [Replicate()] * mesh.ndim
        for dim, ax in enumerate(dims):
            for a in ax:
                layout[a] = Shard(dim)
        return tuple(layout)

    return build(axes[: len(x)]), build([n_axes, k_axes]), (build([n_axes]) if bias is not None else None)


def show(layout: MaybePlacements) -> str:
    """`S(0)R`, with `*` for an axis left to the search."""
    return "".join("*" if p is None else fmt((p,)) for p in layout)


def show_spec(spec) -> str:
    """An annotation as the user wrote it, for messages."""
    if isinstance(spec, (tuple, list)) and spec_kind(spec) == "placements":
        return "(" + ", ".join(repr(p) for p in spec) + ("," if len(spec) == 1 else "") + ")"
    return repr(spec) if not isinstance(spec, TensorLayout) else str(spec)
