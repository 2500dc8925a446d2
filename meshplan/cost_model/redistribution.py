"""How a tensor moves from one layout to another: the exact list of collectives, forward and backward.

This file is the single source of truth for resharding. The cost model prices these steps, the plan
lists them, and the runtime executes them, so "the plan is the truth" holds by construction.

Gradient convention (the dual layouts): the gradient of a tensor laid out `S(d)` is `S(d)`, of `R`
is `P` (each rank holds a part of the full gradient) and of `P` is `R`. Under it the backward of
every step is one step too: all-gather <-> reduce-scatter, all-reduce <-> all-reduce,
all-to-all(i->j) <-> all-to-all(j->i), chunk (R->S, free) <-> pad (S->P, free), and
to_partial (R->P: the axis' first device keeps the value, the others hold zeros; free) <-> itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshplan.ir.graph import TensorMeta
from meshplan.ir.placement import Partial, Placements, Replicate, Shard, local_shape

DUAL_KIND = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "chunk": "pad",
    "pad": "chunk",
    "to_partial": "to_partial",
    "send_recv": "send_recv",
}
COMMUNICATING = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
"""Kinds that move data between devices; send_recv only in a region op's own steps (ring attention), never a redistribution's."""


@dataclass(frozen=True, slots=True)
class CommStep:
    """One step of a redistribution on one mesh axis."""

    kind: str
    """all_gather | reduce_scatter | all_reduce | all_to_all | chunk | pad | to_partial | send_recv (ring attention)."""
    axis: int
    """The mesh axis whose devices take part."""
    dim: int = -1
    """Tensor dim gathered, scattered or chunked (the source dim of an all-to-all)."""
    dim2: int = -1
    """Destination dim of an all-to-all."""
    reduce: str = "sum"
    """For reductions: 'sum' or 'avg' (the avg is a sum divided by the axis size)."""
    nbytes: int = 0
    """Bytes of the larger side of the step on one device (what the collective moves in total)."""

    @property
    def communicates(self) -> bool:
        return self.kind in COMMUNICATING

    def dual(self) -> CommStep:
        """The step autograd runs for this one in backward."""
        # built directly: `dataclasses.replace` costs more than the rest of pricing a move (the planner asks for
        # the backward of every move it prices)
        if self.kind == "all_to_all":
            return CommStep(self.kind, self.axis, self.dim2, self.dim, self.reduce, self.nbytes)
        return CommStep(DUAL_KIND[self.kind], self.axis, self.dim, self.dim2, self.reduce, self.nbytes)

    def __str__(self) -> str:
        arg = f"{self.dim}->{self.dim2}" if self.kind == "all_to_all" else ("" if self.dim < 0 else str(self.dim))
        red = "" if self.reduce == "sum" else f",{self.reduce}"
        return f"{self.kind}(ax{self.axis}{',d' + arg if arg else ''}{red})"


class InfeasibleRedistribution(ValueError):
    """The target layout cannot be reached (e.g. R -> P): such a pair is never a candidate."""


def redistribution_steps(
    meta: TensorMeta, src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
) -> list[CommStep]:
    return list(_steps(meta, src, dst, mesh_shape))


@functools.lru_cache(maxsize=1 << 16)
def _steps(meta: TensorMeta, src: Placements, dst: Placements, mesh_shape: tuple[int, ...]) -> tuple[CommStep, ...]:
    """Forward steps taking a tensor from layout `src` to `dst`: `_moves`' steps, with the bytes of this tensor."""
    found = _moves(src, dst, mesh_shape)
    if isinstance(found, Exception):
        raise type(found)(*found.args)
    return tuple(CommStep(kind, a, dim, dim2, reduce, _bytes(meta, local_shape(meta.shape, sized, mesh_shape)))
                 for kind, a, dim, dim2, reduce, sized in found)


@functools.lru_cache(maxsize=1 << 17)
def step_cuts(src: Placements, dst: Placements, mesh_shape: tuple[int, ...]) -> tuple[tuple, ...] | Exception:
    """`_moves`' steps as (kind, axis, dim, reduce, cuts), `cuts` the (tensor dim, axis size) pairs the layout that
    sizes the step divides a tensor's shape by, in `local_shape`'s order: what pricing a move needs of its steps,
    without a `CommStep` per step per tensor (the planner prices hundreds of thousands of moves)."""
    found = _moves(src, dst, mesh_shape)
    if isinstance(found, Exception):
        return found
    return tuple((kind, a, dim, reduce, tuple((p.dim, n) for p, n in zip(sized, mesh_shape) if isinstance(p, Shard)))
                 for kind, a, dim, _, reduce, sized in found)


@functools.lru_cache(maxsize=1 << 17)
def _moves(src: Placements, dst: Placements, mesh_shape: tuple[int, ...]) -> tuple[tuple, ...] | Exception:
    """The steps taking any tensor from layout `src` to `dst`, as (kind, axis, dim, dim2, reduce, the layout whose
    local size is the step's bytes), or the error saying why none do. They do not depend on the tensor (its shape
    only sizes each step), so planning a model computes them once per layout pair and mesh, not once per tensor.

    Unsharding runs innermost axis first and sharding outermost first, which keeps DTensor's
    nesting of several mesh axes on one tensor dim (the outer axis takes the outer blocks).
    """
    if not (len(src) == len(dst) == len(mesh_shape)):
        raise AssertionError((src, dst, mesh_shape))
    # on an axis of one device every layout holds the same local tensor: nothing to move
    src = tuple(d if size == 1 else s for s, d, size in zip(src, dst, mesh_shape))
    if src == dst:
        return ()
    n = len(mesh_shape)
    for a in range(n):
        if isinstance(dst[a], Partial) and src[a] != dst[a] and (isinstance(src[a], Partial) or dst[a].reduce_op != "sum"):
            return InfeasibleRedistribution(f"cannot reach {dst[a]} from {src[a]} on mesh axis {a}")

    # Axes to unshard: those whose shard changes, plus inner axes sharing a dim with an axis that
    # is (un)sharded, since those must be regathered to keep the nesting order.
    unshard = {a for a in range(n) if isinstance(src[a], Shard) and src[a] != dst[a]}
    changing = {a for a in range(n) if src[a] != dst[a]}
    grew = True
    while grew:
        grew = False
        for a in sorted(changing | unshard):
            p = src[a] if a in unshard else dst[a]
            if not isinstance(p, Shard):
                continue
            for b in range(a + 1, n):
                if src[b] == p and b not in unshard:
                    unshard.add(b)
                    changing.add(b)
                    grew = True

    cur = list(src)
    steps: list[tuple] = []

    def step(kind: str, a: int, dim: int = -1, dim2: int = -1, reduce: str = "sum") -> None:
        steps.append((kind, a, dim, dim2, reduce, tuple(cur)))  # the local tensor before the step

    for a in sorted(unshard, reverse=True):
        d = cur[a].dim  # type: ignore[union-attr]
        target = dst[a]
        if _can_all_to_all(a, cur, target, dst, unshard):
            step("all_to_all", a, dim=d, dim2=target.dim)  # type: ignore[union-attr]
            cur[a] = target
        else:
            # the gathered tensor is the larger side
            cur[a] = Replicate()
            step("all_gather", a, dim=d)

    for a in range(n):
        if cur[a] == dst[a]:
            continue
        c, t = cur[a], dst[a]
        if isinstance(c, Partial) and isinstance(t, Replicate):
            step("all_reduce", a, reduce=c.reduce_op)
        elif isinstance(c, Partial) and isinstance(t, Shard):
            step("reduce_scatter", a, dim=t.dim, reduce=c.reduce_op)
        elif isinstance(c, Replicate) and isinstance(t, Shard):
            step("chunk", a, dim=t.dim)
        elif isinstance(c, Replicate) and isinstance(t, Partial):
            step("to_partial", a)
        else:
            return InfeasibleRedistribution(f"cannot reach {t} from {c} on mesh axis {a}")
        cur[a] = t
    if tuple(cur) != tuple(dst):
        raise AssertionError((cur, dst))
    return tuple(steps)


def _can_all_to_all(a: int, cur: list, target, dst: Placements, unshard: set[int]) -> bool:
    """S(i) -> S(j) on one axis, with neither dim touched by any other axis."""
    if not isinstance(target, Shard) or len(unshard) != 1:
        return False
    dims = {cur[a].dim, target.dim}
    others = [p for b, p in enumerate(cur) if b != a] + [p for b, p in enumerate(dst) if b != a]
    return not any(isinstance(p, Shard) and p.dim in dims for p in others)


def _bytes(meta: TensorMeta, shape: tuple[int, ...]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * meta.itemsize


def backward_steps(forward: list[CommStep]) -> list[CommStep]:
    """What autograd runs for `forward`, in execution order."""
    return [s.dual() for s in reversed(forward)]
