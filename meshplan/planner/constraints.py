"""Annotations bound to the traced graph: constraints that narrow the candidate strategies of nodes.

One mechanism for every annotation form and mode. A `Constraint` fixes the layout (some or all
mesh axes) of one tensor *slot*: a leaf's output (a parameter's or input's layout), an op's
input (the layout the op computes with) or an op's output. Constraints on the same slot merge;
two that disagree on an axis are an error naming both. Each node then keeps only the candidate
strategies that satisfy all of its constraints, and the search (ILP or propagation) decides the
rest.

Where annotations land:
- `parameter_plan` / `param_layouts` (FQN globs), `input_layouts`: the leaf nodes.
- `meshplan.shard(module, in_strategy, out_strategy, parameter_plan)`: the tensors entering the
  module (the input slots of the module's ops that read them), the tensors leaving it (the
  output slots of the ops producing them) and its parameters. For an `nn.Linear` a 2-dim x or
  output strategy lands on the matmul (`mm`/`addmm`) itself, as MindSpore's MatMul primitive.
- `parallelize_plan` styles, on the tensor-parallel axis (the axis named "tp", else the
  innermost one), other axes searched: "colwise" (Linear weight and bias Shard(0); Embedding
  weight Shard(1)), "rowwise" (Linear weight Shard(1), bias Replicate), "replicate" (every
  parameter of the module Replicate), "sequence_parallel" (parameters Replicate; every tensor of
  rank >= 2 entering or leaving the module Shard(1), the sequence dim). "context_parallel" is on
  the axis named "cp" instead: every attention op of the module has its query, key and value split
  along the sequence there (Shard(2)), which only the context-parallel kernels compute
  (regions/context_parallel.py; the search picks which).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshplan.ir.graph import Graph, Node, TensorRef
from meshplan.ir.mesh import CP_AXIS, MeshSpec
from meshplan.ir.placement import Placement, Replicate, Shard, fmt, is_even, shard_factor
from meshplan.planner.annotations import (
    AnnotationError,
    MaybePlacements,
    ShardAnnotation,
    linear_placements,
    show,
    show_spec,
    spec_kind,
    to_placements,
)
from meshplan.plans.strategy import Strategy

STYLES = ("colwise", "rowwise", "replicate", "sequence_parallel", "context_parallel")
ATTENTION = "aten.scaled_dot_product_attention.default"
"""How SDPA traces (every attention of meshplan's and Hugging Face's models): the op "context_parallel" splits."""
MATMULS = {"aten.mm.default": 0, "aten.addmm.default": 1}
"""The ops an nn.Linear traces to, and the position of x among their tensor inputs (weight follows)."""
TRANSPOSES = ("aten.permute.default", "aten.t.default", "aten.transpose.int")


@dataclass(frozen=True, slots=True)
class Constraint:
    """The layout one tensor slot must have; None on an axis leaves that axis to the search."""

    node: str
    slot: str
    """'out' (the node's output `index`) or 'in' (the node's tensor input `index`)."""
    index: int
    layout: MaybePlacements
    what: str
    """The tensor, for messages: 'layers.0.mlp.fc1.weight', 'input 0 of layers.0.mlp.fc1 (view_12)'."""
    source: str
    """Who asked, as written: "parallelize_plan['layers.*.mlp.fc1']='colwise'"."""


@dataclass(kw_only=True, slots=True)
class Annotations:
    """Everything the user annotated, before it is bound to a graph."""

    parameter_plan: Mapping[str, Any] = field(default_factory=dict)
    """Parameter/buffer FQN glob -> layout (any annotation form)."""
    parallelize_plan: Mapping[str, Any] = field(default_factory=dict)
    """Module FQN glob -> 'colwise' | 'rowwise' | 'replicate' | 'sequence_parallel' | 'context_parallel' (or the torch
    ParallelStyle)."""
    modules: Mapping[str, ShardAnnotation] = field(default_factory=dict)
    """Module path -> what `meshplan.shard` recorded on it."""

    def __bool__(self) -> bool:
        return bool(self.parameter_plan or self.parallelize_plan or self.modules)


# ---------------------------------------------------------------- the planner's entry point


def constrain(
    graph: Graph,
    mesh: MeshSpec,
    by_node: dict[str, list[Strategy]],
    *,
    mode: str,
    annotations: Annotations,
    param_layouts: Mapping[str, Any],
    input_layouts: Mapping[str, Any],
    preferred: Sequence[Constraint] = (),
    rejected: Mapping[str, list[tuple[Strategy, str]]] | None = None,
) -> list[Constraint]:
    """Narrow `by_node` in place to what the mode and the annotations allow, then to the `preferred` layouts where a
    node's candidates meet them (a node that meets none keeps its candidates); returns the constraints. `rejected`:
    the candidates already dropped, with their reasons (`Candidates.rejected`), which an annotation asking for one
    is told."""
    idx = _Index(graph)
    user = collect(graph, idx, mesh, annotations, param_layouts, input_layouts)
    if mode == "semi_auto" and not user:
        raise ValueError(
            "mode='semi_auto' fixes the user's annotations and searches the rest, but none were given: annotate with "
            "meshplan.shard, parameter_plan, parallelize_plan or input_layouts, or use mode='auto'"
        )
    forced = _data_parallel(graph, mesh) if mode == "data_parallel" else []
    merged = merge(forced + user)
    if mode == "manual":
        _complete_manual(graph, merged, mesh.ndim)
    apply(graph, mesh, by_node, merged, rejected or {})
    prefer(mesh, by_node, merge(list(preferred)))
    return forced + user + list(preferred)


def collect(
    graph: Graph, idx: _Index, mesh: MeshSpec, annotations: Annotations, param_layouts: Mapping, input_layouts: Mapping
) -> list[Constraint]:
    out: list[Constraint] = []
    for label, plan in (("param_layouts", param_layouts), ("parameter_plan", annotations.parameter_plan)):
        for pattern, spec in plan.items():
            if any(c in pattern for c in "*?["):
                hits = [(f, n) for n in idx.leaves for f in n.fqns if fnmatch.fnmatchcase(f, pattern)]
            else:  # a plain FQN names one leaf (the pipeline's stage plans give every parameter so)
                hits = [(pattern, idx.leaf_of[pattern])] if pattern in idx.leaf_of else []
            if not hits:
                raise AnnotationError(f"{label} pattern {pattern!r} matches no parameter or buffer of the model")
            source = f"{label}[{pattern!r}]={show_spec(spec)}"
            for fqn, n in dict((n.name, (f, n)) for f, n in hits).values():
                out.append(_leaf(n, spec, mesh, fqn, source))
    for name, spec in input_layouts.items():
        if name not in graph.input_names:
            raise AnnotationError(f"input_layouts names input {name!r}; the model's inputs are {list(graph.input_names)}")
        out.append(_leaf(graph[name], spec, mesh, f"input {name}", f"input_layouts[{name!r}]={show_spec(spec)}"))
    for pattern, style in annotations.parallelize_plan.items():
        out += _from_style(idx, mesh, pattern, style)
    for path, ann in annotations.modules.items():
        out += _from_shard(idx, mesh, path, ann)
    return out


# ---------------------------------------------------------------- merging and applying


@dataclass(slots=True)
class _Slot:
    layout: list[Placement | None]
    sources: list[str | None]
    what: str


def merge(constraints: list[Constraint]) -> dict[tuple[str, str, int], _Slot]:
    """One layout per slot; a disagreement on any axis names both annotations."""
    merged: dict[tuple[str, str, int], _Slot] = {}
    for c in constraints:
        key = (c.node, c.slot, c.index)
        cur = merged.get(key)
        if cur is None:
            merged[key] = _Slot(list(c.layout), [c.source if p is not None else None for p in c.layout], c.what)
            continue
        for a, p in enumerate(c.layout):
            if p is None:
                continue
            if cur.layout[a] is None:
                cur.layout[a], cur.sources[a] = p, c.source
            elif cur.layout[a] != p:
                raise AnnotationError(
                    f"{c.what}: {cur.sources[a]} (layout {show(tuple(cur.layout))}) conflicts with {c.source} "
                    f"(layout {show(c.layout)}) on mesh axis {a}"
                )
    return merged


def apply(graph: Graph, mesh: MeshSpec, by_node: dict[str, list[Strategy]], merged: dict[tuple[str, str, int], _Slot],
          rejected: Mapping[str, list[tuple[Strategy, str]]]) -> None:
    per_node: dict[str, list[tuple[str, int, _Slot]]] = {}
    for (node, slot, index), s in merged.items():
        per_node.setdefault(node, []).append((slot, index, s))
        _check_even(graph, mesh, node, slot, index, s)
    for name, slots in per_node.items():
        needs = [(slot, i, _needed(s.layout, mesh.shape)) for slot, i, s in slots]
        keep = [st for st in by_node[name] if all(_meets(st, slot, i, need) for slot, i, need in needs)]
        if keep:
            by_node[name] = keep
            continue
        node = graph[name]
        asked = "; ".join(f"{s.what} in {show(tuple(s.layout))} ({_sources(s)})" for _, _, s in slots)
        if node.kind != "op":
            allowed = ", ".join(fmt(st.outputs[0]) for st in by_node[name])
            why = [reason for st, reason in rejected.get(name, [])
                   if all(_meets(st, slot, i, need) for slot, i, need in needs)][:1]
            raise AnnotationError(f"{asked} is not a layout meshplan can run for this tensor on mesh {mesh}"
                                  f"{''.join(f' ({w})' for w in why)}; allowed: {allowed}")
        shown = ", ".join(str(st) for st in by_node[name][:12]) + (" ..." if len(by_node[name]) > 12 else "")
        raise AnnotationError(
            f"no sharding strategy of {node.target} ({name}) at {node.module_path or '<top>'} has {asked}; "
            f"its strategies on mesh {mesh} are: {shown}"
        )


def prefer(mesh: MeshSpec, by_node: dict[str, list[Strategy]], merged: dict[tuple[str, str, int], _Slot]) -> None:
    """Keep each node's candidates that meet all its slots' layouts, unless none does."""
    per_node: dict[str, list[tuple[str, int, _Slot]]] = {}
    for (node, slot, index), s in merged.items():
        per_node.setdefault(node, []).append((slot, index, s))
    # a pipeline stage plan prefers a layout for every op of every layer: the layers' nodes hold the same candidate
    # objects (`strategies._op_strategies`) and are asked the same layouts, so each such question is answered once
    # (Llama-3-70B's whole-model stage plan: 7,655 nodes, 4.5 s of matching before)
    answered: dict[tuple, tuple[list[Strategy], list[int]]] = {}  # the lists are held so that no id is reused
    for name, slots in per_node.items():
        cands = by_node[name]
        needs = tuple((slot, i, _needed(s.layout, mesh.shape)) for slot, i, s in slots)
        key = (tuple(map(id, cands)), needs)
        if key not in answered:
            answered[key] = cands, [k for k, st in enumerate(cands) if all(_meets(st, slot, i, need) for slot, i, need in needs)]
        kept = answered[key][1]
        if kept:
            by_node[name] = [cands[k] for k in kept]


def _needed(layout: list[Placement | None], mesh_shape: tuple[int, ...]) -> tuple[tuple[int, Placement], ...]:
    """(axis, placement) pairs a slot's `layout` fixes; on an axis of one device every placement is the whole tensor."""
    return tuple((a, p) for a, (p, n) in enumerate(zip(layout, mesh_shape)) if p is not None and n != 1)


def _meets(st: Strategy, slot: str, index: int, needed: tuple[tuple[int, Placement], ...]) -> bool:
    """Does `st` give the slot the placements `needed` (its layout's `_needed` pairs)?"""
    have = st.outputs[index] if slot == "out" else st.inputs[index]
    return have is not None and all(p == have[a] for a, p in needed)


def _check_even(graph: Graph, mesh: MeshSpec, node: str, slot: str, index: int, s: _Slot) -> None:
    n = graph[node]
    meta = n.outputs[index] if slot == "out" else graph.meta(n.inputs[index])
    if meta is None:
        raise AssertionError(f"constraint on a non-tensor output {node}[{index}]")
    full = tuple(Replicate() if p is None else p for p in s.layout)
    if is_even(meta.shape, full, mesh.shape):
        return
    bad = next(d for d, size in enumerate(meta.shape) if size % shard_factor(full, mesh.shape, d))
    raise AnnotationError(
        f"layout {show(tuple(s.layout))} for {s.what} of shape {list(meta.shape)} is not an even sharding on mesh {mesh}: "
        f"dim {bad} of size {meta.shape[bad]} would be split {shard_factor(full, mesh.shape, bad)} ways (asked by {_sources(s)})"
    )


def _sources(s: _Slot) -> str:
    return " and ".join(dict.fromkeys(x for x in s.sources if x is not None)) or "a layout left to the search"


def _complete_manual(graph: Graph, merged: dict[tuple[str, str, int], _Slot], ndim: int) -> None:
    """mode='manual': every parameter and input is annotated; axes left open are replicated."""
    missing = [
        " = ".join(n.fqns) if n.kind == "param" else f"input {n.name}"
        for n in graph.nodes
        if n.kind in ("param", "input") and (n.name, "out", 0) not in merged
    ]
    if missing:
        raise AnnotationError(
            f"mode='manual' needs a layout for every parameter and input; missing: {', '.join(missing)}. Give them with "
            "parameter_plan, parallelize_plan, meshplan.shard or input_layouts, or use mode='semi_auto' to search the rest"
        )
    for n in graph.nodes:
        key = (n.name, "out", 0)
        if n.kind == "buffer" and key not in merged:
            merged[key] = _Slot([None] * ndim, [None] * ndim, " = ".join(n.fqns))
        if n.kind in ("param", "input", "buffer"):
            s = merged[key]
            for a, p in enumerate(s.layout):
                if p is None:
                    s.layout[a], s.sources[a] = Replicate(), "mode='manual' (axes left open are replicated)"


def _data_parallel(graph: Graph, mesh: MeshSpec) -> list[Constraint]:
    out = []
    for n in graph.nodes:
        if n.kind in ("param", "buffer"):
            out.append(Constraint(n.name, "out", 0, (Replicate(),) * mesh.ndim, " = ".join(n.fqns), "mode='data_parallel'"))
        elif n.kind == "input" and n.out.shape:
            out.append(Constraint(n.name, "out", 0, (Shard(0),) * mesh.ndim, f"input {n.name}", "mode='data_parallel'"))
    return out


# ---------------------------------------------------------------- the graph, by module


class _Index:
    """Module paths, the ops and parameters under each, and the tensors crossing a module's boundary."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.leaves = [n for n in graph.nodes if n.kind in ("param", "buffer")]
        self.leaf_of = {f: n for n in self.leaves for f in n.fqns}
        self.consumers = graph.consumers()
        paths: set[str] = set()
        for n in graph.nodes:
            for p in ([n.module_path] if n.kind == "op" else [f.rsplit(".", 1)[0] for f in n.fqns if "." in f]):
                parts = p.split(".") if p else []
                paths.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        self.module_paths = sorted(paths)

    def ops_in(self, path: str, *, exact: bool = False) -> list[Node]:
        return [
            n for n in self.graph.nodes
            if n.kind == "op" and (n.module_path == path or (not exact and (not path or n.module_path.startswith(path + "."))))
        ]

    def params_of(self, path: str, *, direct: bool = False) -> dict[str, Node]:
        """Local name (relative to the module) -> parameter/buffer node."""
        out = {}
        prefix = path + "." if path else ""
        for n in self.leaves:
            for f in n.fqns:
                local = f[len(prefix):]
                if f.startswith(prefix) and not (direct and "." in local):
                    out[local] = n
        return out

    def boundary_inputs(self, path: str) -> list[tuple[TensorRef, list[tuple[str, int]]]]:
        """Tensors made outside the module (not its leaves) and read inside: first use order, with every reading slot."""
        inside = {n.name for n in self.ops_in(path)}
        found: dict[TensorRef, list[tuple[str, int]]] = {}
        for n in self.graph.nodes:
            if n.name not in inside:
                continue
            for pos, ref in enumerate(n.inputs):
                if ref.node not in inside and self.graph[ref.node].kind in ("op", "input"):
                    found.setdefault(ref, []).append((n.name, pos))
        return list(found.items())

    def boundary_outputs(self, path: str) -> list[TensorRef]:
        """Tensors made inside the module and read outside it (or returned), in production order."""
        inside = {n.name for n in self.ops_in(path)}
        found: dict[TensorRef, None] = {}
        for n in self.graph.nodes:
            if n.name in inside:
                continue
            for ref in n.inputs:
                if ref.node in inside:
                    found[ref] = None
        order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        return sorted(found, key=lambda r: (order[r.node], r.index))


def _leaf(n: Node, spec, mesh: MeshSpec, what: str, source: str) -> Constraint:
    return Constraint(n.name, "out", 0, to_placements(spec, n.out.shape, mesh, f"{source} for {what}"), what, source)


# ---------------------------------------------------------------- meshplan.shard


def _from_shard(idx: _Index, mesh: MeshSpec, path: str, ann: ShardAnnotation) -> list[Constraint]:
    src = f"meshplan.shard({path or '<root>'})"
    ops = idx.ops_in(path)
    if not ops:
        raise AnnotationError(f"{src}: module {path or '<root>'} runs no op in the traced graph; annotate a module the forward pass uses")
    params = idx.params_of(path)
    out: list[Constraint] = []
    for key, spec in ann.parameter_plan:
        for local, n in params.items():
            if fnmatch.fnmatchcase(local, key):
                fqn = f"{path}.{local}" if path else local
                out.append(_leaf(n, spec, mesh, fqn, f"{src} parameter_plan[{key!r}]={show_spec(spec)}"))
    if ann.in_strategy is not None:
        out += _linear_in(idx, mesh, path, ann.in_strategy, src) if ann.linear else _boundary_in(idx, mesh, path, ann.in_strategy, src)
    if ann.out_strategy is not None:
        out += _linear_out(idx, mesh, path, ann.out_strategy, src) if ann.linear else _boundary_out(idx, mesh, path, ann.out_strategy, src)
    return out


def _boundary_in(idx: _Index, mesh: MeshSpec, path: str, strategy: tuple, src: str) -> list[Constraint]:
    entries = idx.boundary_inputs(path)
    if len(strategy) != len(entries):
        names = ", ".join(f"{ref} {idx.graph.meta(ref)}" for ref, _ in entries)
        raise AnnotationError(
            f"{src}: in_strategy has {len(strategy)} entries but {len(entries)} tensors enter the module ({names or 'none'}, "
            "in order of first use)"
        )
    out = []
    for i, (spec, (ref, slots)) in enumerate(zip(strategy, entries)):
        if spec is not None:
            out += _slots(idx, mesh, ref, slots, spec, f"input {i} of {path} ({ref})", f"{src} in_strategy[{i}]={show_spec(spec)}")
    return out


def _boundary_out(idx: _Index, mesh: MeshSpec, path: str, strategy: tuple, src: str) -> list[Constraint]:
    refs = idx.boundary_outputs(path)
    if len(strategy) != len(refs):
        names = ", ".join(f"{ref} {idx.graph.meta(ref)}" for ref in refs)
        raise AnnotationError(f"{src}: out_strategy has {len(strategy)} entries but {len(refs)} tensors leave the module ({names})")
    out = []
    for i, (spec, ref) in enumerate(zip(strategy, refs)):
        if spec is not None:
            what, source = f"output {i} of {path} ({ref})", f"{src} out_strategy[{i}]={show_spec(spec)}"
            layout = to_placements(spec, idx.graph.meta(ref).shape, mesh, f"{source} for {what}")
            out.append(Constraint(ref.node, "out", ref.index, layout, what, source))
    return out


def _slots(idx: _Index, mesh: MeshSpec, ref: TensorRef, slots, spec, what: str, source: str, layout=None) -> list[Constraint]:
    """Pin every slot reading `ref` (a precomputed `layout` wins over converting `spec`)."""
    if layout is None:
        layout = to_placements(spec, idx.graph.meta(ref).shape, mesh, f"{source} for {what}")
    return [Constraint(node, "in", pos, layout, what, source) for node, pos in slots]


def _matmuls(idx: _Index, path: str, src: str) -> list[Node]:
    found = [n for n in idx.ops_in(path, exact=True) if n.target in MATMULS]
    if not found:
        raise AnnotationError(
            f"{src}: found no mm/addmm op of this Linear in the traced graph; give the strategy with one entry per tensor "
            "entering the module instead"
        )
    return found


def _ndim(spec) -> int | None:
    """Tensor dims a spec describes (None for placements, which describe mesh axes)."""
    kind = spec_kind(spec)
    if kind == "split":
        return len(spec)
    if kind == "layout":
        return len(spec.tensor_map)
    return None


def _linear_in(idx: _Index, mesh: MeshSpec, path: str, strategy: tuple, src: str) -> list[Constraint]:
    if not 1 <= len(strategy) <= 3:
        raise AnnotationError(f"{src}: an nn.Linear takes in_strategy (x,), (x, weight) or (x, weight, bias); got {len(strategy)} entries")
    params = idx.params_of(path, direct=True)
    entries = idx.boundary_inputs(path)
    if len(entries) != 1:
        raise AnnotationError(f"{src}: expected one tensor entering this Linear, found {len(entries)}")
    (x_ref, x_slots), = entries
    x_spec, w_spec, b_spec = (tuple(strategy) + (None, None))[:3]
    if b_spec is not None and "bias" not in params:
        raise AnnotationError(f"{src}: in_strategy gives a bias strategy {b_spec} but the Linear has no bias")
    sources = [f"{src} in_strategy[{i}]={show_spec(s)}" for i, s in enumerate(strategy)]
    layouts: list = [None, None, None]
    kinds = [None if s is None else spec_kind(s) for s in (x_spec, w_spec, b_spec)]
    if kinds[0] == "split" and kinds[1] == "split" and kinds[2] in (None, "split"):
        layouts = list(linear_placements(tuple(x_spec), tuple(w_spec), None if b_spec is None else tuple(b_spec), mesh, src))
    out: list[Constraint] = []
    matmuls = _matmuls(idx, path, src) if x_spec is not None and _ndim(x_spec) == 2 else []
    if x_spec is not None:
        if matmuls:  # MindSpore's MatMul sees x as a matrix: the strategy lands on the matmul's x operand
            for mm in matmuls:
                ref = mm.inputs[MATMULS[mm.target]]
                out += _slots(idx, mesh, ref, [(mm.name, MATMULS[mm.target])], x_spec, f"x of {path} ({mm.name} input)", sources[0], layouts[0])
        else:
            x_ndim = len(idx.graph.meta(x_ref).shape)
            if _ndim(x_spec) not in (None, x_ndim):
                raise AnnotationError(f"{sources[0]}: x has {x_ndim} dims; give 2 (the matmul's matrix) or {x_ndim} (the module input)")
            out += _slots(idx, mesh, x_ref, x_slots, x_spec, f"x of {path} ({x_ref})", sources[0], layouts[0])
    for name, spec, layout, source in (("weight", w_spec, layouts[1], sources[1] if len(sources) > 1 else ""),
                                       ("bias", b_spec, layouts[2], sources[2] if len(sources) > 2 else "")):
        if spec is None:
            continue
        node = params[name]
        fqn = f"{path}.{name}"
        c = Constraint(node.name, "out", 0, layout, fqn, source) if layout else _leaf(node, spec, mesh, fqn, source)
        out.append(c)
        if name == "weight":
            out += _transposed_weight_slots(idx, path, node, c, src)
    return out


def _transposed_weight_slots(idx: _Index, path: str, weight: Node, c: Constraint, src: str) -> list[Constraint]:
    """The matmul computes with weight.T: pin its operand too, so the op runs with the annotated split."""
    out = []
    for mm in _matmuls(idx, path, src):
        pos = MATMULS[mm.target] + 1
        producer = idx.graph[mm.inputs[pos].node]
        if producer.target in TRANSPOSES and producer.inputs and producer.inputs[0].node == weight.name:
            swapped = tuple(Shard(1 - p.dim) if isinstance(p, Shard) else p for p in c.layout)
            out.append(Constraint(mm.name, "in", pos, swapped, f"{c.what}.T ({mm.name} input)", c.source))
    return out


def _linear_out(idx: _Index, mesh: MeshSpec, path: str, strategy: tuple, src: str) -> list[Constraint]:
    if len(strategy) != 1:
        raise AnnotationError(f"{src}: an nn.Linear has one output; out_strategy has {len(strategy)} entries")
    spec = strategy[0]
    if spec is None:
        return []
    source = f"{src} out_strategy[0]={show_spec(spec)}"
    if _ndim(spec) == 2:
        out = []
        for mm in _matmuls(idx, path, src):
            layout = to_placements(spec, mm.out.shape, mesh, f"{source} for the output of {mm.name}")
            out.append(Constraint(mm.name, "out", 0, layout, f"output of {path} ({mm.name})", source))
        return out
    return _boundary_out(idx, mesh, path, strategy, src)


# ---------------------------------------------------------------- name-pattern plans


def tp_axis(mesh: MeshSpec) -> int:
    """The tensor-parallel axis of name-pattern styles: the one named 'tp', else the innermost."""
    return mesh.axis_names.index("tp") if "tp" in mesh.axis_names else mesh.ndim - 1


def style_name(style) -> str:
    """A style string, or torch's ColwiseParallel/RowwiseParallel/SequenceParallel with default arguments."""
    if isinstance(style, str):
        if style not in STYLES:
            raise AnnotationError(f"parallelize_plan style {style!r} is not supported; allowed: {', '.join(STYLES)}")
        return style
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    for cls, name in ((ColwiseParallel, "colwise"), (RowwiseParallel, "rowwise"), (SequenceParallel, "sequence_parallel")):
        if type(style) is cls:
            if vars(style) != vars(cls()):
                raise AnnotationError(
                    f"parallelize_plan: {cls.__name__} with non-default arguments {vars(style)} is not supported; "
                    f"use {cls.__name__}() or {name!r} (meshplan searches the activation layouts)"
                )
            return name
    raise AnnotationError(f"parallelize_plan style {style!r} is not supported; allowed: {', '.join(STYLES)} or torch's ParallelStyle classes")


def _from_style(idx: _Index, mesh: MeshSpec, pattern: str, style) -> list[Constraint]:
    name = style_name(style)
    paths = [p for p in idx.module_paths if fnmatch.fnmatchcase(p, pattern)]
    if not paths:
        sample = ", ".join(idx.module_paths[:8]) + (" ..." if len(idx.module_paths) > 8 else "")
        raise AnnotationError(f"parallelize_plan pattern {pattern!r} matches no module of the model; modules are: {sample}")
    tp = tp_axis(mesh)
    source = f"parallelize_plan[{pattern!r}]={name!r}"
    if name == "context_parallel":
        return [c for path in paths for c in _context_parallel(idx, mesh, path, source)]

    def on_tp(p: Placement) -> MaybePlacements:
        return tuple(p if a == tp else None for a in range(mesh.ndim))

    out: list[Constraint] = []
    for path in paths:
        if name in ("replicate", "sequence_parallel"):
            for local, n in idx.params_of(path).items():
                out.append(Constraint(n.name, "out", 0, on_tp(Replicate()), f"{path}.{local}", source))
            if name == "sequence_parallel":
                for ref, slots in idx.boundary_inputs(path):
                    if len(idx.graph.meta(ref).shape) >= 2:
                        out += [Constraint(c, "in", pos, on_tp(Shard(1)), f"input of {path} ({ref})", source) for c, pos in slots]
                for ref in idx.boundary_outputs(path):
                    if len(idx.graph.meta(ref).shape) >= 2:
                        out.append(Constraint(ref.node, "out", ref.index, on_tp(Shard(1)), f"output of {path} ({ref})", source))
            continue
        params = idx.params_of(path, direct=True)
        weight = params.get("weight")
        if weight is None or len(weight.out.shape) != 2:
            raise AnnotationError(
                f"{source}: module {path} has no 2-D weight (its parameters: {', '.join(params) or 'none'}); "
                f"{name!r} applies to nn.Linear and nn.Embedding modules"
            )
        inside = {n.name for n in idx.ops_in(path)}
        embedding = any(idx.graph[c].target == "aten.embedding.default" for c, _ in idx.consumers[weight.name] if c in inside)
        # an embedding's weight is [vocab, dim]: 'rowwise' splits the vocabulary (masked lookup, partial output;
        # see planner/masked.py), 'colwise' the embedding dim, as torch's styles do on nn.Embedding
        w_dim = (1 if embedding else 0) if name == "colwise" else (0 if embedding else 1)
        out.append(Constraint(weight.name, "out", 0, on_tp(Shard(w_dim)), f"{path}.weight", source))
        bias = params.get("bias")
        if bias is not None:
            out.append(Constraint(bias.name, "out", 0, on_tp(Shard(0) if name == "colwise" else Replicate()), f"{path}.bias", source))
    return out


def _context_parallel(idx: _Index, mesh: MeshSpec, path: str, source: str) -> list[Constraint]:
    """Query, key and value of every attention op under `path` split along the sequence on the `cp` axis."""
    if CP_AXIS not in mesh.axis_names:
        raise AnnotationError(
            f"{source}: attention split along the sequence runs over a mesh axis named {CP_AXIS!r}, and mesh {mesh} has "
            f"axes {', '.join(map(repr, mesh.axis_names))}: name one {CP_AXIS!r} (e.g. axis_names=('dp', 'cp'))"
        )
    ops = [n for n in idx.ops_in(path) if n.target == ATTENTION]
    if not ops:
        raise AnnotationError(f"{source}: module {path or '<top>'} runs no attention (torch's scaled_dot_product_attention)")
    cp = mesh.axis_names.index(CP_AXIS)
    layout = tuple(Shard(2) if a == cp else None for a in range(mesh.ndim))
    return [Constraint(n.name, "in", i, layout, f"{role} of {path or '<top>'} ({n.name})", source)
            for n in ops for i, role in enumerate(("query", "key", "value"))]


__all__ = ["Annotations", "Constraint", "STYLES", "constrain", "style_name", "tp_axis"]
