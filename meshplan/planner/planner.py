"""From a traced graph and a mesh to a Plan: candidates, costs, the solve, and the bookkeeping.

`make_plan` runs these steps:

1. `_checked_search`: the options' mode, inputs and search.
2. `_candidates`: every node's candidate strategies, narrowed by the annotations.
3. `_keep_budget`: per bound of the solver's memory row, until the plan's walked peak keeps the budget,
   `_Planning.attempt`: the cost tables (`make_tables`), the solve (`solve_whole`: one exact or propagation
   solve, `solve_subset`, or a neighbourhood search, `solve_by_neighbourhoods`), the solution read back per node
   (`_decode`), and the Plan (`assemble`).

Four index spaces meet in a solve; each conversion between them is one function:

- full: into `cands.by_node[node]`, the candidates the annotations leave (what a neighbourhood search compares);
- subset: into the lists a neighbourhood keeps (`_restrict` makes them, `_to_full` maps back; for one solve of
  the whole problem, the full lists);
- class: the solver's choice is keyed by the representative of each class of tied repeated layers (`Tying.rep`);
- table: it indexes the class's table lists, which `add_offload_options` extends with offloaded copies.

`_decode` takes the solver's choice (class, table) to each node's subset index and offload flag.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshplan.cost_model.estimate import GRAD_BUCKET_BYTES, bucket_time, grad_sync_axes, local_bytes
from meshplan.cost_model.memory import MemoryBreakdown, format_bytes, parse_bytes
from meshplan.cost_model.model_flops import model_flops
from meshplan.cost_model.peak import predict_peak
from meshplan.cost_model.pipeline_memory import with_stage_memory
from meshplan.cost_model.presets import CLUSTERS, ClusterPreset
from meshplan.cost_model.redistribution import backward_steps, redistribution_steps
from meshplan.ir.graph import Graph
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Placements
from meshplan.planner.alternatives import record_alternatives
from meshplan.planner.collector import fewer_collections
from meshplan.planner.constraints import Annotations, Constraint, constrain
from meshplan.planner.neighbourhood import PAIR_LIMIT, Solved, Subset, coarsening, embedded, layout_pairs, merged
from meshplan.planner.neighbourhood import search as neighbourhood_search
from meshplan.planner.offload import OffloadOptions, add_offload_options, check_offload
from meshplan.planner.problem import INFEASIBLE_S, RowWeights, Tables, build_tables, grad_flows, node_memory, transfer_memory, weigh_per_step
from meshplan.planner.propagation import propagate
from meshplan.planner.recompute import RecomputeGroup, check_recompute, internal_outputs, recompute_groups
from meshplan.planner.solver import InfeasiblePlan, Solution, SolveTimeout, evaluate, solve
from meshplan.planner.strategies import Candidates, generate
from meshplan.planner.token_order import check_token_order, keep_order
from meshplan.planner.tying import Tying, tie_repeated_layers
from meshplan.plans.plan import GradBucket, InputChoice, NodeChoice, ParamChoice, Plan, SolverInfo, Transfer, keeps_plain
from meshplan.plans.strategy import Strategy
from meshplan.progress import phase

log = logging.getLogger("meshplan")

MODES = ("auto", "data_parallel", "semi_auto", "manual")
SEARCHES = ("ilp", "propagation")


class MemoryBudgetError(ValueError):
    """No plan fits the per-device memory budget; says the smallest budget that would work."""

    def __init__(self, budget: float, smallest: float, mesh: MeshSpec, cluster: ClusterPreset, *, of: str = "the plans the planner finds") -> None:
        self.budget, self.smallest, self.mesh, self.cluster = budget, smallest, mesh, cluster.name
        super().__init__(
            f"memory budget {format_bytes(budget)} per device is infeasible on mesh {mesh}: the smallest predicted peak "
            f"of {of} is {format_bytes(smallest)} ({int(smallest)} bytes); allowed: a budget >= that, or more devices. "
            f"Planned for cluster {cluster.name!r} ({format_bytes(cluster.device.memory_bytes)} per device); plan for the "
            f"hardware you run on with cluster= ({', '.join(sorted(CLUSTERS))}) or memory_budget="
        )


UNBOUNDED = 2**60
"""A memory budget that never binds (a pipeline's stage plan is solved without one: its row would sum one microbatch
of every stage, which bounds no stage; it keeps the budget by a row per pipeline rank instead, `stage_rows.py`)."""
MAX_TIGHTENINGS = 4
"""Solves again with a tighter memory row when the walked peak of a plan breaks the budget."""


def _budget(value: int | str | None, cluster: ClusterPreset) -> float:
    if value is None:
        return float(cluster.device.memory_bytes)
    return float(parse_bytes(value))
INPUT_MODES = ("global", "local")


@dataclass(kw_only=True, slots=True)
class PlanOptions:
    mode: str = "auto"
    """'auto' searches everything not annotated; 'data_parallel' replicates parameters and shards inputs' dim 0 on
    every axis; 'semi_auto' fixes the (required) annotations and searches the rest; 'manual' needs a layout for
    every parameter and input and completes the ops from them. See docs/modes.md."""
    search: str | None = None
    """'ilp' (exact) or 'propagation' (greedy, no solver); None: 'propagation' in manual mode, else 'ilp'."""
    annotations: Annotations = field(default_factory=Annotations)
    """parameter_plan, parallelize_plan and meshplan.shard annotations (see planner/constraints.py)."""
    inputs: str = "global"
    """'global': every rank passes the whole batch; 'local': each rank passes its own slice."""
    microbatches: int = 1
    """Microbatches per step when this is a pipeline stage's plan (one microbatch's graph): the gradient sync and the
    optimizer step run once per step, so the solve weighs them 1/microbatches against one microbatch's work (weighed
    alike, a stage plan of 48 microbatches put tensor parallelism on the inter-node axis to spare the data-parallel
    gradient sync it pays once). The plan's figures are unweighted."""
    loss_only: bool = False
    """The runtime hands out only the model's own scalar loss (a pipelined step returns that alone): the model's other
    outputs (a Hugging Face model's logits beside its loss) keep whatever layout is cheapest instead of being gathered
    whole, and the loss function sees them as DTensors. No effect on a model without a scalar loss output."""
    strict: bool = False
    """Raise instead of replicating ops that have no sharding rule."""
    param_layouts: dict[str, str | Placements] = field(default_factory=dict)
    """Forced parameter layouts by FQN glob, e.g. {'*.fc1.weight': 'RS(0)'}."""
    input_layouts: dict[str, str | Placements] = field(default_factory=dict)
    """Forced user-input layouts by input name."""
    preferred: tuple[Constraint, ...] = ()
    """Layouts of tensor slots of this graph (None on an axis leaves it to the search) that every node keeps where its
    candidates allow: a pipeline's stage plan keeps each op's tensor-parallel layout as its configuration was priced
    (planner/stage_layouts.py)."""
    optimizer: str = "adam"
    """Optimizer whose state the memory model counts."""
    memory_budget: int | str | None = None
    """Bytes per device the predicted peak may use ('80GB', '512MiB' or an int); None: the device's memory."""
    time_limit_s: float = 60.0
    """Seconds each solve may take (a neighbourhood search: all its rounds). A solve that reaches it returns
    its best plan or the propagation plan, whichever is faster, labelled not proven optimal."""
    tie_layers: bool = True
    """Give corresponding nodes of repeated layers one strategy and solve the block once (exact for that reduced problem)."""
    recompute: str = "auto"
    """Activation recomputation of repeated-layer groups: 'auto' (the solve decides when the memory budget
    binds), 'never', or 'always' (see planner/recompute.py)."""
    alternatives: bool = True
    """Record every node's priced alternatives for `Plan.explain` (the pipeline search's per-stage solves do not)."""
    offload: str = "never"
    """Optimizer state (with fp32 master weights) in host memory: 'never', 'auto' (the solve decides per
    parameter) or 'always'. Needs the optimizer from `ParallelModule.make_optimizer` (see planner/offload.py)."""
    memory_rows: tuple[RowWeights, ...] = ()
    """More memory rows the solve keeps, each a device's share of the graph (`problem.RowWeights`): a pipeline's stage
    plan keeps one per pipeline rank (`planner/stage_rows.py`). Needs recompute='never' and offload='never' (the rows
    count neither)."""
    token_order: bool = False
    """Hold every tensor split over the `cp` axis in head-tail token order (runtime/token_order.py): causal attention
    then runs balanced with no exchange of queries (`cp_attention(headtail)`, `cp_attention(ring_headtail)`; Ulysses as
    `cp_attention(ulysses_headtail)`); parameters split over `cp` stay contiguous blocks, gathered over it before use
    (planner/token_order.py)."""


@fewer_collections
def make_plan(
    graph: Graph, mesh: MeshSpec, cluster: ClusterPreset, options: PlanOptions, *, model_name: str = "model",
    earlier: Sequence[Plan] = (),
) -> Plan:
    """The plan of `graph` on `mesh`. `earlier`: the mesh search's plans of the same graph on other
    meshes; those that map onto this one (coarser, or permuted) start its search when it is too
    large for one exact solve (`planner/neighbourhood.py`).

    `plan.memory` is the liveness walk's peak (`cost_model/peak.py`), and the plan keeps `options.memory_budget` by
    that peak (`_keep_budget`, which calls `_Planning.attempt` once per bound of the solver's memory row)."""
    search = _checked_search(options)
    cands, before_constraints, constraints = _candidates(graph, mesh, options)
    budget = _budget(options.memory_budget, cluster)
    check_recompute(options.recompute)
    check_offload(options.offload, cluster)
    if options.memory_rows and (options.recompute, options.offload) != ("never", "never"):
        raise ValueError(f"memory_rows with recompute={options.recompute!r} and offload={options.offload!r}: the rows count "
                         "neither; allowed: recompute='never' and offload='never'")
    # propagation walks the real graph (layer k hands its layouts to layer k+1); tying serves the solver
    tie = options.tie_layers and search == "ilp"
    planning = _Planning(
        graph=graph, mesh=mesh, cluster=cluster, options=options, model_name=model_name, earlier=earlier, search=search,
        cands=cands, before_constraints=before_constraints, constraints=constraints, budget=budget, tie=tie,
        groups=recompute_groups(graph) if options.recompute != "never" and search == "ilp" else [],
        tying=tie_repeated_layers(graph, cands.by_node, enabled=tie),
    )
    return _keep_budget(planning.attempt, graph, budget, options.optimizer, mesh, cluster)


def _checked_search(options: PlanOptions) -> str:
    """The search `options` ask for ('ilp' or 'propagation'), after checking their mode, inputs and search."""
    if options.mode not in MODES:
        raise ValueError(f"mode={options.mode!r} is not supported; allowed: {', '.join(MODES)}")
    if options.inputs not in INPUT_MODES:
        raise ValueError(f"inputs={options.inputs!r} is not supported; allowed: {', '.join(INPUT_MODES)}")
    search = options.search or ("propagation" if options.mode == "manual" else "ilp")
    if search not in SEARCHES:
        raise ValueError(f"search={options.search!r} is not supported; allowed: {', '.join(SEARCHES)}")
    return search


def _candidates(graph: Graph, mesh: MeshSpec, options: PlanOptions) -> tuple[Candidates, dict[str, list[Strategy]], list[Constraint]]:
    """Every node's candidate strategies on `mesh` as the annotations leave them (`cands.by_node`, the full lists
    whose indices the solves report), the lists before the annotations (what they rule out, for Plan.explain), and
    the constraints the annotations bound to the graph."""
    phase(f"candidate strategies on mesh {mesh}")
    cands = generate(graph, mesh, inputs=options.inputs, strict=options.strict, loss_only=options.loss_only)
    if options.token_order:
        check_token_order(mesh, inputs=options.inputs)
    keep_order(graph, mesh, cands, options.token_order)
    before_constraints = dict(cands.by_node)
    constraints = constrain(
        graph, mesh, cands.by_node, mode=options.mode, annotations=options.annotations,
        param_layouts=options.param_layouts, input_layouts=options.input_layouts, preferred=options.preferred,
        rejected=cands.rejected,
    )
    return cands, before_constraints, constraints


@dataclass(frozen=True, slots=True)
class _Searched:
    """What one solve leaves for building the plan: the candidates it saw, its tables, its solution, and that
    solution per node in the candidates' indices (`_decode`)."""

    by_node: dict[str, list[Strategy]]
    """The candidates the solve saw: the full lists, or the ones a neighbourhood keeps (`_restrict`)."""
    tables: Tables
    offload_from: OffloadOptions
    solution: Solution
    table_choice: dict[str, int]
    """node -> its class's choice: an index into the class's offload-extended table lists (`unit_costs`)."""
    choice: dict[str, int]
    """node -> index into `by_node[node]`."""
    offloaded: set[str]
    """Nodes whose optimizer state the solve puts in host memory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Planning:
    """One `make_plan` call once its candidates are fixed: per bound of the memory row (`attempt`), the tables
    (`make_tables`), the solve of the whole problem (`solve_whole`: one solve, `solve_subset`, or a neighbourhood
    search, `solve_by_neighbourhoods`) and the Plan (`assemble`)."""

    graph: Graph
    mesh: MeshSpec
    cluster: ClusterPreset
    options: PlanOptions
    model_name: str
    earlier: Sequence[Plan]
    search: str
    """'ilp' or 'propagation' (`_checked_search`)."""
    cands: Candidates
    before_constraints: dict[str, list[Strategy]]
    constraints: list[Constraint]
    budget: float
    """The per-device memory budget the walked peak keeps (the solver's row may be bounded tighter)."""
    tie: bool
    """Whether repeated layers are tied (solved once)."""
    groups: list[RecomputeGroup]
    """The repeated-layer groups the solve may recompute."""
    tying: Tying
    """The tying of the full candidate lists (a neighbourhood's tables tie their own)."""

    def attempt(self, row: float) -> Plan:
        """Solve with the memory row bounded by `row` and assemble the plan (memory: the row's sum)."""
        return self.assemble(self.solve_whole(row))

    def make_tables(self, by_node: dict[str, list[Strategy]], row: float, *, whole: bool) -> tuple[Tables, OffloadOptions]:
        """The cost tables of the candidates `by_node` (`whole`: the full lists) with the memory row bounded by `row`,
        and the offloaded strategies added to them."""
        options = self.options
        tables = build_tables(
            self.graph, self.mesh, self.cluster, by_node, optimizer=options.optimizer, memory_budget=row, tie_layers=self.tie,
            recompute=self.groups, force_recompute=options.recompute == "always", tying=self.tying if whole else None,
            rows=options.memory_rows,
        )
        offload_from = add_offload_options(tables, self.graph, by_node, self.cluster, optimizer=options.optimizer, mode=options.offload)
        if options.microbatches != 1:
            weigh_per_step(tables.problem, self.graph, 1.0 / options.microbatches)
        return tables, offload_from

    def solve_subset(self, subset: Subset | None, row: float) -> Solved[_Searched]:
        """Tables and one solve over the candidates `subset` keeps (all of them when None); `Solved.choice` holds
        indices into the full candidate lists."""
        by_node = _restrict(self.cands.by_node, subset)
        tables, offload_from = self.make_tables(by_node, row, whole=subset is None)
        solution = propagate(tables.problem) if self.search == "propagation" else _solve_with_recompute(tables.problem, self.options)
        table_choice, choice, offloaded = _decode(self.graph, tables.tying.rep, offload_from, solution)
        searched = _Searched(by_node, tables, offload_from, solution, table_choice, choice, offloaded)
        return Solved(solution.objective, _to_full(choice, subset), searched)

    def solve_whole(self, row: float) -> _Searched:
        """The solve of the whole problem under `row`: one solve, or a neighbourhood search when its layout pairs
        exceed `PAIR_LIMIT`. When no plan fits the row, `MemoryBudgetError` names the smallest row of any plan."""
        began = time.perf_counter()
        mesh = self.mesh
        phase(f"{self.search} search on mesh {mesh} (costing and solving {len(self.graph.nodes)} nodes)")
        pairs = layout_pairs(self.graph, self.cands.by_node, self.tying.rep) if self.search == "ilp" else 0
        log.info("mesh %s: %d strategies, %d layout pairs", mesh, sum(map(len, self.cands.by_node.values())), pairs)
        try:
            if pairs > PAIR_LIMIT:
                return self.solve_by_neighbourhoods(row, pairs, began)
            return self.solve_subset(None, row).result
        except InfeasiblePlan:
            smallest = self.smallest_row(row, pairs)
            if smallest <= row:
                raise
            raise MemoryBudgetError(self.budget, smallest, mesh, self.cluster) from None

    def solve_by_neighbourhoods(self, row: float, pairs: int, began: float) -> _Searched:
        """The best plan of a neighbourhood search (`planner/neighbourhood.py`) from `_starts`, labelled 'local', its
        seconds counted from `began`."""
        mesh = self.mesh
        phase(f"mesh {mesh}: {pairs} layout pairs exceed {PAIR_LIMIT}; searching one mesh axis at a time")
        found = neighbourhood_search(
            lambda subset: self.solve_subset(subset, row), self.cands.by_node, mesh.ndim, _starts(self.cands.by_node, mesh, self.earlier),
            time_limit_s=self.options.time_limit_s,
        )
        local = dataclasses.replace(found.result.solution, status="local", seconds=time.perf_counter() - began)
        return dataclasses.replace(found.result, solution=local)

    def smallest_row(self, row: float, pairs: int) -> float:
        """The smallest memory row of any plan (solved minimising memory, without recomputation or offload); on a
        mesh searched by neighbourhoods, of the plans that merge the outer axes."""
        subset = None if pairs <= PAIR_LIMIT else merged(self.cands.by_node, _outer_merged(self.mesh))
        tables = build_tables(self.graph, self.mesh, self.cluster, _restrict(self.cands.by_node, subset), optimizer=self.options.optimizer,
                              memory_budget=row, tie_layers=self.tie)
        return solve(tables.problem, time_limit_s=self.options.time_limit_s, minimize="memory").objective

    def assemble(self, searched: _Searched) -> Plan:
        """The Plan of one solve: the chosen strategies as `NodeChoice`, `Transfer`, `ParamChoice` and `GradBucket`
        entries, every price and size the tables' own (the solver's numbers) at the chosen strategy; `memory` is the
        solver's sum."""
        graph, mesh, cluster, options, groups, cands = self.graph, self.mesh, self.cluster, self.options, self.groups, self.cands
        shape = mesh.shape
        by_node, tables, offload_from, solution = searched.by_node, searched.tables, searched.offload_from, searched.solution
        if solution.objective >= INFEASIBLE_S:
            raise InfeasiblePlan("no consistent choice of strategies exists for the repeated layers; plan with tie_layers=False")
        rep = tables.tying.rep
        table_choice, choice, offloaded = searched.table_choice, searched.choice, searched.offloaded
        chosen = {name: by_node[name][i] for name, i in choice.items()}

        nodes, transfers, params, inputs = [], [], [], []
        compute_s = comm_s = host_s = optimizer_s = 0.0
        memory = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0)
        recomputed = {layer: g.name for g in groups if g.name in solution.recompute for layer in g.layers}
        internal = internal_outputs(graph) if recomputed else set()
        rematerialised: dict[str, float] = {}  # recomputed layer -> bytes it holds again during its backward
        trained: set[str] = set()  # trainable parameter nodes
        # every price and size below is the tables' (the solver's own numbers), read at the chosen strategy
        for node in graph.nodes:
            s = chosen[node.name]
            r, i = rep[node.name], choice[node.name]
            cost = tables.unit_costs[r][table_choice[node.name]]
            node_mem = tables.memory[r][i]
            if node.name in offloaded:
                node_mem = dataclasses.replace(node_mem, optimizer=0)
                host_s += offload_from.host_s[r][i]
            if node.kind == "op" and node.layer in recomputed:
                cost += tables.forward_s[r][i]
                if node.name in internal:
                    rematerialised[node.layer] = rematerialised.get(node.layer, 0.0) + node_mem.activations
                    node_mem = dataclasses.replace(node_mem, activations=0)
            memory = memory + node_mem
            for pos, ref in enumerate(node.inputs):
                src = chosen[ref.node].outputs[ref.index]
                dst = s.inputs[pos]
                if src == dst:
                    continue
                meta = graph.meta(ref)
                fwd = redistribution_steps(meta, src, dst, shape)
                bwd = backward_steps(fwd) if grad_flows(graph, ref, node) else []
                t = tables.move_time(meta, src, dst, bool(bwd))
                held = transfer_memory(meta, src, dst, node, shape)
                again = node.kind == "op" and node.layer in recomputed
                if again:  # the forward move runs again in backward; its copy is not held until then
                    t += tables.move_time(meta, src, dst, False)
                    rematerialised[node.layer] = rematerialised.get(node.layer, 0.0) + held
                    held = 0
                comm_s += t
                memory = memory + MemoryBreakdown(params=0, grads=0, optimizer=0, activations=held)
                transfers.append(Transfer(str(ref), node.name, pos, src, dst, tuple(fwd), tuple(bwd), t, recompute=again))
            if node.kind == "op":
                region = tables.regions[r][i] if r in tables.regions else None
                if region is not None:  # a region op's own collectives are communication, listed in the plan
                    cost = region.compute_s
                    if node.layer in recomputed:  # its forward again, own collectives included
                        rerun = tables.regions_forward[r][i]
                        cost, comm_s = cost + rerun.compute_s, comm_s + rerun.comm_s
                    compute_s, comm_s = compute_s + cost, comm_s + region.comm_s
                    nodes.append(NodeChoice(node.name, node.target, node.module_path, s, cost, region.forward, region.backward))
                else:
                    compute_s += cost
                    nodes.append(NodeChoice(node.name, node.target, node.module_path, s, cost))
            elif node.kind in ("param", "buffer"):
                layout = s.outputs[0]
                trainable = node.kind == "param" and node.grad(0)
                step = 0.0  # ParamChoice.time_s keeps the gradient sync (+ the host step when offloaded)
                if trainable:
                    trained.add(node.name)
                    device_step = tables.optimizer_s[r][i]
                    if node.name in offloaded:  # the cost holds the host step in place of the device's
                        cost += device_step
                    else:
                        cost -= device_step
                        step = device_step
                    optimizer_s += step
                axes = grad_sync_axes(layout) if trainable else ()
                axes = tuple(a for a in axes if shape[a] > 1)
                params.append(
                    ParamChoice(node.name, node.fqns, node.out.shape, layout, axes, node.kind == "buffer", cost, dtype=node.out.dtype,
                                offload=node.name in offloaded, optimizer_s=step)
                )
            elif node.kind == "input":
                inputs.append(InputChoice(node.name, node.out.shape, s.outputs[0]))
        for g in groups:  # one layer of each recomputed group is whole again while its backward runs
            if g.name in solution.recompute:
                peak = max((rematerialised.get(layer, 0.0) for layer in g.layers), default=0.0)
                memory = memory + MemoryBreakdown(params=0, grads=0, optimizer=0, activations=int(peak))
        if (tables.dtensor_step_s or tables.dtensor_view_s) and not keeps_plain(params):
            # the runtime makes every parameter a DTensor once one is sharded or offloaded (Plan.plain_params): each trainable
            # one's step pays DTensor's dispatch, and each forward + backward reads it through `runtime.local_view`
            params = [dataclasses.replace(p, optimizer_s=p.optimizer_s + tables.dtensor_step_s if p.optimizer_s else 0.0,
                                          view_s=tables.dtensor_view_s) if p.node in trained else p for p in params]
            optimizer_s = sum(p.optimizer_s for p in params)
            compute_s += sum(p.view_s for p in params)
        buckets = _grad_buckets(graph, params, shape, cluster)
        flops, flops_dtype = model_flops(graph)
        comm_s += sum(b.time_s for b in buckets)  # gradient sync as the runtime runs it, not per parameter
        if abs(memory.total - solution.memory) > 1e-6 * max(memory.total, 1.0) + 1:
            raise AssertionError(f"plan memory {memory.total} differs from the solver's {solution.memory}")

        return Plan(
            model=self.model_name,
            graph_fingerprint=graph.fingerprint(),
            precision=graph.precision,
            model_flops=flops,
            peak_flops=cluster.device.peak(flops_dtype),
            token_order=options.token_order,
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
            host_s=host_s,
            optimizer_s=optimizer_s,
            solver=SolverInfo(solution.status, solution.gap, solution.objective, solution.seconds, solution.backend, solution.variables,
                              constraints=solution.constraints, memory_bound=memory.total),
            fallbacks=tuple(cands.fallbacks),
            buckets=tuple(buckets),
            recompute=tuple(layer for g in groups if g.name in solution.recompute for layer in g.layers),
            alternatives=() if not options.alternatives else record_alternatives(
                # a neighbourhood search prices the candidates of its last neighbourhood; those the annotations removed stay listed
                graph, dataclasses.replace(cands, by_node=by_node), self.before_constraints, cands.by_node, choice, self.constraints,
                own_cost=lambda name, i: tables.unit_costs[rep[name]][i],
                move_cost=lambda ref, consumer, a, b: tables.move_time(graph.meta(ref), a, b, grad_flows(graph, ref, consumer)),
                memory=lambda node, s: node_memory(node, s, shape, options.optimizer, weight_cast=node.name in graph.weight_casts).total,
                memory_budget=self.budget,
            ),
        )


def with_walked_memory(plan: Plan, graph: Graph, optimizer: str) -> Plan:
    """`plan` whose `memory` is the liveness walk's peak (each stage's, for a pipelined plan) instead of the solver's sum."""
    if plan.pipeline is not None:
        return with_stage_memory(graph, plan, optimizer=optimizer)
    return dataclasses.replace(plan, memory=predict_peak(graph, plan, optimizer=optimizer).at_peak)


def _keep_budget(attempt, graph: Graph, budget: float, optimizer: str, mesh: MeshSpec, cluster: ClusterPreset) -> Plan:
    """The plan `attempt(row bound)` solves, whose walked peak keeps `budget`.

    The solver bounds a sum over nodes, which is neither above nor below the walked peak in general (frees and
    recomputation make it high; collective scratch and the optimizer step's temporaries make it low). So: solve under
    the budget, walk the plan, and while its peak is over, solve again with the row tightened by the overshoot (by
    ratio, and at least by the bytes). When no row tried gives a plan within the budget, the plan of the smallest row
    is the last resort: a budget below its walked peak is a `MemoryBudgetError` naming that peak, so a budget of that
    size always gives a plan. The math libraries' workspace (`DevicePreset.library_workspace_bytes`), which every plan
    holds alike, is outside the row: the row starts at the budget less it."""

    def walked(bound: float) -> Plan:
        return with_walked_memory(attempt(bound), graph, optimizer)

    workspace = cluster.device.library_workspace_bytes
    bound, smallest = budget - workspace, None
    for _ in range(MAX_TIGHTENINGS + 1):
        try:
            plan = walked(bound)
        except MemoryBudgetError as e:  # no plan within the row
            smallest = e.smallest
            break
        if plan.memory.total <= budget:
            return plan
        summed = plan.solver.memory_bound
        bound = min(summed * (budget - workspace) / max(plan.memory.total - workspace, 1), summed - (plan.memory.total - budget))
        log.info("mesh %s: walked peak %s breaks the budget %s; solving again with the memory row at %s", mesh,
                 format_bytes(plan.memory.total), format_bytes(budget), format_bytes(bound))
    if smallest is None:
        try:
            walked(-1.0)  # no plan has a negative row: the error says the smallest row there is
        except MemoryBudgetError as e:
            smallest = e.smallest
    plan = walked(smallest * (1 + 1e-9) + 1)  # the solver's own tolerance
    if plan.memory.total <= budget:
        return plan
    raise MemoryBudgetError(budget, plan.memory.total, mesh, cluster)


def _restrict(by_node: dict[str, list[Strategy]], subset: Subset | None) -> dict[str, list[Strategy]]:
    """Full candidate lists -> the lists `subset` keeps (all of them when None): index `i` of a node's list
    is index `subset[node][i]` of its full list."""
    return by_node if subset is None else {name: [by_node[name][i] for i in kept] for name, kept in subset.items()}


def _decode(graph: Graph, rep: dict[str, str], offload_from: OffloadOptions, solution: Solution) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """The solver's choice -> the candidates'. `solution.choice` is keyed by class representative (`rep`: tied
    repeated layers share one) and indexes the class's table lists, which `add_offload_options` extends with
    offloaded copies. Per node of `graph`: that table index (where `unit_costs` is read), the index into the
    candidate lists the solve saw (`OffloadOptions.decode`), and the set of nodes whose optimizer state is offloaded."""
    table_choice = {n.name: solution.choice[rep[n.name]] for n in graph.nodes}
    decoded = {name: offload_from.decode(rep[name], i) for name, i in table_choice.items()}
    return table_choice, {name: i for name, (i, _) in decoded.items()}, {name for name, (_, host) in decoded.items() if host}


def _to_full(choice: dict[str, int], subset: Subset | None) -> dict[str, int]:
    """Indices into the lists `subset` keeps (`_restrict`) -> indices into the full candidate lists."""
    return choice if subset is None else {name: subset[name][i] for name, i in choice.items()}


def _outer_merged(mesh: MeshSpec) -> list[tuple[int, ...]]:
    """The outer axes as one, the innermost on its own: a two-axis view of the mesh."""
    return [tuple(range(mesh.ndim - 1)), (mesh.ndim - 1,)]


def _starts(by_node: dict[str, list[Strategy]], mesh: MeshSpec, earlier: Sequence[Plan]) -> list[Subset]:
    """Where a neighbourhood search starts: each earlier plan that maps onto `mesh`, else the
    problem with the outer axes merged into one (a two-axis problem, solved exactly)."""
    starts = []
    for plan in earlier:
        groups = coarsening(mesh.shape, plan.mesh.shape)
        if groups is None or plan.pipeline is not None:
            continue
        known: dict[str, object] = {n.name: (n.strategy.inputs + n.strategy.outputs, n.strategy.kernel) for n in plan.nodes}
        known.update((p.node, p.layout) for p in plan.params)
        known.update((i.name, i.layout) for i in plan.inputs)
        starts.append(embedded(by_node, groups, known))
    return starts or [merged(by_node, _outer_merged(mesh))]


ENUMERATED_GROUPS = 3
"""Up to this many recompute groups, each choice of which recompute is solved with it fixed (2^groups solves)."""


def _solve_with_recompute(problem, options: PlanOptions):
    """Recomputation only adds time, so it can pay only when the fastest plan overall exceeds the
    budget: solve without it and without the budget first (the common case ends there, exactly).
    Otherwise each choice of recomputed groups is solved with that choice fixed, and the fastest kept: exact, and far
    quicker than one solve that decides recomputation too, whose linearisation ("this strategy and recompute") is
    weak (the one-node Llama-3-8B at 65k tokens on (2, 4): 90 s for that solve, 0.6 s for the fixed one, the same plan). Without
    recomputation the propagation plan is the solver's fallback start; when it breaks the budget, the plan of least
    memory is, if it fits (without a start inside the budget, a solve that runs out of time has nothing to return),
    and when that plan does not fit nothing without recomputation does."""
    start = _propagation_start(problem)
    if not problem.recompute or options.recompute == "always":
        return solve(problem, time_limit_s=options.time_limit_s, start=start)
    fastest = solve(dataclasses.replace(problem, recompute=[], memory_budget=None), time_limit_s=options.time_limit_s, start=start)
    if problem.memory_budget is None or fastest.memory <= problem.memory_budget:
        return fastest
    if len(problem.recompute) > ENUMERATED_GROUPS:
        return solve(problem, time_limit_s=options.time_limit_s, start=_start_within_budget(problem, start, options)[0])
    found: list[Solution] = []
    failed: list[Exception] = []
    for mask in range(2 ** len(problem.recompute) - 1, -1, -1):  # every group recomputed first
        groups = [dataclasses.replace(g, force=True) for i, g in enumerate(problem.recompute) if mask >> i & 1]
        fixed = dataclasses.replace(problem, recompute=groups)
        # a forced group takes no start (`solver._start_solution`); without recomputation, one within the budget
        fits, none_fits = (None, False) if groups else _start_within_budget(fixed, start, options)
        if none_fits:
            continue
        try:
            found.append(solve(fixed, time_limit_s=options.time_limit_s, start=fits))
        except (InfeasiblePlan, SolveTimeout) as e:
            failed.append(e)
    if found:
        return min(found, key=lambda s: s.objective)
    raise next((e for e in failed if isinstance(e, SolveTimeout)), failed[0])


def _start_within_budget(problem, start: dict[str, int] | None, options: PlanOptions) -> tuple[dict[str, int] | None, bool]:
    """(`start` if it fits the budget, else the plan of least memory without recomputation if that fits, else None;
    whether that least memory, solved to optimality, proves that nothing without recomputation fits)."""
    if start is not None and evaluate(problem, start)[1] <= problem.memory_budget:
        return start, False
    try:
        smallest = solve(dataclasses.replace(problem, recompute=[]), time_limit_s=options.time_limit_s, minimize="memory")
    except SolveTimeout:
        return None, False
    if smallest.memory <= problem.memory_budget:
        return smallest.choice, False
    return None, smallest.status == "optimal"


def _propagation_start(problem) -> dict[str, int] | None:
    """A consistent choice found without the solver, or None when propagation finds none."""
    try:
        return propagate(dataclasses.replace(problem, memory_budget=None)).choice
    except InfeasiblePlan:
        return None


def _grad_buckets(graph: Graph, params: list[ParamChoice], shape: tuple[int, ...], cluster: ClusterPreset) -> list[GradBucket]:
    """Fill buckets per set of sync axes in reverse parameter order (gradients of the last layers
    are ready first), closing one when it reaches `GRAD_BUCKET_BYTES`."""
    open_: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    closed: list[tuple[tuple[int, ...], list[tuple[str, int]]]] = []
    for p in reversed(params):
        if not p.grad_sync_axes:
            continue
        node = graph[p.node]
        nbytes = local_bytes(node.out, p.layout, shape)
        bucket = open_.setdefault(p.grad_sync_axes, [])
        bucket.append((p.node, nbytes))
        if sum(b for _, b in bucket) >= GRAD_BUCKET_BYTES:
            closed.append((p.grad_sync_axes, open_.pop(p.grad_sync_axes)))
    closed += list(open_.items())
    out = []
    for axes, members in closed:
        nbytes = sum(b for _, b in members)
        out.append(GradBucket(axes, tuple(n for n, _ in members), nbytes, bucket_time(nbytes, axes, shape, cluster)))
    return out
