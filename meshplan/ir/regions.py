"""Region ops: ops meshplan shards, prices and runs itself, each one object in `meshplan/regions/`.

DTensor's rules, the roofline and the plain ATen kernel cover ordinary ops. A region op needs
more, and carries all of it in one place:
- a trace hook, for blocks that cannot be traced op by op: a mixture-of-experts layer routes each
  token to experts chosen at run time, so while the model is traced the matched submodule's
  `forward` is swapped for one that calls a single custom op (the model is never modified
  outside the trace);
- a sharding rule, when DTensor has none or lacks a layout;
- a cost, when the op runs collectives of its own (expert parallelism's all-to-alls, SyncBN's
  statistics, the vocabulary-parallel log-softmax's max/sum all-reduces);
- a per-rank module, when a strategy cannot run as the plain op on local tensors.

Every layer reads the registry here; `meshplan/regions/__init__.py` registers the built-in ops
explicitly and users register their own with `meshplan.register_region_op`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from meshplan.ir.placement import Placement

Row = list[Placement | None]
"""A single-mesh-axis strategy: the placements of the op's outputs, then of its tensor inputs."""


class KernelRow(list):
    """A row the op can only run as the sharded kernel `kernel` (see `Strategy.kernel`)."""

    def __init__(self, placements, kernel: str) -> None:
        super().__init__(placements)
        self.kernel = kernel


class RegionOp:
    """One region op. Subclasses set `name` and `ops` and override what the op needs; the defaults
    are an ordinary op's (DTensor's rule, priced as the plain op, run as the plain op)."""

    name: str = ""
    """Short name for messages, e.g. 'moe'."""
    ops: tuple[object, ...] = ()
    """The ops (OpOverloads) this object handles."""

    # ---- trace hook
    def matches(self, module: nn.Module) -> bool:
        """True for the submodules traced as one call of this op."""
        return False

    def traced_forward(self, module: nn.Module, *args, **kwargs) -> object:
        """The matched module's computation expressed with this op (only called when `matches`)."""
        raise NotImplementedError(f"region op {self.name} matches modules but has no traced_forward")

    # ---- planner
    def rule(self, args: Sequence[object], kwargs: dict) -> list[Row] | None:
        """Single-axis rows for `op(*args, **kwargs)` (tensors as metas), or None for DTensor's rule."""
        return None

    def keep(self, strategy) -> bool:
        """False drops a full-mesh strategy the rows expand to that the per-rank module cannot run."""
        return True

    def why_not(self, strategy, args: Sequence[object], kwargs: dict, mesh) -> str | None:
        """Why a full-mesh `strategy` is not offered on `mesh` (a `MeshSpec`) for `op(*args, **kwargs)`: None offers
        it, a reason rules it out (the plan's `explain` lists it), and "" drops it unlisted (a layout this mesh
        does not have, such as context parallelism on a mesh without a `cp` axis)."""
        return None

    def token_order(self, strategy) -> bool:
        """Whether the kernel of `strategy` runs on blocks in head-tail token order (`Plan.token_order`) rather than
        contiguous ones. A kernel that reads where its block lies (a masked lookup's offset, attention's causal mask)
        runs right in one order only: the planner offers a kernel that splits a tensor over the `cp` axis only in a
        plan of its order (planner/token_order.py)."""
        return False

    def reads_block_positions(self, strategy, args: Sequence[object], axis: int) -> bool:
        """Whether the kernel of `strategy` for `op(*args)` (the traced call's arguments: fx nodes and constants) reads
        where its blocks over mesh axis `axis` lie (a masked lookup's offset into the table, attention's causal mask):
        such a kernel runs right in one token order only. One that computes each index of the split dims on its own,
        or reduces over them, does not (planner/token_order.py). The default assumes it does."""
        return True

    # ---- cost model
    def cost(self, node, in_metas, strategy, mesh_shape: tuple[int, ...], cluster, *, backward: bool):
        """`cost_model.regions.RegionCost` of one device under `strategy` (compute seconds and the op's
        own collectives, which the plan lists and the runtime executes), or None: priced as the plain op."""
        return None

    def timed_work(self, node, in_metas, strategy, mesh_shape: tuple[int, ...]):
        """(profile key, make) when one device's compute under `strategy` is no single op's timing (a context-parallel
        kernel's blocks), else None. `make(device)` returns (run, leaves): `run()` is that compute's forward on fresh
        tensors on `device`, and its backward reaches `leaves`. The profiler times it (`profiling/calibrate.py`), and
        `cost` finds the timing under the key in the cluster's profile."""
        return None

    def kept_bytes(self, node, in_metas, strategy, mesh_shape: tuple[int, ...]) -> int:
        """Bytes one device's kernel keeps from its forward to its backward beyond the inputs and outputs the plain op
        keeps (`cost_model/peak.py`'s `SAVED`): a context-parallel kernel's gathered keys and values."""
        return 0

    def working_bytes(self, node, in_metas, strategy, mesh_shape: tuple[int, ...], cluster, *, backward: bool) -> int:
        """Bytes one device's kernel holds while it runs beyond what the peak walk counts there (`cost_model/peak.py`:
        in forward its inputs, outputs and `kept_bytes`; in backward the gradients of its inputs): buffers in flight,
        partial results, the kernels' own scratch. 0: nothing beyond them."""
        return 0

    def flops(self, node, in_metas) -> float | None:
        """Forward FLOPs on whole tensors where the op's arguments do not tell them, else None."""
        return None

    # ---- runtime
    def local_module(self, strategy, comm, args: Sequence[object]) -> nn.Module | None:
        """The module this rank calls with the node's arguments in place of the op, or None for the
        plain op. `args` holds the node's arguments, tensors as meta/fake values."""
        return None

    def __repr__(self) -> str:
        return f"<region op {self.name}: {', '.join(str(o) for o in self.ops)}>"


REGION_OPS: dict[str, RegionOp] = {}
"""Op name (as graph nodes spell it) -> its region op."""
_BY_NAME: dict[str, RegionOp] = {}


def register_region_op(region: RegionOp) -> RegionOp:
    """Make every layer use `region` for its ops. Its name and its ops must be new."""
    if not isinstance(region, RegionOp):
        raise ValueError(f"register_region_op takes a RegionOp instance; got {type(region).__name__}")
    if not region.name or not region.ops:
        raise ValueError(f"region op {type(region).__name__} needs a name and at least one op; got name={region.name!r}, ops={region.ops!r}")
    taken = [str(op) for op in region.ops if str(op) in REGION_OPS]
    if region.name in _BY_NAME or taken:
        raise ValueError(f"region op {region.name!r} is already registered" if region.name in _BY_NAME
                         else f"region op {region.name!r}: ops {taken} already belong to {REGION_OPS[taken[0]].name!r}")
    _BY_NAME[region.name] = region
    REGION_OPS.update((str(op), region) for op in region.ops)
    return region


def region_op(target: object) -> RegionOp | None:
    """The region op of an op (OpOverload or its name), or None for an ordinary op."""
    return REGION_OPS.get(str(target))


def find_regions(model: nn.Module) -> list[tuple[str, RegionOp]]:
    """(module path, region op) of every submodule some region op's trace hook matches."""
    found = []
    for path, module in model.named_modules():
        for region in _BY_NAME.values():
            if region.matches(module):
                found.append((path, region))
                break
    return found


@contextlib.contextmanager
def regions_patched(model: nn.Module) -> Iterator[list[str]]:
    """Within the block, every matched submodule runs its region forward; yields their paths."""
    patched: list[tuple[nn.Module, bool, object]] = []
    paths = []
    try:
        for path, region in find_regions(model):
            module = model.get_submodule(path)
            had = "forward" in module.__dict__
            patched.append((module, had, module.__dict__.get("forward")))
            module.forward = lambda *a, _m=module, _r=region, **k: _r.traced_forward(_m, *a, **k)
            paths.append(path)
        yield paths
    finally:
        for module, had, old in reversed(patched):
            if had:
                module.forward = old
            else:
                del module.forward
