"""The runtime's collectives: one autograd Function per redistribution step, with counters.

Each step's backward is its dual step (see cost_model/redistribution.py), so autograd carries
gradients across layouts with exactly the collectives the plan lists. Every collective the
runtime issues goes through `count_collective`, which counts it: the counters are how tests check that
the plan is the truth.

Inside the per-rank program the collectives are PyTorch's functional collectives
(`torch.distributed._functional_collectives`): they take the tensor on whatever device it lives
on and the group by name, return a new tensor, and trace into a `torch.compile` graph. Eagerly,
each one is counted and waited for inside `MeshComm.guard`, so a failure or timeout becomes a
`CollectiveError`; while Dynamo traces (`torch.compiler.is_compiling()`), counting, the guard and
the recompute check (Python side effects that would break the graph) are left out, so a compiled
program neither counts its collectives nor names them in errors.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.mesh import MeshSpec
from meshplan.runtime import token_order

COUNTS: Counter = Counter()
"""'forward:all_gather', 'backward:reduce_scatter', 'grad_sync:all_reduce', ... since the last reset."""


TIMEOUT_ENV = "MESHPLAN_TIMEOUT"
"""Environment variable: seconds a collective may wait for the other ranks (when `timeout=` is not given)."""
DEFAULT_TIMEOUT = timedelta(minutes=10)
"""NCCL's default: long enough for a slow first step, short enough that a lost rank is noticed."""


def reset_counts() -> None:
    COUNTS.clear()


def resolve_timeout(timeout: timedelta | float | None = None) -> timedelta:
    """`timeout` (a timedelta or seconds), else $MESHPLAN_TIMEOUT seconds, else `DEFAULT_TIMEOUT`."""
    source = "timeout"
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV)
        if env is None:
            return DEFAULT_TIMEOUT
        source = TIMEOUT_ENV
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={env!r} is not a number; give the collective timeout in seconds, e.g. 300") from None
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout) if math.isfinite(timeout) else timedelta(0)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"{source}={given!r} is not allowed; give a positive number of seconds or a datetime.timedelta")
    return timeout


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a rank died, never joined, or ran a different sequence of collectives."""


class MeshComm:
    """This rank's place on the mesh, its device, and a process group for every line of axes it needs.

    `ranks[i]` is the global rank at mesh position i (row-major; default: global ranks 0..N-1), so a
    plan can run on any sub-group of the job. Groups are created with `dist.new_group` rather than
    `init_device_mesh` because each needs `timeout` (a collective that waits longer for another
    rank raises `CollectiveError` instead of hanging) and because a sub-group's ranks must not wait
    for ranks outside it (`use_local_synchronization`); `device_mesh` then wraps the same groups in
    a DeviceMesh, which DTensor parameters, optimizers and DCP use.
    """

    def __init__(self, mesh: MeshSpec, rank: int, ranks: Sequence[int] | None = None, *,
                 timeout: timedelta | float | None = None, device: torch.device | str = "cpu") -> None:
        ranks = list(range(mesh.size)) if ranks is None else [int(r) for r in ranks]
        if len(ranks) != mesh.size:
            raise ValueError(f"plan is for {mesh.size} devices (mesh {mesh}) but the process group has {len(ranks)} ranks")
        self.mesh = mesh
        self.rank = rank
        self.ranks = ranks
        self.coord = mesh.coordinate(rank)
        self.timeout = resolve_timeout(timeout)
        self.device = torch.device(device)
        self._groups: dict[tuple[int, ...], object] = {}
        self._group_names: dict[tuple[int, ...], str] = {}
        self._device_mesh: DeviceMesh | None = None

    @property
    def world(self):
        """The group of every rank of the mesh (created by the first `create_groups`)."""
        return self.group(tuple(range(self.mesh.ndim)))

    @property
    def device_mesh(self) -> DeviceMesh:
        """The plan's mesh as a DeviceMesh over this comm's own per-axis groups (no new group)."""
        if self._device_mesh is None:
            self.create_groups([(a,) for a in range(self.mesh.ndim)])
            layout = torch.tensor(self.ranks, dtype=torch.int).view(self.mesh.shape)
            groups = [self.group((a,)) for a in range(self.mesh.ndim)]
            self._device_mesh = DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], self.device.type,
                                                      mesh=layout, mesh_dim_names=self.mesh.axis_names)
        return self._device_mesh

    @contextlib.contextmanager
    def guard(self, what: str):
        """Turn a failed or timed-out collective into a `CollectiveError` that says what waited and why."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as e:  # gloo/NCCL/store failures and timeouts arrive as RuntimeError subclasses
            raise CollectiveError(
                f"rank {self.rank} (mesh coordinate {self.coord} on {self.mesh}): {what} failed after waiting at most "
                f"{self.timeout.total_seconds():g} s for the other ranks: another rank died, failed to join, or ran a "
                f"different sequence of collectives. Cause: {str(e).strip()[:400]}. "
                f"(Set the limit with auto_parallelize(..., timeout=) or ${TIMEOUT_ENV}.)"
            ) from e

    def group(self, axes: tuple[int, ...]):
        """The group of ranks that differ from this one only on `axes` (created on first use by all ranks)."""
        axes = tuple(sorted(axes))
        if axes not in self._groups:
            raise AssertionError(f"process group for mesh axes {axes} was not created at setup")
        return self._groups[axes]

    def group_name(self, axis: int) -> str:
        """The registered name of the group along one mesh axis: how functional collectives take it
        (a string traces into a compiled graph as a constant). A plain lookup, filled when the group is
        created: a compiled program guards on this dict, so it must not change after setup."""
        if (axis,) not in self._group_names:
            raise AssertionError(f"process group for mesh axis {axis} was not created at setup")
        return self._group_names[(axis,)]

    def create_groups(self, axis_sets: list[tuple[int, ...]]) -> None:
        """Create this rank's group for each set of axes. Every rank of the mesh calls this with the same
        list; ranks outside the mesh need not (each group synchronises only its members)."""
        for axes in sorted({tuple(sorted(a)) for a in axis_sets}):
            if axes in self._groups:
                continue
            others = [a for a in range(self.mesh.ndim) if a not in axes]
            line = [self.ranks[r] for r in range(self.mesh.size)
                    if all(self.mesh.coordinate(r)[a] == self.coord[a] for a in others)]
            with self.guard(f"creating the process group for mesh axes {axes} (ranks {line})"):
                self._groups[axes] = dist.new_group(line, timeout=self.timeout, use_local_synchronization=True)
            self._group_names[axes] = self._groups[axes].group_name

    def size(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)


def count_collective(phase: str, kind: str) -> None:
    """Count one collective (eagerly; under `torch.compile` tracing nothing is counted, see the module doc)."""
    if not torch.compiler.is_compiling():
        COUNTS[f"{phase}:{kind}"] += 1


def forward_phase() -> str:
    """'recompute' for a forward running inside backward (a checkpointed layer running again), else 'forward'.
    Under compile tracing always 'forward': the phase only names counts and errors, which compiled code skips."""
    if torch.compiler.is_compiling():
        return "forward"
    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


def wait(t: torch.Tensor) -> torch.Tensor:
    """The finished result of a functional collective: eagerly it arrives as an AsyncCollectiveTensor,
    waited for here (inside the caller's guard, so a failure surfaces there); traced, funcol already
    put the wait in the graph."""
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def collective(comm: MeshComm, phase: str, kind: str, what, fn, *args) -> torch.Tensor:
    """`fn(*args)`, a collective that returns its waited result: counted as `phase:kind` and guarded
    (errors become `CollectiveError` saying `what()`) when eager; plainly called under compile tracing."""
    if torch.compiler.is_compiling():
        return fn(*args)
    COUNTS[f"{phase}:{kind}"] += 1
    with comm.guard(what()):
        return fn(*args)


def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """A new tensor: `x` reduced over `group` (functional: `x` is left as it was)."""
    return wait(funcol.all_reduce(x, op, group))


def all_reduce_axes(x: torch.Tensor, comm: MeshComm, axes: tuple[int, ...], phase: str, what: str, op: str = "sum") -> torch.Tensor:
    """`x` reduced over each mesh axis in `axes` in turn (a new tensor), each a counted, guarded collective
    whose error reads '{phase} {what} over mesh axis {name}'."""
    for a in axes:
        x = collective(comm, phase, "all_reduce", lambda: f"{phase} {what} over mesh axis {comm.mesh.axis_names[a]}",
                       all_reduce, x, comm.group_name(a), op)
    return x


def run_step(step: CommStep, x: torch.Tensor, comm: MeshComm, phase: str, head_tail: bool = False) -> torch.Tensor:
    """Execute one step on the local tensor (no autograd: callers wrap this). `head_tail`: the split the step makes or
    undoes holds each place's two chunks in head-tail token order (runtime/token_order.py), not one contiguous block."""
    n = comm.mesh.shape[step.axis]
    me = comm.coord[step.axis]
    if step.kind == "chunk":
        return token_order.take(x, step.dim, n, me) if head_tail else x.chunk(n, dim=step.dim)[me].contiguous()
    if step.kind == "pad":
        if head_tail:
            return token_order.put(x, step.dim, n, me)
        shape = list(x.shape)
        shape[step.dim] *= n
        out = x.new_zeros(shape)
        out.narrow(step.dim, me * x.shape[step.dim], x.shape[step.dim]).copy_(x)
        return out
    if step.kind == "to_partial":
        return x if me == 0 else torch.zeros_like(x)
    out = collective(comm, phase, step.kind,
                     lambda: f"{phase} {step} over mesh axis {comm.mesh.axis_names[step.axis]}",
                     _communicate, step, x, n, comm.group_name(step.axis), head_tail)
    if step.reduce == "avg":
        out = out / n
    return out


def _communicate(step: CommStep, x: torch.Tensor, n: int, group: str, head_tail: bool) -> torch.Tensor:
    if step.kind == "all_reduce":
        out = all_reduce(x, group)  # into a fresh contiguous copy, as an in-place all_reduce of a clone
    elif step.kind == "all_gather":
        x = x.contiguous()
        buf = wait(funcol.all_gather_single(x, 0, group))
        if head_tail:
            return token_order.join(buf.view((n,) + tuple(x.shape)).unbind(0), step.dim)
        # gathered rank after rank along dim 0: that already is the result for dim 0 (no second copy)
        out = buf if step.dim == 0 else torch.cat(buf.view((n,) + tuple(x.shape)).unbind(0), dim=step.dim)
    elif step.kind == "reduce_scatter":
        if head_tail:
            pieces = token_order.stacked(x, step.dim, n).flatten(0, 1)
        else:  # a contiguous tensor already holds its dim-0 chunks rank after rank: no stacked copy for dim 0
            pieces = x.contiguous() if step.dim == 0 else torch.cat(x.chunk(n, dim=step.dim))
        out = wait(funcol.reduce_scatter_single(pieces, "sum", 0, group))
    elif step.kind == "all_to_all":
        if head_tail:
            pieces = token_order.stacked(x, step.dim2, n)
        else:
            pieces = torch.stack([c.contiguous() for c in x.chunk(n, dim=step.dim2)])
        recv = wait(funcol.all_to_all_single(pieces, None, None, group)).unbind(0)
        out = token_order.join(recv, step.dim) if head_tail else torch.cat(recv, dim=step.dim)
    else:
        raise AssertionError(f"unknown step kind {step.kind}")
    return out


class StepFunction(torch.autograd.Function):
    """One redistribution step; backward runs the dual step (in the same token order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, step: CommStep, comm: MeshComm, head_tail: bool = False) -> torch.Tensor:
        ctx.step, ctx.comm, ctx.head_tail = step, comm, head_tail
        return run_step(step, x, comm, forward_phase(), head_tail)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return run_step(ctx.step.dual(), grad, ctx.comm, "backward", ctx.head_tail), None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` (user-facing outputs, see ParallelModule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """`ScaleGrad` as a plain function, so fx can print and call it."""
    return ScaleGrad.apply(x, factor)
