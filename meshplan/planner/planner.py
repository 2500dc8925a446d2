"""From a traced graph and a mesh to a Plan: candidates, costs, the solve, and the bookkeeping."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from meshplan.cost_model.compute import is_view
from meshplan.cost_model.estimate import compute_time, grad_sync_axes, grad_sync_time, local_bytes, transfer_time
from meshplan.cost_model.memory import MemoryBreakdown, optimizer_state_bytes
from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.redistribution import InfeasibleRedistribution, backward_steps, redistribution_steps
from meshplan.ir.graph import Graph, Node
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Placements, Replicate, Shard, fmt, parse
from meshplan.progress import phase
from meshplan.planner.explain import record_alternatives
from meshplan.planner.plan import InputChoice, NodeChoice, ParamChoice, Plan, SolverInfo, Transfer
from meshplan.planner.solver import Edge, InfeasiblePlan, Problem, solve
from meshplan.planner.strategies import generate
from meshplan.planner.tying import tie_repeated_layers

MODES = ("auto", "data_parallel")
INFEASIBLE_S = 1e9
"""Cost that marks a strategy the solver must not pick (a tied class that cannot feed itself)."""
INPUT_MODES = ("global", "local")


@dataclass(kw_only=True, slots=True)
class PlanOptions:
    mode: str = "auto"
    """'auto' searches everything; 'data_parallel' replicates parameters and shards inputs' dim 0 on every axis."""
    inputs: str = "global"
    """'global': every rank passes the whole batch; 'local': each rank passes its own slice."""
    strict: bool = False
    """Raise instead of replicating ops that have no sharding rule."""
    param_layouts: dict[str, str | Placements] = field(default_factory=dict)
    """Forced parameter layouts by FQN glob, e.g. {'*.fc1.weight': 'RS(0)'}."""
    input_layouts: dict[str, str | Placements] = field(default_factory=dict)
    """Forced user-input layouts by input name."""
    optimizer: str = "adam"
    """Optimizer whose state the memory model counts."""
    time_limit_s: float = 60.0
    tie_layers: bool = True
    """Give corresponding nodes of repeated layers one strategy and solve the block once (exact for that reduced problem)."""


def make_plan(graph: Graph, mesh: MeshSpec, cluster: ClusterPreset, options: PlanOptions, *, model_name: str = "model") -> Plan:
    if options.mode not in MODES:
        raise ValueError(f"mode={options.mode!r} is not supported; allowed: {', '.join(MODES)}")
    if options.inputs not in INPUT_MODES:
        raise ValueError(f"inputs={options.inputs!r} is not supported; allowed: {', '.join(INPUT_MODES)}")
    phase(f"candidate strategies on mesh {mesh}")
    cands = generate(graph, mesh, inputs=options.inputs, strict=options.strict)
    before_forced = dict(cands.by_node)  # what annotations rule out, for Plan.explain
    _apply_forced(graph, mesh, cands.by_node, options)
    phase(f"costing {len(graph.nodes)} nodes on mesh {mesh}")
    shape = mesh.shape

    tying = tie_repeated_layers(graph, cands.by_node, enabled=options.tie_layers)
    rep = tying.rep

    unit_costs: dict[str, list[float]] = {}  # one member's own cost per strategy
    for node in graph.nodes:
        if rep[node.name] != node.name:
            continue
        strategies = cands.by_node[node.name]
        if node.kind == "op":
            in_metas = [graph.meta(r) for r in node.inputs]
            grad = any(node.requires_grad)
            costs = [compute_time(node.target, in_metas, node.outputs, s.outputs, shape, cluster, backward=grad) for s in strategies]
        elif node.kind == "param" and node.grad(0):
            costs = [grad_sync_time(node.out, s.outputs[0], shape, cluster) for s in strategies]
        else:
            costs = [0.0] * len(strategies)
        unit_costs[node.name] = costs
    node_costs = {name: [c * tying.count[name] for c in costs] for name, costs in unit_costs.items()}

    pair_cost: dict[tuple, float | None] = {}  # repeated layers move the same tensors the same ways

    def move_cost(meta, a, b, backward) -> float | None:
        key = (meta, a, b, backward)
        if key not in pair_cost:
            try:
                pair_cost[key] = transfer_time(meta, a, b, shape, cluster, backward=backward)
            except InfeasibleRedistribution:
                pair_cost[key] = None
        return pair_cost[key]

    # every graph edge, as an edge between the classes it joins, counted as often as it occurs
    edge_count: dict[tuple, int] = {}
    for node in graph.nodes:
        for pos, ref in enumerate(node.inputs):
            key = (rep[ref.node], ref.index, rep[node.name], pos, graph.meta(ref), _grad_flows(graph, ref, node))
            edge_count[key] = edge_count.get(key, 0) + 1
    edges: list[Edge] = []
    for (src, index, dst, pos, meta, backward), times in edge_count.items():
        src_layouts = [s.outputs[index] for s in cands.by_node[src]]
        dst_layouts = [s.inputs[pos] for s in cands.by_node[dst]]
        if src == dst:  # layer k feeds the same position of layer k+1: a cost of the class's own choice
            for i, (a, b) in enumerate(zip(src_layouts, dst_layouts)):
                c = move_cost(meta, a, b, backward)
                node_costs[src][i] += INFEASIBLE_S if c is None else c * times
            continue
        cost = {}
        # ordered de-duplication: set order varies between processes, and every rank must build the same model
        for a in dict.fromkeys(src_layouts):
            for b in dict.fromkeys(dst_layouts):
                c = move_cost(meta, a, b, backward)
                if c is not None:
                    cost[(a, b)] = c * times
        edges.append(Edge(src, dst, src_layouts, dst_layouts, cost))

    phase(f"solving on mesh {mesh}")
    solution = solve(Problem(node_costs, edges), time_limit_s=options.time_limit_s)
    if solution.objective >= INFEASIBLE_S:
        raise InfeasiblePlan("no consistent choice of strategies exists for the repeated layers; plan with tie_layers=False")
    choice = {n.name: solution.choice[rep[n.name]] for n in graph.nodes}
    chosen = {name: cands.by_node[name][i] for name, i in choice.items()}

    nodes, transfers, params, inputs = [], [], [], []
    compute_s = comm_s = 0.0
    act_bytes = param_bytes = param_numel_local = grad_bytes = 0
    for node in graph.nodes:
        s = chosen[node.name]
        cost = unit_costs[rep[node.name]][choice[node.name]]
        for pos, ref in enumerate(node.inputs):
            src = chosen[ref.node].outputs[ref.index]
            dst = s.inputs[pos]
            if src == dst:
                continue
            meta = graph.meta(ref)
            fwd = redistribution_steps(meta, src, dst, shape)
            bwd = backward_steps(fwd) if _grad_flows(graph, ref, node) else []
            t = move_cost(meta, src, dst, bool(bwd))
            comm_s += t
            transfers.append(Transfer(str(ref), node.name, pos, src, dst, tuple(fwd), tuple(bwd), t))
        if node.kind == "op":
            compute_s += cost
            nodes.append(NodeChoice(node.name, node.target, node.module_path, s, cost))
            if any(node.requires_grad) and not is_view(node.target):
                act_bytes += sum(local_bytes(m, p, shape) for m, p in zip(node.outputs, s.outputs) if m is not None and p is not None)
        elif node.kind in ("param", "buffer"):
            layout = s.outputs[0]
            trainable = node.kind == "param" and node.grad(0)
            nbytes = local_bytes(node.out, layout, shape)
            param_bytes += nbytes
            if trainable:
                grad_bytes += nbytes
                param_numel_local += nbytes // node.out.itemsize
            comm_s += cost
            axes = grad_sync_axes(layout) if trainable else ()
            axes = tuple(a for a in axes if shape[a] > 1)
            params.append(ParamChoice(node.name, node.fqns, node.out.shape, layout, axes, node.kind == "buffer", cost, dtype=node.out.dtype))
        elif node.kind == "input":
            inputs.append(InputChoice(node.name, node.out.shape, s.outputs[0]))

    memory = MemoryBreakdown(
        params=param_bytes,
        grads=grad_bytes,
        optimizer=optimizer_state_bytes(param_numel_local, options.optimizer),
        activations=act_bytes,
    )
    return Plan(
        model=model_name,
        graph_fingerprint=graph.fingerprint(),
        mesh=mesh,
        mode=options.mode,
        inputs_mode=options.inputs,
        cluster=cluster.name,
        nodes=tuple(nodes),
        transfers=tuple(transfers),
        params=tuple(params),
        inputs=tuple(inputs),
        memory=memory,
        compute_s=compute_s,
        comm_s=comm_s,
        solver=SolverInfo(solution.status, solution.gap, solution.objective, solution.seconds, solution.backend, solution.variables),
        fallbacks=tuple(cands.fallbacks),
        alternatives=record_alternatives(
            graph, mesh, cands, before_forced, choice, options, own_cost=lambda name, i: unit_costs[rep[name]][i],
            move_cost=lambda ref, consumer, a, b: move_cost(graph.meta(ref), a, b, _grad_flows(graph, ref, consumer)),
        ),
    )


def _grad_flows(graph: Graph, ref, consumer: Node) -> bool:
    """A gradient comes back along this edge: the tensor needs one and the consumer passes one on."""
    if not graph[ref.node].grad(ref.index):
        return False
    return consumer.kind == "output" or any(consumer.requires_grad)


def _apply_forced(graph: Graph, mesh: MeshSpec, by_node: dict, options: PlanOptions) -> None:
    """Restrict leaf candidates to forced layouts (mode presets and explicit layouts)."""
    forced: dict[str, Placements] = {}
    if options.mode == "data_parallel":
        for node in graph.nodes:
            if node.kind in ("param", "buffer"):
                forced[node.name] = (Replicate(),) * mesh.ndim
            elif node.kind == "input" and node.out.shape:
                forced[node.name] = (Shard(0),) * mesh.ndim
    for pattern, layout in options.param_layouts.items():
        layout = parse(layout) if isinstance(layout, str) else tuple(layout)
        hits = [n for n in graph.nodes if n.kind in ("param", "buffer") and any(fnmatch.fnmatchcase(f, pattern) for f in n.fqns)]
        if not hits:
            raise ValueError(f"param_layouts pattern {pattern!r} matches no parameter or buffer of the model")
        for n in hits:
            forced[n.name] = layout
    for name, layout in options.input_layouts.items():
        if name not in graph.input_names:
            raise ValueError(f"input_layouts names input {name!r}; the model's inputs are {list(graph.input_names)}")
        forced[name] = parse(layout) if isinstance(layout, str) else tuple(layout)
    for name, layout in forced.items():
        if len(layout) != mesh.ndim:
            raise ValueError(f"layout {fmt(layout)} for {name} has {len(layout)} placements; the mesh has {mesh.ndim} axes")
        keep = [s for s in by_node[name] if s.outputs[0] == layout]
        if not keep:
            node = graph[name]
            raise ValueError(
                f"layout {fmt(layout)} for {' = '.join(node.fqns) or name} of shape {list(node.out.shape)} is not an even "
                f"sharding on mesh {mesh}; allowed: {', '.join(fmt(s.outputs[0]) for s in by_node[name])}"
            )
        by_node[name] = keep
