"""Per-layer costs read off an intra-op plan: what a pipeline stage made of those layers costs.

The pipeline search cuts the model between units: everything before the first repeated layer
("pre": embeddings), each repeated layer (`layers.k`), everything after the last ("post": final
norm, head). The intra-op solver plans the whole graph once on a stage's sub-mesh at one
microbatch size; this module splits that plan's predicted time and memory by unit, so a stage's
cost is a sum over its units and a 128-layer model needs no more solves than a 2-layer one
(repeated layers are tied in the solve and cost the same).

`repeat_layers` stretches a profile read off the model traced with its stack of identical blocks cut to a few
(`ir/repeat.py`) to the whole stack; `stretched_stage_memory` does the same for the stages' walked peaks: a stage of k
blocks walks the cut model with k of them when it has that many, else with the cut model's n and n - 1 and adds k - n
times the difference. A stage's walk is affine in its number of blocks once it holds two or more (each block adds the
same parameters, state and saved tensors, and the peak stays where it was; tests/test_pipeline_search.py compares
the stretched peaks with the whole model's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cost_model.estimate import local_bytes
from meshplan.cost_model.memory import MemoryBreakdown, optimizer_state_bytes
from meshplan.cost_model.peak import predict_peak
from meshplan.cost_model.pipeline_memory import StageWalk, stage_nodes, stage_walk, under_schedule
from meshplan.ir.graph import Graph
from meshplan.ir.op_kinds import is_random
from meshplan.ir.placement import Replicate
from meshplan.ir.units import POST, PRE, unit_names, unit_of_nodes
from meshplan.planner.problem import node_memory
from meshplan.planner.recompute import with_stage_recompute
from meshplan.plans.pipeline import PipelinePlan, PipelineStage
from meshplan.plans.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """The smallest piece a stage is built of, on one device of a stage's sub-mesh."""

    name: str
    """`pre`, `layers.k` or `post`."""
    modules: tuple[str, ...]
    """Top-level module paths (or the layer) whose ops it holds, in graph order."""
    time_s: float
    """Forward + backward seconds per microbatch: compute and the collectives inside the unit."""
    forward_s: float
    """Forward compute seconds per microbatch (what recomputation adds)."""
    sync_s: float
    """Seconds per step (not per microbatch) for the parameters it owns: gradient all-reduce and
    the optimizer step."""
    static_bytes: int
    """Parameters, gradients, their buckets (`bucket_bytes`) and optimizer state."""
    param_bytes: int
    """Parameters and buffers alone."""
    grad_bytes: int
    """Gradient bytes of its trainable parameters (what a data-parallel all-reduce moves)."""
    act_bytes: int
    """Activations saved for backward per microbatch, by the liveness walk (`PeakMemory.saved_by`)."""
    out_bytes: int
    """Bytes per device of the activation it hands the next unit (what a stage cut sends)."""
    in_bytes: int
    """Bytes per device of the activation it receives (what recomputation keeps)."""
    shared: dict[str, tuple[int, int, int]]
    """Parameter node -> (static bytes, gradient bytes, bucket bytes), for parameters other units use too (tied
    embeddings): a stage holding several such units counts them once."""
    whole_s: float = 0.0
    """Seconds per microbatch of the ops every device runs on the whole tensor (random draws, the factory ops they fill
    and in-place ops on those: ir/op_kinds.py), forward only. A stage with d data-parallel ranks runs them on the
    d microbatches of all its ranks (`at_data_parallel`)."""
    whole_act_bytes: int = 0
    """Activation bytes of those ops saved for backward per microbatch (a dropout mask)."""
    transient_bytes: int = 0
    """Bytes its microbatch holds at its own peak beyond what it saved (the gradients its backward makes, a kernel's
    scratch), by the walk of its ops alone."""
    bucket_bytes: int = 0
    """Bytes of the gradient buckets the data-parallel all-reduce runs from, held all step (`at_data_parallel`)."""
    copy_grad_bytes: int = 0
    """Bytes of its weights' working-copy gradients (mixed precision), held at the end of each microbatch's backward
    (`PeakMemory.casting_back`)."""
    cast_accumulate_bytes: int = 0
    """The fp32 gradient of its largest weight with a working copy, made before it is summed into the parameter's
    (`PeakMemory.cast_accumulate_bytes`)."""

    def __hash__(self) -> int:
        return hash(self.name)


def profile_units(graph: Graph, plan: Plan, optimizer: str = "adam") -> list[Unit]:
    """Split `plan` (made for `graph` at one microbatch) into units, in pipeline order."""
    shape = plan.mesh.shape
    unit = unit_of_nodes(graph)
    consumers = graph.consumers()
    names = unit_names(graph)
    acc = {u: dict(time=0.0, fwd=0.0, sync=0.0, static=0, param=0, grad=0, act=0, out=0, inb=0, shared={}, modules=[], whole=0.0,
                   whole_act=0, transient=0, copy_grads=0, cast_accumulate=0) for u in names}
    strategy = {n.name: n.strategy for n in plan.nodes}
    whole = drawn_whole(graph)
    for n in plan.nodes:
        a = acc[unit[n.name]]
        a["time"] += n.time_s
        a["fwd"] += n.time_s / 3.0 if any(graph[n.name].requires_grad) else n.time_s
        mem = node_memory(graph[n.name], n.strategy, shape, optimizer, weight_cast=n.name in graph.weight_casts)
        if n.name in whole:
            a["whole"] += n.time_s
        a["static"] += mem.params  # a weight's working copy (mixed precision): once per step, not per microbatch
        a["param"] += mem.params
        top = n.module_path.split(".", 1)[0] if unit[n.name] in (PRE, POST) else unit[n.name]
        if top and top not in a["modules"]:
            a["modules"].append(top)
    for t in plan.transfers:
        acc[unit.get(t.consumer, POST)]["time"] += t.time_s
    # what a microbatch leaves saved for backward, by the liveness walk (what a stage's walk holds per microbatch in
    # flight): each op's saved outputs, the resharded copies it saved and what its kernel keeps, in the op's unit; and
    # each unit's own peak beyond that, by the walk of its ops alone
    for op, nbytes in predict_peak(graph, plan, optimizer=optimizer).saved_by.items():
        a = acc[unit.get(op, POST)]
        a["act"] += nbytes
        if op in whole:
            a["whole_act"] += nbytes
    ops_of: dict[str, set[str]] = {}
    for n, u in unit.items():
        if graph[n].kind == "op":
            ops_of.setdefault(u, set()).add(n)
    for u in names:
        walk = predict_peak(graph, plan, optimizer=optimizer, nodes=ops_of.get(u, set()))
        acc[u]["transient"] = max(0, walk.microbatch.activations - sum(walk.saved_by.values()))
        if walk.casting_back is not None:
            acc[u]["copy_grads"] = walk.casting_back.grads - walk.step.grads  # beyond every parameter gradient
            acc[u]["cast_accumulate"] = walk.cast_accumulate_bytes
    # gradient sync as the plan prices it, in buckets (a bucket's all-reduce latency included), shared among
    # the bucket's parameters by bytes; a parameter's own `time_s` prices it alone, without that latency
    sync = {p.node: p.time_s for p in plan.params}
    sizes = {p.node: local_bytes(graph[p.node].out, p.layout, shape) for p in plan.params}
    for b in plan.buckets:
        for name in b.params:
            sync[name] = b.time_s * sizes[name] / b.nbytes if b.nbytes else b.time_s / len(b.params)
    for p in plan.params:
        node = graph[p.node]
        nbytes = sizes[p.node]
        static, grad = nbytes, 0
        if not p.is_buffer and node.grad(0):
            grad = nbytes
            static += nbytes + optimizer_state_bytes(nbytes // node.out.itemsize, optimizer)
        users = list(dict.fromkeys(unit[c] for c, _ in consumers[p.node] if c in unit))
        for u in users or [PRE]:
            acc[u]["static"] += static
            acc[u]["grad"] += grad
            acc[u]["param"] += nbytes
            acc[u]["sync"] += sync[p.node] + p.optimizer_s
            acc[u]["time"] += p.view_s  # read as a DTensor by every microbatch's forward + backward of the stage using it
            if len(users) > 1:
                acc[u]["shared"][p.node] = (static, grad, 0)
    # the activation crossing from one unit to the next: outputs consumed in a later unit
    pos = {u: i for i, u in enumerate(names)}
    for n in graph.nodes:
        if n.name not in unit or n.kind == "output":
            continue
        for j, meta in enumerate(n.outputs):
            if meta is None:
                continue
            later = {unit[c] for c, _ in consumers[n.name] if c in unit and pos[unit[c]] > pos[unit[n.name]] and graph[c].kind != "output"}
            if not later:
                continue
            layout = strategy[n.name].outputs[j] if n.name in strategy else tuple(Replicate() for _ in shape)
            nbytes = local_bytes(meta, layout, shape)
            acc[unit[n.name]]["out"] += nbytes
            for u in later:
                acc[u]["inb"] += nbytes
    return [
        Unit(name=u, modules=tuple(a["modules"]), time_s=a["time"], forward_s=a["fwd"], sync_s=a["sync"], static_bytes=a["static"], param_bytes=a["param"], grad_bytes=a["grad"],
             act_bytes=a["act"], out_bytes=a["out"], in_bytes=a["inb"], shared=a["shared"], whole_s=a["whole"], whole_act_bytes=a["whole_act"],
             transient_bytes=a["transient"], copy_grad_bytes=a["copy_grads"], cast_accumulate_bytes=a["cast_accumulate"])
        for u, a in acc.items()
    ]


def drawn_whole(graph: Graph) -> set[str]:
    """The ops every device runs on the whole tensor whatever the mesh: random draws (drawn whole so every rank has the
    single-device draw), the factory ops they fill in place, and in-place ops on what those made (dropout's scaling)."""
    ops = [n for n in graph.nodes if n.kind == "op"]
    whole = {n.name for n in ops if is_random(n.target)}
    whole |= {n.inputs[0].node for n in ops if n.name in whole and n.inputs and not graph[n.inputs[0].node].inputs
              and graph[n.inputs[0].node].kind == "op"}  # the empty tensor an in-place draw fills
    for n in ops:
        if n.inputs and n.inputs[0].node in whole and _in_place(n.target):
            whole.add(n.name)
    return whole


def _in_place(target: str) -> bool:
    """An ATen op that writes its first argument ('aten.div_.Scalar')."""
    parts = target.split(".")
    return len(parts) == 3 and parts[0] == "aten" and parts[1].endswith("_")


def at_data_parallel(units: list[Unit], data: int) -> list[Unit]:
    """`units` (one data-parallel rank's microbatch) as a stage sub-mesh with `data` data-parallel ranks runs them: the
    ops drawn whole run on all `data` microbatches, forward and in recomputation, and every trainable parameter's
    gradient has a copy in the buckets its data-parallel all-reduce runs from, held all step (runtime/grad_buckets.py;
    the walk's `resident.grads`)."""
    if data <= 1:
        return units
    return [replace(u, time_s=u.time_s + (data - 1) * u.whole_s, forward_s=u.forward_s + (data - 1) * u.whole_s,
                    act_bytes=u.act_bytes + (data - 1) * u.whole_act_bytes, static_bytes=u.static_bytes + u.grad_bytes,
                    bucket_bytes=u.grad_bytes, shared={k: (st + g, g, g) for k, (st, g, _) in u.shared.items()}) for u in units]


def repeat_layers(units: list[Unit], layers: int) -> list[Unit]:
    """Stretch a profile traced with a few identical layers to `layers` of them (the last traced
    layer stands for every one: the first may carry the embedding's resharding)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1; got {layers!r}")
    pre, *mid, post = units
    if not mid:
        raise ValueError("the traced model has no repeated layers (`layers.k` modules) to repeat")
    like = mid[-1]
    base = like.name.rsplit(".", 1)[0]
    return [pre, *[replace(like, name=f"{base}.{k}", modules=(f"{base}.{k}",)) for k in range(layers)], post]


def stage_static_bytes(units: list[Unit]) -> int:
    """Static bytes of a stage: shared parameters once."""
    return sum(u.static_bytes for u in units) - _double_counted(units)[0]


def _double_counted(units: list[Unit]) -> tuple[int, int, int]:
    """(static, gradient, bucket) bytes of shared parameters counted more than once in `units`."""
    seen: set[str] = set()
    static = grad = bucket = 0
    for u in units:
        for k, (st, g, b) in u.shared.items():
            if k in seen:
                static, grad, bucket = static + st, grad + g, bucket + b
            seen.add(k)
    return static, grad, bucket


def stage_memory(units: list[Unit], activations: float) -> MemoryBreakdown:
    """Params, grads (with their buckets, as the walk counts them), optimizer state of a stage (shared parameters once)
    plus `activations`."""
    dup_static, dup_grad, dup_bucket = _double_counted(units)
    dup_param = dup_grad  # a shared trainable parameter's gradient is as large as the parameter
    params = sum(u.param_bytes for u in units) - dup_param
    grads = sum(u.grad_bytes + u.bucket_bytes for u in units) - dup_grad - dup_bucket
    static = sum(u.static_bytes for u in units) - dup_static
    return MemoryBreakdown(params=params, grads=grads, optimizer=static - params - grads, activations=int(activations))


def stage_grad_bytes(units: list[Unit]) -> int:
    """Gradient bytes of a stage's trainable parameters (shared ones once): what its data-parallel all-reduce moves."""
    return sum(u.grad_bytes for u in units) - _double_counted(units)[1]


def tied_grad_bytes(units: list[Unit]) -> int:
    """Gradient bytes of parameters the first and the last unit share (the tied embedding)."""
    return sum(g for k, (_, g, _) in units[0].shared.items() if k in units[-1].shared)


def stretched_stage_memory(graph: Graph, plan: Plan, pipe: PipelinePlan, *, optimizer: str = "adam") -> tuple[PipelineStage, ...]:
    """The stages of `pipe` (a pipeline of the whole model, whose stages hold any number of the stack's blocks) with
    their peaks (and, where a rank runs several, what each holds idle) from `plan`, the stage plan of `graph`, the model
    cut to a few blocks."""
    pre, *blocks, post = unit_names(graph)
    n = len(blocks)
    walks: dict[tuple[tuple[str, ...], bool], StageWalk] = {}

    def at(stage: PipelineStage, units: tuple[str, ...]) -> tuple[MemoryBreakdown, MemoryBreakdown | None]:
        """The peak of `stage` (its rank, its schedule, its recomputation) were it made of `units` of `graph`."""
        key = (units, stage.recompute)
        if key not in walks:
            # the rest of the cut model in a stage before it and one after it
            order = unit_names(graph)
            first = min(order.index(u) for u in units)
            parts = [tuple(u for u in order if u not in units and order.index(u) < first), units,
                     tuple(u for u in order if u not in units and order.index(u) > first)]
            stages = tuple(replace(stage, index=i, units=part, recompute=stage.recompute and part is units)
                           for i, part in enumerate(p for p in parts if p))
            alone = with_stage_recompute(replace(plan, pipeline=replace(pipe, stages=stages)), graph)
            walks[key] = stage_walk(graph, alone, stage_nodes(graph, alone.pipeline), [s.units for s in stages].index(units),
                                    optimizer=optimizer)
        peak = under_schedule(walks[key], pipe, stage)
        return peak.at_peak, peak.idle

    def stretched(own: MemoryBreakdown, more: MemoryBreakdown, less: MemoryBreakdown, k: int) -> MemoryBreakdown:
        return MemoryBreakdown(**{f: max(0, getattr(own, f) + (k - n) * (getattr(more, f) - getattr(less, f))) for f in own.to_dict()})

    out = []
    for stage in pipe.stages:
        ends = tuple(u for u in (pre, post) if u in stage.units)
        k = len(stage.units) - len(ends)
        run = blocks[:min(k, n)] if pre in ends else blocks[n - min(k, n):]  # next to the end it meets
        own = at(stage, tuple(u for u in (pre, *run, post) if u in ends or u in run))
        if k > n:
            # each further block adds what the last of a run of the cut model's blocks adds (the first may carry `pre`'s moves)
            more, less = at(stage, tuple(blocks[n - 2:])), at(stage, tuple(blocks[n - 1:]))
            own = tuple(None if held is None else stretched(held, longer, shorter, k) for held, longer, shorter in zip(own, more, less))
        out.append(replace(stage, memory=own[0], idle=own[1]))
    return tuple(out)
