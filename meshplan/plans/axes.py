"""What each mesh axis of a plan is used for, the names and layouts printed from that, and the devices it wastes.

The planner names a mesh by shape alone (`dp`, `dp, tp`, `dp0, dp1, tp`: `ir/mesh.py`) before the solver decides
what each axis carries, so a stored name can mislead: a plan that only splits the batch on a (2, 2) mesh is still
stored as `dp=2 x tp=2`. Every reading of a plan (summary, diff, explain, report) names the axes by use instead:

- `tp`: some parameter is used split along one of its tensor dims on the axis (tensor, or expert, parallelism);
- `dp`: something else the ops compute on is split on it (the batch, activations), or parameters are stored in
  shards on it and gathered for use (ZeRO / FSDP);
- `rep`: nothing is split on it: each of its devices computes the same (`wasted` says so, and why). An input split
  on arrival and gathered before its first op does not count.

Axes the user named (anything but the generic names above) keep their names. Axes of one device are hidden: they
split nothing and a layout's placement on them is always `R`. The plan file and the runtime's `DeviceMesh` keep
the stored names.

A query of the plan's data (like `Plan.collectives()`), so it sits in the plan layer, under the API: `meshplan.plan`
warns with `warn_wasted`, and the readings in `meshplan/inspect` print with `AxisView`.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.ir.placement import Partial, Placements, Replicate, Shard, short

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan
    from meshplan.plans.strategy import Strategy

GENERIC_NAME = re.compile(r"(dp\d*|tp|ax\d+)")
"""Axis names the planner gives by shape (ir/mesh.py); any other name is the user's and is kept."""
SUGGESTED = 4
"""Device counts suggested for an axis of n devices that splits nothing go up to this many times n."""


class ReplicatedWorkWarning(UserWarning):
    """A mesh axis of the plan splits nothing: its devices repeat each other's work."""


@dataclass(frozen=True, slots=True)
class AxisView:
    """How a plan's mesh reads: a display name per axis and which axes are shown."""

    names: tuple[str, ...]
    """Display name of each mesh axis (by use, or the user's own)."""
    roles: tuple[str, ...]
    """'tp', 'dp' or 'rep' per axis ('' for an axis of one device)."""
    shown: tuple[int, ...]
    """Axes of more than one device (every axis when there is none)."""
    sizes: tuple[int, ...]

    def layout(self, layout: Placements | None) -> str:
        """`S(0)R` on the shown axes; '-' for a non-tensor."""
        return "-" if layout is None else "".join(short(layout[a]) for a in self.shown)

    def strategy(self, s: Strategy) -> str:
        ins = ",".join(self.layout(p) for p in s.inputs)
        outs = ",".join(self.layout(p) for p in s.outputs)
        return f"{ins or '()'}->{outs}" + (f" [{s.kernel}]" if s.kernel else "")

    def axes(self, axes) -> str:
        """`dp,tp`: the display names of mesh axes (indices)."""
        return ",".join(self.names[a] for a in axes)

    def step(self, step) -> str:
        """A `CommStep` as `all_gather(tp,d0)`: its axis by display name."""
        return re.sub(r"\bax(\d+)", lambda m: self.names[int(m.group(1))], str(step))

    @property
    def mesh(self) -> str:
        """`dp=2 x tp=4` over the shown axes."""
        return " x ".join(f"{self.names[a]}={self.sizes[a]}" for a in self.shown)

    @property
    def grid(self) -> str:
        """`dp 2 x tp 4`, or `1 device`."""
        if math.prod(self.sizes) == 1:
            return "1 device"
        return " x ".join(f"{self.names[a]} {self.sizes[a]}" for a in self.shown)


def axis_view(plan: Plan) -> AxisView:
    roles = axis_roles(plan)
    sizes = plan.mesh.shape
    counts: dict[str, int] = {}
    for a, r in enumerate(roles):
        if r and GENERIC_NAME.fullmatch(plan.mesh.axis_names[a]):
            counts[r] = counts.get(r, 0) + 1
    seen: dict[str, int] = {}
    names = []
    for a, (stored, r) in enumerate(zip(plan.mesh.axis_names, roles)):
        if not r or not GENERIC_NAME.fullmatch(stored):
            names.append(stored)
        elif counts[r] == 1:
            names.append(r)
        else:
            names.append(f"{r}{seen.setdefault(r, 0)}")
            seen[r] += 1
    if len(set(names)) < len(names):  # a user's name equal to a role name: keep the stored names, which are distinct
        names = list(plan.mesh.axis_names)
    shown = tuple(a for a, n in enumerate(sizes) if n > 1) or tuple(range(len(sizes)))
    return AxisView(tuple(names), roles, shown, sizes)


def axis_roles(plan: Plan) -> tuple[str, ...]:
    """'tp', 'dp' or 'rep' per mesh axis of more than one device, '' for the others (module docstring)."""
    ndim = plan.mesh.ndim
    split = [False] * ndim
    weights = [False] * ndim

    def mark(layout: Placements | None) -> None:
        for a, p in enumerate(layout or ()):
            if isinstance(p, (Shard, Partial)):
                split[a] = True

    # what the ops compute on and the parameters are stored as; an input split on arrival but gathered before its
    # first op saves no work
    for n in plan.nodes:
        for layout in (*n.strategy.inputs, *n.strategy.outputs):
            mark(layout)
    moved: dict[str, list] = {}
    for t in plan.transfers:
        moved.setdefault(t.tensor.split("[", 1)[0], []).append(t)
    for p in plan.params:
        mark(p.layout)
        if p.is_buffer:
            continue
        uses = moved.get(p.node, [])
        for a, q in enumerate(p.layout):
            # stored in shards but gathered on this axis before every use (ZeRO / FSDP): not tensor parallelism
            if isinstance(q, Shard) and not (uses and all(isinstance(t.dst[a], Replicate) for t in uses)):
                weights[a] = True
    return tuple("" if size == 1 else "tp" if weights[a] else "dp" if split[a] else "rep" for a, size in enumerate(plan.mesh.shape))


def devices_split(plan: Plan, view: AxisView | None = None) -> str:
    """`4 devices = dp 2 x tp 2`, or with a pipeline `64 devices = 8 pipeline stages x (dp 2 x tp 4)`."""
    view = view or axis_view(plan)
    if plan.pipeline is None:
        return f"{plan.devices} device{'s' if plan.devices > 1 else ''}" + ("" if plan.devices == 1 else f" = {view.grid}")
    return f"{plan.devices} devices = {plan.pipeline.degree} pipeline stages x ({view.grid})"


def step_batch(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each input as the user passes it for one step: a pipelined plan's inputs are one microbatch's
    (the runtime splits the batch along dim 0 into `microbatches`)."""
    m = plan.pipeline.microbatches if plan.pipeline else 1
    return [(i.name, (i.shape[0] * m, *i.shape[1:]) if i.shape else i.shape) for i in plan.inputs]


def wasted(plan: Plan, view: AxisView | None = None) -> list[str]:
    """A sentence when mesh axes split nothing: what repeats, why (a batch that does not divide them), and the device
    counts the batch would split over; empty when every axis splits something."""
    view = view or axis_view(plan)
    idle = [a for a, role in enumerate(view.roles) if role == "rep"]
    if not idle:
        return []
    size = math.prod(view.sizes[a] for a in idle)
    named = ", ".join(view.names[a] + ("" if plan.mesh.axis_names[a] == view.names[a] else f" (stored as {plan.mesh.axis_names[a]})")
                      for a in idle)
    one = len(idle) == 1
    it, its = ("it", "its") if one else ("them", "their")
    line = f"mesh axis {named} splits nothing" if one else f"mesh axes {named} split nothing"
    line += f": {its} {size} devices compute the same"
    if {a for b in plan.buckets for a in b.axes} & set(idle):
        line += f" and the gradient all-reduce over {it} sums identical copies"
    batch = [shape[0] for _, shape in step_batch(plan) if shape]
    if any(b % size for b in batch):
        whole = math.gcd(*batch)
        fits = [k for k in range(2, min(whole, SUGGESTED * size) + 1) if whole % k == 0]
        per = " per pipeline stage" if plan.pipeline else ""
        line += f": the batch of {whole} does not split over {size}" + (
            f"; it splits evenly over {_either(fits)} devices{per}" if fits else "") + f", or use a batch that is a multiple of {size}"
    else:
        line += (f": splitting over {it} was priced slower than repeating the work, so "
                 f"{plan.devices // size} device{'s' if plan.devices // size > 1 else ''} would do as well")
    return [line]


def _either(xs: list[int]) -> str:
    return str(xs[0]) if len(xs) == 1 else f"{', '.join(map(str, xs[:-1]))} or {xs[-1]}"


def warn_wasted(plan: Plan) -> None:
    """Warn (`ReplicatedWorkWarning`) for each mesh axis of `plan` that splits nothing; `meshplan.plan` calls it."""
    for line in wasted(plan):
        warnings.warn(line, ReplicatedWorkWarning, stacklevel=3)
