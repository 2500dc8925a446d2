"""The MIP of one mesh: what each node's strategies cost in time and memory, and what each edge's
resharding costs, with repeated layers tied into one class (see `tying.py`).

The same functions price the chosen plan afterwards (`node_memory`, `Tables.move_time`), so the
plan's predicted time and memory are exactly the quantities the solver minimised and bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from meshplan.cost_model.compute import is_view
from meshplan.cost_model.estimate import compute_time, dtensor_step_overhead, dtensor_view_time, grad_sync_time, local_bytes, optimizer_step_time
from meshplan.cost_model.memory import MemoryBreakdown, optimizer_state_bytes
from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.regions import RegionCost
from meshplan.ir.graph import Graph, Node, TensorMeta, TensorRef
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Placements, Replicate
from meshplan.ir.regions import region_op
from meshplan.planner.moves import Moves, layout_id, priced, shared_moves
from meshplan.planner.recompute import RecomputeGroup, RecomputeTerms
from meshplan.planner.solver import Edge, MemoryRow, Problem, Switch
from meshplan.planner.tying import Tying, tie_repeated_layers
from meshplan.plans.strategy import Strategy
from meshplan.progress import timed

INFEASIBLE_S = 1e9
"""Cost that marks a strategy the solver must not pick (a tied class that cannot feed itself)."""


def grad_flows(graph: Graph, ref: TensorRef, consumer: Node) -> bool:
    """A gradient comes back along this edge: the tensor needs one and the consumer passes one on."""
    if not graph[ref.node].grad(ref.index):
        return False
    outputs, reached = gradient_paths(graph)
    return ref in outputs if consumer.kind == "output" else consumer.name in reached and any(consumer.requires_grad)


_PATHS: dict[int, tuple[Graph, frozenset, frozenset]] = {}


def gradient_paths(graph: Graph) -> tuple[frozenset, frozenset]:
    """(outputs that receive a gradient, op nodes a gradient reaches in backward).

    Every output that requires grad receives one, unless the model returns a scalar loss (a
    Hugging Face model given `labels=`): then the user backpropagates that loss and the other
    outputs (logits, hidden states) get none, nor do ops that only feed them."""
    cached = _PATHS.get(id(graph))
    if cached is not None and cached[0] is graph:
        return cached[1], cached[2]
    outputs = graph.loss_outputs() or frozenset(r for r in graph.output.inputs if graph[r.node].grad(r.index))
    reached: set[str] = {r.node for r in outputs}
    for node in reversed(graph.nodes):
        if node.name in reached:
            reached.update(r.node for r in node.inputs)
    result = frozenset(n for n in reached if graph[n].kind == "op")
    if len(_PATHS) > 8:
        _PATHS.clear()
    _PATHS[id(graph)] = (graph, outputs, result)
    return outputs, result


def node_memory(node: Node, strategy: Strategy, mesh_shape: tuple[int, ...], optimizer: str, *, weight_cast: bool = False) -> MemoryBreakdown:
    """Bytes one device holds for this node at the peak of a step (the end of forward, with every
    gradient and optimizer state resident: a conservative sum until liveness is modelled).
    `weight_cast`: the node casts a parameter (`Graph.weight_casts`); its copy counts with the parameters."""
    if weight_cast:
        return MemoryBreakdown(params=local_bytes(node.out, strategy.outputs[0], mesh_shape), grads=0, optimizer=0, activations=0)
    if node.kind in ("param", "buffer"):
        nbytes = local_bytes(node.out, strategy.outputs[0], mesh_shape)
        if node.kind == "param" and node.grad(0):
            numel = nbytes // node.out.itemsize
            return MemoryBreakdown(params=nbytes, grads=nbytes, optimizer=optimizer_state_bytes(numel, optimizer), activations=0)
        return MemoryBreakdown(params=nbytes, grads=0, optimizer=0, activations=0)
    if node.kind == "op" and any(node.requires_grad) and not is_view(node.target):
        acts = sum(local_bytes(m, p, mesh_shape) for m, p in zip(node.outputs, strategy.outputs) if m is not None and p is not None)
        return MemoryBreakdown(params=0, grads=0, optimizer=0, activations=acts)
    return MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0)


def transfer_memory(meta: TensorMeta, src: Placements, dst: Placements, consumer: Node, mesh_shape: tuple[int, ...]) -> int:
    """A resharded copy feeding an op that needs gradients stays alive for its backward (this is
    where an all-gathered ZeRO/FSDP parameter is held)."""
    if src == dst or not keeps_copy(consumer):
        return 0
    return local_bytes(meta, dst, mesh_shape)


def dtensor_switch(graph: Graph, by_node: dict[str, list[Strategy]], rep: dict[str, str], cost: float) -> Switch:
    """The runtime keeps parameters plain only while every parameter and buffer is replicated on every
    axis (`Plan.plain_params`); any sharded one makes all of them DTensors, whose optimizer step and reading in
    forward + backward cost `cost` more in all."""
    members = {
        node.name: frozenset(k for k, s in enumerate(by_node[node.name]) if not all(isinstance(q, Replicate) for q in s.outputs[0]))
        for node in graph.nodes if node.kind in ("param", "buffer") and rep[node.name] == node.name
    }
    return Switch("dtensor_params", cost, {v: ks for v, ks in members.items() if ks})


def keeps_copy(consumer: Node) -> bool:
    """A resharded input of this consumer is saved for its backward."""
    return consumer.kind == "op" and any(consumer.requires_grad)


@dataclass(slots=True)
class Tables:
    """The problem handed to the solver, and what is needed to read its solution back."""

    problem: Problem
    tying: Tying
    unit_costs: dict[str, list[float]]
    """Class representative -> one member's own seconds per strategy (compute, or a trainable
    parameter's gradient sync + optimizer step)."""
    mesh_shape: tuple[int, ...]
    cluster: ClusterPreset
    optimizer_s: dict[str, list[float]] = field(default_factory=dict)
    """Trainable parameter class representative -> one member's `optimizer.step()` seconds per
    strategy on the device (included in `unit_costs`)."""
    memory: dict[str, list[MemoryBreakdown]] = field(default_factory=dict)
    """Class representative -> one member's bytes per device per strategy, by kind (their total, times the
    class size, is the problem's node memory)."""
    regions: dict[str, list[RegionCost | None]] = field(default_factory=dict)
    """Region op class representative -> its cost per strategy (compute and its own collectives)."""
    regions_forward: dict[str, list[RegionCost | None]] = field(default_factory=dict)
    """The same for a region op inside a layer, forward only: what recomputing it adds, its own collectives included."""
    forward_s: dict[str, list[float]] = field(default_factory=dict)
    """Op class representative inside a layer -> its forward seconds per strategy (what recomputing it adds)."""
    dtensor_step_s: float = 0.0
    """Seconds each trainable parameter's step costs more when the plan's parameters are DTensors (`dtensor_switch`)."""
    dtensor_view_s: float = 0.0
    """Seconds each trainable parameter's forward + backward costs more when the plan's parameters are DTensors."""
    _moves: dict[TensorMeta, Moves] = field(default_factory=dict)
    """Priced moves per tensor meta (`moves.shared_moves(cluster, mesh_shape)` when `build_tables` made it)."""

    def move_time(self, meta: TensorMeta, src: Placements, dst: Placements, backward: bool) -> float | None:
        """Seconds to reshard (None if impossible), with the gradient's move back when `backward`."""
        cache = self._moves.setdefault(meta, {})  # `mover` inlined: explaining a plan asks this for every alternative
        key = (layout_id(src), layout_id(dst))
        times = cache.get(key, _UNKNOWN)
        if times is _UNKNOWN:
            times = priced(cache, key, meta, src, dst, self.mesh_shape, self.cluster)
        return None if times is None else times[0] + times[1] if backward else times[0]

    def mover(self, meta: TensorMeta) -> Callable[[Placements, Placements], tuple[float, float] | None]:
        """(forward, backward) seconds to reshard a tensor of `meta`, None if impossible. Cached:
        repeated layers move the same tensors the same ways; one lookup serves both directions, and
        the table builder asks once per edge for the tensor's cache (building the tables is mostly
        these lookups)."""
        cache = self.moves_of(meta)

        def times(src: Placements, dst: Placements) -> tuple[float, float] | None:
            key = (layout_id(src), layout_id(dst))
            found = cache.get(key, _UNKNOWN)
            return priced(cache, key, meta, src, dst, self.mesh_shape, self.cluster) if found is _UNKNOWN else found

        return times

    def moves_of(self, meta: TensorMeta) -> Moves:
        """The priced moves of a tensor of `meta` (`moves.Moves`); a pair not in it is priced by `moves.priced`."""
        return self._moves.setdefault(meta, {})


_UNKNOWN = object()


@dataclass(frozen=True, slots=True)
class RowWeights:
    """What one device holds of each node of the graph, for a `MemoryRow` bounded by `bound`: `resident` copies of
    what it keeps all step (a parameter, its gradient and optimizer state, a weight's cast copy) and `activations`
    copies of what the node saves for backward (and of the resharded copies feeding it). A node absent counts 0."""

    name: str
    bound: float
    resident: dict[str, float]
    activations: dict[str, float]


def weigh_per_step(problem: Problem, graph: Graph, weight: float) -> None:
    """Scale the costs paid once per step in `problem`'s objective (each parameter's gradient sync and optimizer step,
    the plan-wide switches) by `weight`, against those paid per microbatch (`PlanOptions.microbatches`)."""
    for name, costs in problem.node_costs.items():
        if graph[name].kind == "param":
            problem.node_costs[name] = [c * weight for c in costs]
    problem.switches = [replace(sw, cost=sw.cost * weight) for sw in problem.switches]


@timed("tables")
def build_tables(
    graph: Graph,
    mesh: MeshSpec,
    cluster: ClusterPreset,
    by_node: dict[str, list[Strategy]],
    *,
    optimizer: str,
    memory_budget: float | None,
    tie_layers: bool = True,
    recompute: list[RecomputeGroup] = (),
    force_recompute: bool = False,
    tying: Tying | None = None,
    rows: Sequence[RowWeights] = (),
) -> Tables:
    """`tying`: `tie_repeated_layers(graph, by_node, enabled=tie_layers)` when the caller has it already. `rows`: more
    memory rows (`Problem.rows`); they count no recomputation (a solve with rows recomputes nothing)."""
    shape = mesh.shape
    tying = tying or tie_repeated_layers(graph, by_node, enabled=tie_layers)
    rep, count = tying.rep, tying.count
    terms = RecomputeTerms(graph, recompute, rep, count, force=force_recompute)
    unit_costs: dict[str, list[float]] = {}
    optimizer_s: dict[str, list[float]] = {}
    node_mem: dict[str, list[float]] = {}
    breakdowns: dict[str, list[MemoryBreakdown]] = {}
    regions: dict[str, list[RegionCost | None]] = {}
    regions_forward: dict[str, list[RegionCost | None]] = {}
    forward_s: dict[str, list[float]] = {}
    for node in graph.nodes:
        if rep[node.name] != node.name:
            continue
        strategies = by_node[node.name]
        if node.kind == "op":
            in_metas = [graph.meta(r) for r in node.inputs]
            grad = any(node.requires_grad)
            region = region_op(node.target)
            own = [region.cost(node, in_metas, s, shape, cluster, backward=grad) if region is not None else None for s in strategies]
            if any(r is not None for r in own):
                regions[node.name] = own
            costs = [
                r.total_s if r is not None else compute_time(node.target, in_metas, node.outputs, s.outputs, shape, cluster, backward=grad,
                                                             in_layouts=s.inputs)
                for s, r in zip(strategies, own)
            ]
        elif node.kind == "param" and node.grad(0):
            # the step updates each device's local shard: sharding a parameter divides its step (priced plain
            # here; the DTensor dispatch every parameter pays once any is sharded is the plan's `dtensor_params` switch)
            step = [optimizer_step_time([local_bytes(node.out, s.outputs[0], shape) // node.out.itemsize], optimizer, shape, cluster)
                    for s in strategies]
            optimizer_s[node.name] = step
            costs = [grad_sync_time(node.out, s.outputs[0], shape, cluster) + t for s, t in zip(strategies, step)]
        else:
            costs = [0.0] * len(strategies)
        unit_costs[node.name] = costs
        cast = node.name in graph.weight_casts
        breakdowns[node.name] = [node_memory(node, s, shape, optimizer, weight_cast=cast) for s in strategies]
        node_mem[node.name] = [float(m.total * count[node.name]) for m in breakdowns[node.name]]
        if terms.unit_of(node.name) is not None:
            again = [region.cost(node, in_metas, s, shape, cluster, backward=False) for s in strategies] if node.name in regions else []
            if again:  # a region op runs its own forward collectives again too
                regions_forward[node.name] = again
            forward_s[node.name] = [
                r.total_s if r is not None else compute_time(node.target, in_metas, node.outputs, s.outputs, shape, cluster, backward=False,
                                                             in_layouts=s.inputs)
                for s, r in zip(strategies, again or [None] * len(strategies))
            ]
            terms.add_node(node.name, forward_s[node.name], [float(m.activations) for m in breakdowns[node.name]])
    node_costs = {name: [c * count[name] for c in costs] for name, costs in unit_costs.items()}
    dtensor_s, view_s = dtensor_step_overhead(optimizer, shape, cluster), dtensor_view_time(shape, cluster)
    trainable = sum(count[name] for name in optimizer_s)
    extra = (dtensor_s + view_s) * trainable
    switches = [dtensor_switch(graph, by_node, rep, extra)] if extra > 0 else []
    # each row weighs a class's member bytes by the members it holds (`RowWeights`)
    members: dict[str, list[str]] = {}
    for name, r in rep.items() if rows else ():
        members.setdefault(r, []).append(name)
    row_list = [MemoryRow(w.name, w.bound, {}, {}) for w in rows]
    for w, row in zip(rows, row_list):
        for r, mems in breakdowns.items():
            held = sum(w.resident.get(n, 0.0) for n in members[r]), sum(w.activations.get(n, 0.0) for n in members[r])
            if any(held):
                row.node_memory[r] = [held[0] * (m.total - m.activations) + held[1] * m.activations for m in mems]
    tables = Tables(Problem(node_costs, [], {}, node_mem, memory_budget, switches=switches, rows=row_list), tying, unit_costs, shape, cluster, optimizer_s,
                    dtensor_step_s=dtensor_s, dtensor_view_s=view_s,
                    memory=breakdowns, regions=regions, regions_forward=regions_forward, forward_s=forward_s,
                    _moves=shared_moves(cluster, shape))

    # every graph edge, as an edge between the classes it joins, counted as often as it occurs
    occurrences: dict[tuple, list[str]] = {}  # edge key -> the consumer, per occurrence
    for node in graph.nodes:
        for pos, ref in enumerate(node.inputs):
            key = (rep[ref.node], ref.index, rep[node.name], pos, graph.meta(ref), grad_flows(graph, ref, node))
            occurrences.setdefault(key, []).append(node.name)
    # the problem's edges name layouts by `layout_id`: the solver keys a dict by layout pairs for every pair of every
    # edge, and a layout's hash is a Python call per placement (DTensor's `__hash__`), a small int's is not
    ids: dict[tuple[str, str, int], list[int]] = {}

    def ids_of(name: str, slot: str, k: int, layouts: list[Placements]) -> list[int]:
        found = ids.get((name, slot, k))
        if found is None:
            found = ids[name, slot, k] = [layout_id(x) for x in layouts]
        return found

    for (src, index, dst, pos, meta, backward), consumers in occurrences.items():
        layers, times = [graph[c].layer for c in consumers], len(consumers)
        # per row, the copies it holds of a resharded input of these consumers
        saved_in_row = [sum(w.activations.get(c, 0.0) for c in consumers) for w in rows]
        consumer = graph[dst]  # stands for its class: tied members agree on kind and requires_grad
        src_layouts = [s.outputs[index] for s in by_node[src]]
        dst_layouts = [s.inputs[pos] for s in by_node[dst]]
        unit = terms.unit_of(dst)
        moves = tables.mover(meta)
        if src == dst:  # layer k feeds the same position of layer k+1: a cost of the class's own choice
            fwds, helds = [], []
            for i, (a, b) in enumerate(zip(src_layouts, dst_layouts)):
                t = moves(a, b)
                node_costs[src][i] += INFEASIBLE_S if t is None else (t[0] + t[1] if backward else t[0]) * times
                held = transfer_memory(meta, a, b, consumer, shape)
                node_mem[src][i] += held * times
                for row, copies in zip(row_list, saved_in_row):
                    if held and copies:
                        row.node_memory.setdefault(src, [0.0] * len(src_layouts))[i] += held * copies
                fwds.append(0.0 if t is None else t[0])
                helds.append(float(held))
            if unit is not None:
                terms.add_self_edge(dst, f"{index}/{pos}", fwds, helds, layers)
            continue
        src_ids, dst_ids = ids_of(src, "out", index, src_layouts), ids_of(dst, "in", pos, dst_layouts)
        edge = Edge(src, dst, src_ids, dst_ids, {}, {}, unit=unit, name=f"e{len(tables.problem.edges)}")
        for row, copies in zip(row_list, saved_in_row):
            if copies:
                row.edge_weight[edge.name] = copies / times  # the edge's memory is its occurrences
        # ordered de-duplication (id -> its layout): set order varies between processes, and every rank must build the
        # same model
        needed = dict(zip(dst_ids, dst_layouts))
        keeps = keeps_copy(consumer)
        # the loop below runs once per layout pair (hundreds of thousands on a 3-axis mesh): `moves` inlined, the
        # priced moves looked up by layout ids
        cache, cost, memory = tables.moves_of(meta), edge.cost, edge.memory
        needed_ids = [(b, ib, float(local_bytes(meta, b, shape)) if keeps else 0.0) for ib, b in needed.items()]  # transfer_memory when a != b
        for ia, a in dict(zip(src_ids, src_layouts)).items():
            for b, ib, copied in needed_ids:
                key = (ia, ib)
                t = cache.get(key, _UNKNOWN)
                if t is _UNKNOWN:
                    t = priced(cache, key, meta, a, b, shape, cluster)
                if t is None:
                    continue
                cost[key] = (t[0] + t[1] if backward else t[0]) * times
                m = 0.0 if ia == ib else copied
                if m:
                    memory[key] = m * times
                if unit is None:
                    continue
                fwd = t[0]
                if fwd or m:
                    edge.recompute_cost[key] = fwd * times
                    edge.recompute_saved[key] = m * times
                    edge.recompute_peak[key] = m
        if edge.recompute_cost:
            terms.add_edge(edge.name, unit, layers)
        tables.problem.edges.append(edge)
    tables.problem.recompute = terms.finish()
    return tables
