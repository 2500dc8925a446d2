"""Collectives that run inside a sharded kernel (`Strategy.kernel`, executed by `runtime/kernels.py`).

Resharding between ops is listed by `redistribution.py`; a few ops also communicate inside
themselves when split along a dim they reduce. `log_softmax(dim=d)` split along `d`: per splitting
axis, forward all-reduces the row max (MAX) and the row sum of exponentials (SUM), backward
all-reduces the row sum of the gradient. Each reduces a tensor of the input's local shape with
`d` of size 1. `masked` lookups communicate nothing themselves (their outputs are partial sums).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.graph import TensorMeta
from meshplan.ir.placement import Placements, Shard, local_shape

KERNELS = ("masked", "log_softmax")


def parse_kernel(kernel: str) -> tuple[str, int | None]:
    """`'log_softmax(dim=1)'` -> ('log_softmax', 1); `'masked'` -> ('masked', None)."""
    m = re.fullmatch(r"(\w+)(?:\(dim=(-?\d+)\))?", kernel)
    assert m and m.group(1) in KERNELS, f"unknown kernel {kernel!r}; known: {KERNELS}"
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def kernel_axes(kernel: str, out_layout: Placements | None) -> tuple[int, ...]:
    """Mesh axes a reducing kernel communicates over: those that split its reduced dim."""
    name, dim = parse_kernel(kernel)
    if name != "log_softmax" or out_layout is None:
        return ()
    return tuple(a for a, p in enumerate(out_layout) if p == Shard(dim))


def kernel_steps(
    kernel: str, out_layouts: Sequence[Placements | None], outputs: Sequence[TensorMeta | None], mesh_shape: tuple[int, ...]
) -> tuple[list[CommStep], list[CommStep]]:
    """(forward, backward) collectives of one run of the kernel on one device."""
    if not kernel:
        return [], []
    name, dim = parse_kernel(kernel)
    layout, meta = out_layouts[0], outputs[0]
    axes = kernel_axes(kernel, layout)
    if not axes:
        return [], []
    assert layout is not None and dim is not None
    nbytes = 0  # counting only (no meta given)
    if meta is not None:
        shape = list(local_shape(meta.shape, layout, mesh_shape))
        shape[dim] = 1
        nbytes = meta.itemsize * _prod(shape)
    fwd = [CommStep("all_reduce", a, reduce=r, nbytes=nbytes) for a in axes for r in ("max", "sum")]
    bwd = [CommStep("all_reduce", a, nbytes=nbytes) for a in axes]
    return fwd, bwd


def _prod(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def kernel_time(
    kernel: str, out_layouts: Sequence[Placements | None], outputs: Sequence[TensorMeta | None], mesh_shape: tuple[int, ...],
    cluster, *, backward: bool,
) -> float:
    """Seconds of the kernel's own collectives per step (forward, plus backward when `backward`)."""
    from meshplan.cost_model.estimate import steps_time

    fwd, bwd = kernel_steps(kernel, out_layouts, outputs, mesh_shape)
    return steps_time(fwd + (bwd if backward else []), mesh_shape, cluster)
