"""Candidate strategies for every node: DTensor's registered op rules, meshplan's own, or a named fallback.

DTensor's rules are queried without devices (a DeviceMesh with no process group, TensorMeta for
tensors). DTensor's masked partials (vocabulary-parallel lookups) become kernel strategies
(`planner/masked.py`); layouts meshplan does not execute (strided shards, max/min partials) and
uneven shards are filtered out, so every candidate is one the runtime runs as a local op; the
uneven ones are kept in `Candidates.rejected` with the reason, so a plan can explain them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._dtensor_spec import TensorMeta as DTMeta
from torch.distributed.tensor._ops import utils as dt_utils
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

from meshplan.ir.graph import Graph, Node, TensorMeta
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Partial, Placements, Replicate, Shard, executable, is_even
from meshplan.ir.regions import region_op
from meshplan.planner.masked import from_mask_partial, is_mask_partial
from meshplan.planner.rules import RULES
from meshplan.planner.rules.nested_view import VIEW_OPS, nested_view_layouts
from meshplan.plans.strategy import Strategy
from meshplan.progress import timed

log = logging.getLogger(__name__)

LEAF_KINDS = ("input", "param", "buffer", "constant")


class UnsupportedOpWarning(UserWarning):
    """An op had no sharding rule and runs replicated."""


@dataclass(slots=True)
class Candidates:
    """The strategies each node may take, and the ops that fell back to replication."""

    by_node: dict[str, list[Strategy]]
    fallbacks: list[str] = field(default_factory=list)
    """'op at module.path' for every op planned replicated for lack of a rule."""
    rejected: dict[str, list[tuple[Strategy, str]]] = field(default_factory=dict)
    """Per node, strategies dropped because a tensor does not split evenly, with the reason."""


@timed("candidates")
def generate(graph: Graph, mesh: MeshSpec, *, inputs: str = "global", strict: bool = False, loss_only: bool = False) -> Candidates:
    """Candidate strategies for every node of `graph` on `mesh` (`loss_only`: see `PlanOptions.loss_only`)."""
    if mesh.size == 1:  # one device: every layout is the whole tensor, so one strategy per node says it all
        leaf = Strategy((), ((Replicate(),) * mesh.ndim,), "leaf")
        return Candidates({n.name: [leaf if n.kind in LEAF_KINDS else _replicated(n, graph, mesh, "dtensor")] for n in graph.nodes})
    fx_nodes = {n.name: n for n in graph.fx.gm.graph.nodes} if graph.fx is not None else {}
    dmesh = _device_mesh(mesh.shape)
    by_node: dict[str, list[Strategy]] = {}
    fallbacks: list[str] = []
    rejected: dict[str, list[tuple[Strategy, str]]] = {}
    for node in graph.nodes:
        if node.kind in LEAF_KINDS:
            by_node[node.name] = _leaf_strategies(node, mesh)
            rejected[node.name] = _leaf_rejected(node, mesh)
        elif node.kind == "output":
            by_node[node.name] = _output_strategies(graph, node, mesh, inputs, loss_only)
        else:
            found, rejected[node.name], error = _op_strategies(graph, node, fx_nodes[node.name], mesh, dmesh)
            if not found:
                where = f"{node.target} ({node.name}) at {node.module_path or '<top>'}"
                # a rule that raised is a bug (ours, or a torch upgrade's), not an op without a rule: say which
                why = f"DTensor's sharding rule for {where} raised {error}" if error else f"no sharding rule for {where}"
                if strict:
                    raise ValueError(
                        f"{why}; strict=True forbids the replicate fallback. "
                        "Register one with meshplan.planner.rules.register_rule or pass strict=False."
                    )
                warnings.warn(f"{why}: it runs replicated on every device", UnsupportedOpWarning, stacklevel=2)
                fallbacks.append(where)
                found = [_replicated(node, graph, mesh, "fallback")]
            by_node[node.name] = found
    return Candidates(by_node, fallbacks, rejected)


def _replicated(node: Node, graph: Graph, mesh: MeshSpec, source: str) -> Strategy:
    rep = (Replicate(),) * mesh.ndim
    return Strategy(tuple(rep for _ in node.inputs), tuple(rep if m is not None else None for m in node.outputs), source)


def layouts(meta: TensorMeta, mesh: MeshSpec, *, partial: bool = False) -> list[Placements]:
    """Every even layout of a tensor on the mesh: R or S(d) per axis (and P when asked)."""
    options: list = [Replicate()] + [Shard(d) for d in range(len(meta.shape))]
    if partial:
        options.append(Partial())
    return [p for p in itertools.product(options, repeat=mesh.ndim) if is_even(meta.shape, p, mesh.shape)]


def _leaf_strategies(node: Node, mesh: MeshSpec) -> list[Strategy]:
    meta = node.outputs[0]
    if node.kind == "constant" or meta is None:
        return [Strategy((), ((Replicate(),) * mesh.ndim,), "leaf")]
    return list(_leaf_layouts(meta, mesh)[0])


def _leaf_rejected(node: Node, mesh: MeshSpec) -> list[tuple[Strategy, str]]:
    meta = node.outputs[0]
    if node.kind == "constant" or meta is None:
        return []
    return list(_leaf_layouts(meta, mesh)[1])


@functools.lru_cache(maxsize=1 << 12)
def _leaf_layouts(meta: TensorMeta, mesh: MeshSpec) -> tuple[tuple[Strategy, ...], tuple[tuple[Strategy, str], ...]]:
    """A leaf's even strategies and its uneven ones with their reason. One tuple of objects per shape and mesh: the
    parameters of repeated layers share it, as their ops share `_CACHE`'s, so that what is keyed on candidate
    objects (`constraints.prefer`) and compared list to list (`tying`) sees equal lists at once."""
    options: list = [Replicate()] + [Shard(d) for d in range(len(meta.shape))]
    even, uneven = [], []
    for p in itertools.product(options, repeat=mesh.ndim):
        if is_even(meta.shape, p, mesh.shape):
            even.append(Strategy((), (p,), "leaf"))
        else:
            uneven.append((Strategy((), (p,), "leaf"), uneven_reason(meta.shape, p, mesh.shape, "output")))
    return tuple(even), tuple(uneven)


def uneven_reason(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...], what: str) -> str:
    """Why `placements` is not an even layout of a tensor of `shape` (for explanations)."""
    for d, size in enumerate(shape):
        n = 1
        for p, m in zip(placements, mesh_shape):
            n *= m if p == Shard(d) else 1
        if size % n:
            return f"divisibility: {what} dim {d} of size {size} does not split evenly over {n} devices"
    return f"divisibility: {what} {list(shape)} has no dim for {''.join(map(str, placements))}"


def _output_strategies(graph: Graph, node: Node, mesh: MeshSpec, inputs: str, loss_only: bool) -> list[Strategy]:
    rep = (Replicate(),) * mesh.ndim
    losses = graph.loss_outputs() if loss_only and inputs == "global" else frozenset()
    if inputs == "global" and not losses:
        # the user gets whole tensors back on every rank
        return [Strategy(tuple(rep for _ in node.inputs), (), "leaf")]
    # the loss stays whole; every other output is handed out in the layout it has (inputs="local": the rank's block)
    per_output = [[rep] if r in losses else layouts(graph.meta(r), mesh) for r in node.inputs]
    return [Strategy(tuple(c), (), "leaf") for c in itertools.product(*per_output)]


# ---------------------------------------------------------------- op rules


@functools.lru_cache(maxsize=8)
def _device_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    # DTensor's rules only read the mesh shape: no process group is needed to plan.
    return DeviceMesh("cpu", torch.arange(int(torch.tensor(shape).prod())).view(shape), _init_backend=False, _rank=0)


def _op_strategies(
    graph: Graph, node: Node, fxn: fx.Node, mesh: MeshSpec, dmesh: DeviceMesh
) -> tuple[list[Strategy], list[tuple[Strategy, str]], str]:
    """The node's even strategies, the uneven ones with their reason, and the error of a rule that raised ("" if none)."""
    if not node.inputs:  # factory ops (arange, zeros, ...) are computed whole on every device
        return [_replicated(node, graph, mesh, "meshplan")], [], ""
    # repeated layers ask the same question many times: key on op, shapes and static args
    static = fx.node.map_arg((fxn.args, fxn.kwargs), lambda n: TensorMeta.of(n.meta["val"]))
    key = (node.target, node.outputs, repr(static), mesh.shape, mesh.axis_names)
    if key not in _CACHE:
        args_and_kwargs = fx.node.map_arg((fxn.args, fxn.kwargs), lambda n: n.meta["val"])
        rejected: list[tuple[Strategy, str]] = []
        errors: list[str] = []
        found = _compute_op_strategies(fxn.target, args_and_kwargs, node, mesh, dmesh, rejected, errors)
        if str(fxn.target) in VIEW_OPS and found:
            found += _nested_views(node, args_and_kwargs[0][0], mesh, set(found))
        _CACHE[key] = (found, rejected, errors[0] if errors else "")
    kept, rejected, error = _CACHE[key]
    return list(kept), list(rejected), error


_CACHE: dict[tuple, tuple[list[Strategy], list[tuple[Strategy, str]], str]] = {}


def clear_strategy_cache() -> None:
    """Forget the cached strategies: for a region op whose offer changed (regions/context_parallel.py `force_context_parallel`)."""
    _CACHE.clear()


def _compute_op_strategies(op, args_and_kwargs, node: Node, mesh: MeshSpec, dmesh: DeviceMesh, rejected: list,
                           errors: list[str]) -> list[Strategy]:
    """`errors` gets the exception of a DTensor rule that raised on every layout asked."""
    args, kwargs = args_and_kwargs
    in_metas = [TensorMeta.of(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    rows: list | None = None
    source = "dtensor"
    prop = DTensor._op_dispatcher.sharding_propagator
    region = region_op(op)
    own = RULES[str(op)](args, kwargs) if str(op) in RULES else region.rule(args, kwargs) if region is not None else None
    if own is not None:
        rows, source = own, "meshplan"
    elif op in prop.op_single_dim_strategy_funcs:
        meta = torch.utils._pytree.tree_map(lambda x: _dt_meta(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        try:
            rows = prop.op_single_dim_strategy_funcs[op].func(op, tuple(meta[0]), meta[1])
        except Exception as e:  # noqa: BLE001 - any exception of torch's rule: reported by `generate`, with strict an error
            errors.append(f"{type(e).__name__}: {e}")
            return []
    if rows is not None:
        expanded = _expand_rows(rows, node, in_metas, mesh, source, rejected)
        if region is None or source != "meshplan":
            return expanded
        kept = []
        for s in filter(region.keep, expanded):
            why = region.why_not(s, args, kwargs, mesh)
            if why is None:
                kept.append(s)
            elif why:
                rejected.append((s, why))
        return kept
    if op in prop.op_strategy_funcs:
        return _from_op_strategy(prop.op_strategy_funcs[op], op, args, kwargs, node, in_metas, mesh, dmesh, rejected, errors)
    return []


def _nested_views(node: Node, src: torch.Tensor, mesh: MeshSpec, seen: set[Strategy]) -> list[Strategy]:
    """A view's layouts that DTensor's per-axis rule lacks: a group of dims split over several axes, flattened or split
    with each rank's block unmoved (`rules/nested_view.py`). The uneven ones are not kept as rejected: DTensor's
    per-axis layouts of the same dims already say why."""
    out: list[Strategy] = []
    metas = [TensorMeta.of(src)]
    for ins, outs in nested_view_layouts(tuple(src.shape), node.outputs[0].shape, mesh.shape):
        _keep_even(Strategy((ins,), (outs,), "meshplan"), node, metas, mesh, out, [], seen)
    return out


def _dt_meta(t: torch.Tensor) -> DTMeta:
    return DTMeta(t.shape, t.stride(), t.dtype)


def _expand_rows(rows: list, node: Node, in_metas: list[TensorMeta], mesh: MeshSpec, source: str, rejected: list) -> list[Strategy]:
    """Single-axis rows (with DTensor's shard placeholders) -> full-mesh strategies."""
    n_out, n_in = len(node.outputs), len(in_metas)
    axis_rows: list[list] = [[Replicate() if m is not None else None for m in node.outputs] + [Replicate()] * n_in]
    kernels: list[str] = [""]
    for row in rows:
        if len(row) != n_out + n_in:
            return []
        kernel = getattr(row, "kernel", "") or ("masked" if any(is_mask_partial(p) for p in row) else "")
        conv = []
        for i, p in enumerate(row):
            if p is None:
                conv.append(None)
            elif isinstance(p, _ShardingPlaceholder):
                conv.append(Shard(p.dim))
            else:
                conv.append(_as_run(p, is_input=i >= n_out) or "skip")
        if "skip" in conv or any(isinstance(p, Partial) and p.reduce_op == "avg" for p in conv[n_out:]):
            continue
        if (conv, kernel) not in zip(axis_rows, kernels):  # one layout may run as several kernels
            axis_rows.append(conv)
            kernels.append(kernel)
    out: list[Strategy] = []
    seen: set[Strategy] = set()
    for combo in itertools.product(range(len(axis_rows)), repeat=mesh.ndim):
        per_tensor = list(zip(*(axis_rows[r] for r in combo)))  # tensor -> placements over axes
        outs = tuple(None if node.outputs[i] is None else tuple(per_tensor[i]) for i in range(n_out))
        ins = tuple(tuple(per_tensor[n_out + j]) for j in range(n_in))
        used = {kernels[r] for r in combo} - {""}
        if len(used) > 1:  # two different kernels on two axes: not a program the runtime has
            continue
        _keep_even(Strategy(ins, outs, source, used.pop() if used else ""), node, in_metas, mesh, out, rejected, seen)
    return out


def _from_op_strategy(
    fn, op, args, kwargs, node: Node, in_metas: list[TensorMeta], mesh: MeshSpec, dmesh: DeviceMesh, rejected: list, errors: list[str]
) -> list[Strategy]:
    def as_strategy(t):
        meta = TensorMeta.of(t)
        specs = [OpSpec(DTensorSpec(dmesh, ps, _dt_meta(t))) for ps in layouts(meta, mesh, partial=True)]
        return OpStrategy(specs)

    def convert(x):
        if isinstance(x, torch.Tensor):
            return as_strategy(x)
        if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
            return TupleStrategy(tuple(as_strategy(t) for t in x))
        return x

    schema = OpSchema(op, tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()})
    specs: list[OpSpec] = []
    with _without_dtensor_costs():
        try:
            specs = list(fn(schema).strategies)
        except Exception as e:  # noqa: BLE001 - some rules reject a layout of the first input outright
            log.debug("DTensor rule for %s failed on all layouts at once (%s); asking one layout at a time", op, e)
            first = schema.args_schema[0]
            answered = False
            for spec in first.strategies if isinstance(first, OpStrategy) else []:
                one = OpSchema(op, (OpStrategy([spec]),) + tuple(schema.args_schema[1:]), schema.kwargs_schema)
                try:
                    specs += list(fn(one).strategies)
                    answered = True
                except Exception:  # noqa: BLE001 - that layout is rejected; the rule works if another one answers
                    continue
            if not answered:  # no layout at all: the rule itself fails
                errors.append(f"{type(e).__name__}: {e}")
    out: list[Strategy] = []
    seen: set[Strategy] = set()
    for spec in specs:
        outs_dt = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        ins_dt = spec.input_specs if spec.input_specs is not None else [spec.output_specs] * len(node.inputs)
        if len(ins_dt) != len(node.inputs):
            continue
        conv_in = [_conv(s.placements, is_input=True) for s in ins_dt]
        conv_out = [None if s is None else _conv(s.placements) for s in outs_dt]
        if len(conv_out) == 1 and len(node.outputs) > 1:
            conv_out = conv_out * len(node.outputs)
        if any(p is False for p in conv_in + conv_out) or len(conv_out) != len(node.outputs):
            continue
        masked = any(is_mask_partial(p) for s in list(ins_dt) + list(outs_dt) if s is not None for p in s.placements)
        s = Strategy(tuple(conv_in), tuple(None if m is None else c for m, c in zip(node.outputs, conv_out)), "dtensor",
                     "masked" if masked else "")
        _keep_even(s, node, in_metas, mesh, out, rejected, seen)
    return out


_COST_SWAP = threading.RLock()  # re-entrant: a nested swap restores its own original


def _zero_cost(*_) -> float:
    return 0.0


@contextlib.contextmanager
def _without_dtensor_costs():
    """DTensor's strategy functions price every input redistribution with their own model; meshplan
    prices edges itself, and those calls were ~40% of candidate generation. Swap them for zeros.

    The swap is process-wide: one planning thread at a time holds it (a second would otherwise
    restore the zeros as the original), and a torch that no longer has the function plans with its
    costs, slower but the same. A DTensor op another thread dispatches meanwhile sees zero
    redistribution costs (its strategy choice, not its numbers, may differ)."""
    with _COST_SWAP:  # read the original under the lock: another thread may hold the zeros in its place
        original = getattr(dt_utils, "redistribute_cost", None)
        if original is None:
            yield
            return
        dt_utils.redistribute_cost = _zero_cost
        try:
            yield
        finally:
            dt_utils.redistribute_cost = original


def _as_run(p, *, is_input: bool):
    """A DTensor placement as meshplan runs it: a masked partial as its kernel's layout (planner/masked.py), a kind
    meshplan does not execute as None."""
    return from_mask_partial(p, is_input=is_input) if is_mask_partial(p) else executable(p)


def _conv(placements, *, is_input: bool = False) -> Placements | bool:
    conv = tuple(_as_run(p, is_input=is_input) for p in placements)
    return False if any(p is None for p in conv) else conv


def _keep_even(s: Strategy, node: Node, in_metas: list[TensorMeta], mesh: MeshSpec, out: list, rejected: list,
               seen: set[Strategy]) -> None:
    """Append `s` to `out` when every input and output layout is even, else to `rejected` with the reason.
    `seen`: the strategies in `out`, to skip a repeat without comparing it with each of them (ops with hundreds of
    strategies made that quadratic)."""
    if s in seen:
        return
    pairs = [(p, m, f"output {i}") for i, (p, m) in enumerate(zip(s.outputs, node.outputs))]
    pairs += [(p, m, f"input {i}") for i, (p, m) in enumerate(zip(s.inputs, in_metas))]
    for p, m, what in pairs:
        if p is not None and m is not None and not is_even(m.shape, p, mesh.shape):
            rejected.append((s, uneven_reason(m.shape, p, mesh.shape, what)))
            return
    out.append(s)
    seen.add(s)
