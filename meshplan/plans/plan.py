"""The Plan: everything the planner decided, frozen, JSON round-trippable; data only.

Its reading methods (`summary()`, `str()`, `explain()`, `diff()`, `code()`, `report()`) belong to the
presentation layer, `meshplan/inspect/methods.py`, which `meshplan/__init__.py` attaches to the class.
The runtime reads nothing else. Its `collectives()` is the contract the runtime is tested against:
the collectives executed in one training step equal, in kind and count, the ones listed here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass

from meshplan.cost_model.memory import MemoryBreakdown
from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.graph import layer_of
from meshplan.ir.mesh import CP_AXIS, MeshSpec
from meshplan.ir.placement import Partial, Placements, Replicate, Shard, fmt, parse
from meshplan.ir.precision import MixedPrecision
from meshplan.ir.tensor_map import from_tensor_map, to_tensor_map
from meshplan.plans.alternatives import NodeAlternatives
from meshplan.plans.pipeline import PipelinePlan, decode_pipeline
from meshplan.plans.strategy import Strategy

SCHEMA_VERSION = 3
"""2: alternatives per node (explain), dtype and MindSpore tensor map per parameter, no solve time in the file.
3: a sharded kernel's own collectives (vocabulary-parallel log-softmax) are listed on its node, like every region op's."""


@dataclass(frozen=True, slots=True)
class NodeChoice:
    """The strategy chosen for one op node."""

    name: str
    target: str
    module_path: str
    strategy: Strategy
    time_s: float
    """Predicted compute seconds per step on one device (forward + backward)."""
    forward_comm: tuple[CommStep, ...] = ()
    """Collectives the op runs itself in forward (region ops, ir/regions.py: the moe op under expert
    parallelism, SyncBN, the vocabulary-parallel log-softmax); again in backward when its layer is recomputed."""
    backward_comm: tuple[CommStep, ...] = ()
    """Collectives the op runs itself in backward."""

    def collectives(self, recomputed: set[str]) -> list[str]:
        """'phase:kind' of each collective the op runs itself in one step, given the plan's recomputed layers."""
        again = self.forward_comm if layer_of(self.module_path) in recomputed else ()
        return _phased(self.forward_comm, self.backward_comm, again)


@dataclass(frozen=True, slots=True)
class Transfer:
    """A tensor resharded between its producer and one consumer."""

    tensor: str
    """The producer output (`node` or `node[i]`)."""
    consumer: str
    position: int
    """Which tensor input of the consumer."""
    src: Placements
    dst: Placements
    forward: tuple[CommStep, ...]
    backward: tuple[CommStep, ...]
    """Steps autograd runs for the gradient (empty when no gradient flows)."""
    time_s: float
    recompute: bool = False
    """The consumer's layer is recomputed: the forward steps run again during backward."""

    def collectives(self) -> list[str]:
        """'phase:kind' of each collective of this move in one step."""
        return _phased(self.forward, self.backward, self.forward if self.recompute else ())


@dataclass(frozen=True, slots=True)
class ParamChoice:
    """Where one parameter (or buffer) lives and how its gradient is synchronised."""

    node: str
    fqns: tuple[str, ...]
    shape: tuple[int, ...]
    layout: Placements
    grad_sync_axes: tuple[int, ...]
    """Mesh axes over which the gradient is all-reduced after backward (one collective)."""
    is_buffer: bool
    time_s: float
    dtype: str = "float32"
    offload: bool = False
    """Optimizer state and fp32 master copy live in host memory; the step runs there (runtime/offload.py)."""
    optimizer_s: float = 0.0
    """Seconds of its `optimizer.step()` on the device, on its local shard (0 when offloaded: the host steps it)."""
    view_s: float = 0.0
    """Seconds per forward + backward the runtime spends reading it as a DTensor (`runtime.local_view`): trainable
    parameters of plans whose parameters are DTensors (`Plan.plain_params` false); part of `Plan.compute_s`."""


@dataclass(frozen=True, slots=True)
class GradBucket:
    """Gradients all-reduced together in one collective once all of them are ready (as DDP's buckets)."""

    axes: tuple[int, ...]
    """Mesh axes the all-reduce spans (where these parameters are replicated)."""
    params: tuple[str, ...]
    """Parameter nodes, in the order their gradients are expected (reverse of first use)."""
    nbytes: int
    """Bytes of the flattened bucket on one device."""
    time_s: float


@dataclass(frozen=True, slots=True)
class InputChoice:
    """Layout of one user input: in `inputs="local"` mode, the slice each rank loads."""

    name: str
    shape: tuple[int, ...]
    layout: Placements


@dataclass(frozen=True, slots=True)
class SolverInfo:
    status: str
    gap: float
    objective_s: float
    seconds: float | None = dataclasses.field(compare=False)
    """Wall time of the solve; None for a plan read from a file (timing is not part of the plan)."""
    backend: str
    variables: int
    skipped: tuple[str, ...] = ()
    """Meshes of the mesh search that gave no plan, each with why ('mesh (2, 2, 2): ...')."""
    constraints: int = dataclasses.field(default=0, compare=False)
    """Rows of the MIP (of its last solve, for a neighbourhood search); like `seconds`, not in the plan file."""
    memory_bound: float = 0.0
    """Bytes per device the solver's memory row counted for this plan (a per-node sum; `Plan.memory` is the walked peak)."""

    @property
    def proven_optimal(self) -> bool:
        return self.status == "optimal"


def keeps_plain(params) -> bool:
    """`Plan.plain_params` of these `ParamChoice`s."""
    return all(all(isinstance(q, Replicate) for q in p.layout) and not p.offload for p in params)


@dataclass(frozen=True, slots=True)
class Plan:
    """How a model runs on a mesh: layouts, collectives, and their predicted cost (reading methods: inspect/methods.py)."""

    model: str
    graph_fingerprint: str
    mesh: MeshSpec
    mode: str
    inputs_mode: str
    cluster: str
    nodes: tuple[NodeChoice, ...]
    transfers: tuple[Transfer, ...]
    params: tuple[ParamChoice, ...]
    inputs: tuple[InputChoice, ...]
    memory: MemoryBreakdown
    compute_s: float
    comm_s: float
    solver: SolverInfo
    fallbacks: tuple[str, ...] = ()
    buckets: tuple[GradBucket, ...] = ()
    """Gradient all-reduce buckets, launched in this order during backward."""
    alternatives: tuple[NodeAlternatives, ...] = ()
    """Per parameter, input and costly op: the other candidates and what ruled some out (`explain`)."""
    host_s: float = 0.0
    """Seconds per step of offloaded optimizer state: gradients down, the host step, parameters up."""
    optimizer_s: float = 0.0
    """Seconds of `optimizer.step()` on the device over its local parameters (offloaded ones step
    on the host: `host_s`); the sum of `ParamChoice.optimizer_s`. With a pipeline it is one stage
    sub-mesh's figure for the whole model, like `compute_s`; the pipeline's step counts each
    device's own parameters."""
    recompute: tuple[str, ...] = ()
    """Layers whose activations are recomputed in backward (each runs under torch.utils.checkpoint)."""
    pipeline: PipelinePlan | None = None
    """Pipeline stages, schedule and microbatches; None for a single stage. With a pipeline, `mesh` is
    one stage's sub-mesh and the world is `pipeline.degree * mesh.size` devices (plans/pipeline.py)."""
    precision: MixedPrecision | None = None
    """The mixed-precision policy the traced program carries (ir/precision.py); None: the model's own dtypes."""
    model_flops: float = 0.0
    """Model FLOPs of one training step, whole batch (cost_model/model_flops.py); 0: not recorded."""
    peak_flops: float = 0.0
    """One device's peak FLOP/s in the dtype the model computes in (the cluster preset's)."""
    token_order: bool = False
    """Every tensor split over the `cp` mesh axis is held in head-tail token order (runtime/token_order.py): the
    inputs are sliced so, every move on that axis keeps it, and causal attention runs balanced without exchanging
    queries (`PlanOptions.token_order`)."""
    version: int = SCHEMA_VERSION

    # ------------------------------------------------------------ queries

    @property
    def bubble_s(self) -> float:
        """Pipeline bubble per step (0 with a single stage)."""
        return self.pipeline.bubble_s if self.pipeline else 0.0

    @property
    def step_time_s(self) -> float:
        """With a pipeline: the schedule's step over all microbatches (compute_s and comm_s are one microbatch's)."""
        if self.pipeline:
            return self.pipeline.step_s
        return self.compute_s + self.comm_s + self.host_s + self.optimizer_s

    @property
    def head_tail_axis(self) -> int | None:
        """The mesh axis whose splits the plan holds in head-tail token order (`token_order`: its `cp` axis), or None."""
        return self.mesh.axis_names.index(CP_AXIS) if self.token_order else None

    def move_order_axis(self, tensor: str, param_values: frozenset[str]) -> int | None:
        """The mesh axis a move of `tensor` (`Transfer.tensor`: `node` or `node[i]`) cuts and joins in head-tail token
        order: `head_tail_axis`, but none for a parameter's value (`Graph.param_values`), split in contiguous blocks."""
        return None if tensor.split("[", 1)[0] in param_values else self.head_tail_axis

    @property
    def plain_params(self) -> bool:
        """Every parameter and buffer whole on every rank, none offloaded: the runtime keeps them plain tensors
        (as DDP does); otherwise all of them are DTensors, and their optimizer step pays DTensor's dispatch."""
        return keeps_plain(self.params)

    @property
    def devices(self) -> int:
        return self.mesh.size * (self.pipeline.degree if self.pipeline else 1)

    @property
    def peak_memory(self) -> MemoryBreakdown:
        """The fullest device's memory at its peak: `memory`, or with a pipeline the fullest pipeline rank's (the sum of
        the stages it runs). Every reading of the plan (summary, explain, diff, report, the file's `peak_bytes`) uses it."""
        return max(self.pipeline.rank_memory(), key=lambda m: m.total) if self.pipeline else self.memory

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation of the predicted step: model FLOPs / (devices x peak x step time)."""
        if not self.model_flops or not self.peak_flops or self.step_time_s <= 0:
            return None
        return self.model_flops / (self.devices * self.peak_flops * self.step_time_s)

    def value_layouts(self) -> dict[str, tuple[Placements | None, ...]]:
        """Node -> the layouts its values are made in: each op's outputs, each parameter's, buffer's and input's."""
        out = {n.name: n.strategy.outputs for n in self.nodes}
        out.update({p.node: (p.layout,) for p in self.params})
        out.update({i.name: (i.layout,) for i in self.inputs})
        return out

    def strategy_of(self, node: str) -> Strategy:
        for n in self.nodes:
            if n.name == node:
                return n.strategy
        raise KeyError(f"plan has no op node {node!r}")

    def collectives(self, *, include_grad_sync: bool = True) -> Counter:
        """Collectives of one training step: Counter of 'forward:all_gather', 'backward:all_reduce', ..."""
        c: Counter = Counter()
        recomputed = set(self.recompute)
        for n in self.nodes:
            c.update(n.collectives(recomputed))
        for t in self.transfers:
            c.update(t.collectives())
        if include_grad_sync:
            c.update("grad_sync:all_reduce" for _ in self.buckets)
        return c

    def hash(self) -> str:
        """Identifies the plan (its file contents, which leave out timing): ranks compare it before their first collective."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        """The strategy file: deterministic (no timing), so planning twice gives identical bytes."""
        d = _encode(self)
        d["memory"] = self.memory.to_dict()
        if self.precision is None:
            del d["precision"]  # plans in the model's own dtypes keep the bytes they always had
        if self.pipeline is None:
            del d["pipeline"]  # so do plans without a pipeline
        else:
            for entry, st in zip(d["pipeline"]["stages"], self.pipeline.stages):
                entry["memory"] = st.memory.to_dict()
                if st.idle is None:
                    del entry["idle"]  # plans of one stage per rank keep the bytes they always had
                else:
                    entry["idle"] = st.idle.to_dict()
        if not self.token_order:
            del d["token_order"]  # and plans in the contiguous order
        del d["solver"]["seconds"], d["solver"]["constraints"]
        if not self.solver.skipped:
            del d["solver"]["skipped"]  # plans of a single mesh keep the bytes they always had
        for entry, p in zip(d["params"], self.params):
            entry["device_matrix"], entry["tensor_map"] = to_tensor_map(p.layout, self.mesh.shape, len(p.shape))
        # derived, for readers of the file alone: the figures `show` prints (files without them load the same)
        d["step_time_s"], d["peak_bytes"] = self.step_time_s, self.peak_memory.total
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> Plan:
        """Parse and check a plan file; anything wrong with it is a ValueError naming the field."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise ValueError(f"a plan is read from JSON text; got {type(text).__name__}")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"plan file is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
        unlisted = _kernels_without_comm(d) if isinstance(d, dict) and d.get("version") == 2 else []
        if isinstance(d, dict) and d.get("version") == 2 and not unlisted:
            d = {**d, "version": SCHEMA_VERSION}  # version 3 only adds what a version-2 plan without such kernels lacks
        if not isinstance(d, dict) or d.get("version") != SCHEMA_VERSION:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            why = f" (it runs {', '.join(unlisted)} without listing their collectives: plan again)" if unlisted else ""
            raise ValueError(f"plan schema version {got!r} is not supported{why}; this meshplan reads version {SCHEMA_VERSION}")
        try:
            plan = _decode_plan(d)
        except KeyError as e:
            raise ValueError(f"plan file is malformed: missing field {e.args[0]!r}") from None
        except Exception as e:  # noqa: BLE001 - untrusted input: every decoding failure is the file's fault
            raise ValueError(f"plan file is malformed: {type(e).__name__}: {str(e)[:200]}") from None
        from meshplan.plans.check import check_plan

        check_plan(plan)
        _check_tensor_maps(d, plan)
        _check_figures(d, plan)
        return plan

    def save(self, path: str) -> None:
        """Write the strategy file (`meshplan.load_plan` reads it back for the same model)."""
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    def __repr__(self) -> str:
        return f"Plan(model={self.model!r}, mesh={self.mesh!r}, hash={self.hash()!r}, step_time_s={self.step_time_s:.3e})"


def _phased(forward: tuple[CommStep, ...], backward: tuple[CommStep, ...], again: tuple[CommStep, ...]) -> list[str]:
    """'forward:kind', 'backward:kind' and 'recompute:kind' of the steps that communicate."""
    return [f"{phase}:{s.kind}" for phase, steps in (("forward", forward), ("backward", backward), ("recompute", again))
            for s in steps if s.communicates]


def _kernels_without_comm(d: dict) -> list[str]:
    """Nodes of a version-2 plan file whose sharded kernel communicates (vocabulary-parallel log-softmax)
    but, as version 2 did, lists no collectives on the node."""
    nodes = d.get("nodes") if isinstance(d.get("nodes"), list) else []
    return [str(n.get("name")) for n in nodes if isinstance(n, dict) and isinstance(n.get("strategy"), dict)
            and str(n["strategy"].get("kernel", "")).startswith("log_softmax") and not n.get("forward_comm")]


def _encode(obj):
    if isinstance(obj, Strategy):
        return obj.to_json()
    if isinstance(obj, tuple) and obj and all(isinstance(p, (Shard, Replicate, Partial)) for p in obj):
        return fmt(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_encode(x) for x in obj]
    return obj


def _decode_plan(d: dict) -> Plan:
    def seq(xs) -> tuple:  # a JSON list, never a string split into characters
        if not isinstance(xs, list):
            raise TypeError(f"expected a list, got {xs!r:.60}")
        return tuple(xs)

    steps = lambda xs: tuple(CommStep(**s) for s in seq(xs))  # noqa: E731
    return Plan(
        model=d["model"],
        graph_fingerprint=d["graph_fingerprint"],
        mesh=MeshSpec(seq(d["mesh"]["shape"]), seq(d["mesh"]["axis_names"])),
        mode=d["mode"],
        inputs_mode=d["inputs_mode"],
        cluster=d["cluster"],
        nodes=tuple(
            NodeChoice(
                n["name"], n["target"], n["module_path"], Strategy.from_json(n["strategy"]), n["time_s"],
                steps(n.get("forward_comm", [])), steps(n.get("backward_comm", [])),
            )
            for n in d["nodes"]
        ),
        transfers=tuple(
            Transfer(
                t["tensor"], t["consumer"], t["position"], parse(t["src"]), parse(t["dst"]), steps(t["forward"]), steps(t["backward"]), t["time_s"],
                recompute=t.get("recompute", False),
            )
            for t in d["transfers"]
        ),
        params=tuple(_decode_param(p, seq) for p in seq(d["params"])),
        inputs=tuple(InputChoice(i["name"], seq(i["shape"]), parse(i["layout"])) for i in seq(d["inputs"])),
        memory=MemoryBreakdown.from_dict(d["memory"]),
        compute_s=d["compute_s"],
        comm_s=d["comm_s"],
        host_s=d.get("host_s", 0.0),
        optimizer_s=d.get("optimizer_s", 0.0),
        solver=SolverInfo(**{**d["solver"], "skipped": seq(d["solver"].get("skipped", []))}, seconds=None),
        fallbacks=seq(d["fallbacks"]),
        buckets=tuple(GradBucket(seq(b["axes"]), seq(b["params"]), b["nbytes"], b["time_s"]) for b in seq(d["buckets"])),
        alternatives=tuple(NodeAlternatives.from_dict(a) for a in seq(d["alternatives"])),
        recompute=seq(d.get("recompute", [])),
        pipeline=decode_pipeline(d.get("pipeline")),
        precision=MixedPrecision.from_dict(d["precision"]) if "precision" in d else None,
        model_flops=d.get("model_flops", 0.0),
        peak_flops=d.get("peak_flops", 0.0),
        token_order=d.get("token_order", False),
        version=d["version"],
    )


def _decode_param(p: dict, seq) -> ParamChoice:
    return ParamChoice(
        p["node"], seq(p["fqns"]), seq(p["shape"]), parse(p["layout"]), seq(p["grad_sync_axes"]), p["is_buffer"], p["time_s"], dtype=p["dtype"],
        offload=p.get("offload", False), optimizer_s=p.get("optimizer_s", 0.0), view_s=p.get("view_s", 0.0),
    )


def _check_figures(d: dict, plan: Plan) -> None:
    """The stored step time and peak are derived too: a file whose figures disagree with its parts was edited wrongly."""
    for key, value in (("step_time_s", plan.step_time_s), ("peak_bytes", plan.peak_memory.total)):
        stored = d.get(key, value)  # absent in files written before the figures were stored
        if isinstance(stored, bool) or not isinstance(stored, (int, float)) or not math.isclose(stored, value, rel_tol=1e-9):
            raise ValueError(f"plan file is malformed: {key} {stored!r:.60} does not match the plan's own figure {value!r}")


def _check_tensor_maps(d: dict, plan: Plan) -> None:
    """The MindSpore form is derived data: a file whose two forms disagree was edited by hand, wrongly."""
    for i, (entry, p) in enumerate(zip(d["params"], plan.params)):
        dm, tmap = entry.get("device_matrix"), entry.get("tensor_map")
        try:
            ok = list(dm) == list(plan.mesh.shape) and from_tensor_map(
                tuple(dm), tuple(tuple(e) if isinstance(e, list) else e for e in tmap)
            ) == p.layout
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"plan file is malformed: params[{i}] ({p.fqns[0]}) device_matrix {dm!r} / tensor_map {tmap!r} do not match "
                f"layout {fmt(p.layout)} on mesh {list(plan.mesh.shape)}"
            )
