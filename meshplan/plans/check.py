"""Check a Plan decoded from JSON before anything runs it: every field has its declared type, and
the indices in it (mesh axes, tensor dims) point at something that exists.

A plan file is input like any other: a truncated, hand-edited or hostile file must end in one
`ValueError` naming the field, never in a TypeError or IndexError deep inside the runtime. The
types come from the dataclasses' own annotations, so fields added later are checked too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Union

from meshplan.cost_model.redistribution import DUAL_KIND
from meshplan.ir.mesh import CP_AXIS
from meshplan.ir.placement import Partial, Shard


def check_plan(plan) -> None:
    """Raise ValueError('plan file is malformed: <field path> ...') for the first field that is wrong."""
    _check(plan, type(plan), "plan")
    ndim = plan.mesh.ndim
    if plan.token_order and CP_AXIS not in plan.mesh.axis_names:
        raise _bad("token_order", f"is true, which orders the splits of a {CP_AXIS!r} axis, and mesh {plan.mesh} has none")

    def layout(value, path: str, rank: int | None = None) -> None:
        if value is None:
            return
        if len(value) != ndim:
            raise _bad(path, f"has {len(value)} placements for a {ndim}-axis mesh")
        for p in value:
            if isinstance(p, Shard) and (p.dim < 0 or (rank is not None and p.dim >= rank)):
                raise _bad(path, f"shards tensor dim {p.dim}" + (f" of a {rank}-dim tensor" if rank is not None else ""))

    def axis(a: int, path: str) -> None:
        if not 0 <= a < ndim:
            raise _bad(path, f"names mesh axis {a}; the mesh has axes 0..{ndim - 1}")

    for i, n in enumerate(plan.nodes):
        for j, lay in enumerate(n.strategy.inputs):
            layout(lay, f"nodes[{i}].strategy.inputs[{j}]")
        for j, lay in enumerate(n.strategy.outputs):
            layout(lay, f"nodes[{i}].strategy.outputs[{j}]")
    for i, t in enumerate(plan.transfers):
        layout(t.src, f"transfers[{i}].src")
        layout(t.dst, f"transfers[{i}].dst")
        for phase in ("forward", "backward"):
            for j, s in enumerate(getattr(t, phase)):
                if s.kind not in DUAL_KIND:
                    raise _bad(f"transfers[{i}].{phase}[{j}].kind", f"is {s.kind!r}; allowed: {', '.join(DUAL_KIND)}")
                if s.reduce not in ("sum", "avg"):
                    raise _bad(f"transfers[{i}].{phase}[{j}].reduce", f"is {s.reduce!r}; allowed: sum, avg")
                axis(s.axis, f"transfers[{i}].{phase}[{j}].axis")
    for i, p in enumerate(plan.params):
        if any(s < 0 for s in p.shape):
            raise _bad(f"params[{i}].shape", f"is {list(p.shape)}; sizes must be >= 0")
        if not p.fqns:
            raise _bad(f"params[{i}].fqns", "is empty; a parameter has at least one name")
        layout(p.layout, f"params[{i}].layout", len(p.shape))
        if any(isinstance(q, Partial) for q in p.layout):
            raise _bad(f"params[{i}].layout", "is partial; a parameter is sharded or replicated")
        for a in p.grad_sync_axes:
            axis(a, f"params[{i}].grad_sync_axes")
    for i, inp in enumerate(plan.inputs):
        layout(inp.layout, f"inputs[{i}].layout", len(inp.shape))
    trainable = {p.node for p in plan.params if not p.is_buffer}
    for i, b in enumerate(plan.buckets):
        for a in b.axes:
            axis(a, f"buckets[{i}].axes")
        for name in b.params:
            if name not in trainable:
                raise _bad(f"buckets[{i}].params", f"names {name!r}, which is not a parameter of the plan")
    pipe = plan.pipeline
    if pipe is not None:
        for what in ("degree", "microbatches", "chunks"):
            if getattr(pipe, what) < 1:
                raise _bad(f"pipeline.{what}", f"is {getattr(pipe, what)}; expected at least 1")
        for i, st in enumerate(pipe.stages):
            if not 0 <= st.device < pipe.degree:
                raise _bad(f"pipeline.stages[{i}].device", f"is {st.device}; the pipeline has ranks 0..{pipe.degree - 1}")


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"plan file is malformed: {path} {what}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(value: Any, hint: Any, path: str) -> None:
    """`value` is an instance of the annotation `hint` (dataclasses recursively)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return
    if origin in (Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _check(value, option, path)
            except ValueError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else _bad(path, f"is {_show(value)}; expected {_name(hint)}")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            raise _bad(path, f"is {_show(value)}; expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            for i, v in enumerate(value):
                _check(v, args[0], f"{path}[{i}]")
            return
        if len(args) != len(value):
            raise _bad(path, f"has {len(value)} items; expected {len(args)}")
        for i, (v, a) in enumerate(zip(value, args)):
            _check(v, a, f"{path}[{i}]")
        return
    if hint is type(None):
        if value is not None:
            raise _bad(path, f"is {_show(value)}; expected null")
        return
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise _bad(path, f"is {_show(value)}; expected a number")
        return
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(path, f"is {_show(value)}; expected an integer")
        return
    if not isinstance(hint, type):
        raise AssertionError(f"check_plan cannot check annotation {hint!r} at {path}")
    if not isinstance(value, hint):
        raise _bad(path, f"is {_show(value)}; expected {_name(hint)}")
    if dataclasses.is_dataclass(hint):
        for name, field_hint in _hints(hint).items():
            if name in {f.name for f in dataclasses.fields(hint)}:
                _check(getattr(value, name), field_hint, f"{path}.{name}" if path != "plan" else name)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("meshplan.ir.placement.", "")


def _show(value: Any) -> str:
    text = repr(value)
    return (text[:60] + "...") if len(text) > 60 else text
