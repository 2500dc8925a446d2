"""The Plan: everything the planner decided, frozen, printable, JSON round-trippable.

The runtime reads nothing else. Its `collectives()` is the contract the runtime is tested against:
the collectives executed in one training step equal, in kind and count, the ones listed here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections import Counter
from dataclasses import dataclass

from meshplan.cost_model.memory import MemoryBreakdown, format_bytes
from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Placements, fmt, parse
from meshplan.planner.strategy import Strategy

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class NodeChoice:
    """The strategy chosen for one op node."""

    name: str
    target: str
    module_path: str
    strategy: Strategy
    time_s: float
    """Predicted compute seconds per step on one device (forward + backward)."""


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
    seconds: float
    backend: str
    variables: int


@dataclass(frozen=True, slots=True)
class Plan:
    """How a model runs on a mesh: layouts, collectives, and their predicted cost."""

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
    version: int = SCHEMA_VERSION

    # ------------------------------------------------------------ queries

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.comm_s

    def strategy_of(self, node: str) -> Strategy:
        for n in self.nodes:
            if n.name == node:
                return n.strategy
        raise KeyError(f"plan has no op node {node!r}")

    def collectives(self, *, include_grad_sync: bool = True) -> Counter:
        """Collectives of one training step: Counter of 'forward:all_gather', 'backward:all_reduce', ..."""
        c: Counter = Counter()
        for t in self.transfers:
            c.update(f"forward:{s.kind}" for s in t.forward if s.communicates)
            c.update(f"backward:{s.kind}" for s in t.backward if s.communicates)
        if include_grad_sync:
            c.update("grad_sync:all_reduce" for _ in self.buckets)
        return c

    def hash(self) -> str:
        """Identifies the plan (all but how long the solve took): ranks compare it before their first collective."""
        d = self.to_dict()
        d["solver"] = {k: v for k, v in d["solver"].items() if k != "seconds"}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        d = _encode(self)
        d["memory"] = self.memory.to_dict()
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
        if not isinstance(d, dict) or d.get("version") != SCHEMA_VERSION:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"plan schema version {got!r} is not supported; this meshplan reads version {SCHEMA_VERSION}")
        try:
            plan = _decode_plan(d)
        except KeyError as e:
            raise ValueError(f"plan file is malformed: missing field {e.args[0]!r}") from None
        except Exception as e:  # noqa: BLE001 - untrusted input: every decoding failure is the file's fault
            raise ValueError(f"plan file is malformed: {type(e).__name__}: {str(e)[:200]}") from None
        from meshplan.planner.plan_check import check_plan

        check_plan(plan)
        return plan

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    # ------------------------------------------------------------ printing

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        con = Console(file=buf, width=120, no_color=True, highlight=False)
        con.print(
            f"meshplan plan for {self.model} on mesh {self.mesh} ({self.mesh.size} devices, cluster {self.cluster}), "
            f"mode {self.mode}, inputs {self.inputs_mode}"
        )
        con.print(
            f"predicted step {self.step_time_s * 1e3:.3f} ms = compute {self.compute_s * 1e3:.3f} ms + "
            f"communication {self.comm_s * 1e3:.3f} ms; memory/device {self.memory}"
        )
        con.print(f"solver {self.solver.backend} {self.solver.status} (gap {self.solver.gap:.2%}) in {self.solver.seconds:.2f} s")
        coll = self.collectives()
        con.print("collectives per step: " + (", ".join(f"{k} x{v}" for k, v in sorted(coll.items())) or "none"))
        if self.fallbacks:
            con.print("replicated for lack of a rule: " + "; ".join(self.fallbacks))
        con.print("inputs: " + ", ".join(f"{i.name}{list(i.shape)} {fmt(i.layout)}" for i in self.inputs))

        params = Table(title="parameters", title_justify="left")
        for col in ("parameter", "shape", "layout", "grad sync"):
            params.add_column(col)
        for p in self.params:
            sync = "-" if not p.grad_sync_axes else "all_reduce over " + ",".join(self.mesh.axis_names[a] for a in p.grad_sync_axes)
            params.add_row(" = ".join(p.fqns), str(list(p.shape)), fmt(p.layout), "buffer" if p.is_buffer else sync)
        con.print(params)

        moves: dict[str, list[Transfer]] = {}
        for t in self.transfers:
            moves.setdefault(t.consumer, []).append(t)
        ops = Table(title="ops (compute ops and every op whose inputs move)", title_justify="left")
        for col in ("module", "op", "strategy", "collectives fwd | bwd", "ms"):
            ops.add_column(col)
        for n in self.nodes:
            ts = moves.get(n.name, [])
            if not ts and n.time_s < 0.01 * max(self.compute_s, 1e-12):
                continue
            fwd = " ".join(str(s) for t in ts for s in t.forward)
            bwd = " ".join(str(s) for t in ts for s in t.backward)
            ops.add_row(n.module_path or "-", n.target.removeprefix("aten."), str(n.strategy), f"{fwd or '-'} | {bwd or '-'}", f"{n.time_s * 1e3:.3f}")
        out_moves = moves.get("output", [])
        if out_moves:
            ops.add_row("(output)", "gather to user", "", " ".join(str(s) for t in out_moves for s in t.forward), "")
        con.print(ops)
        return buf.getvalue().rstrip()

    def __repr__(self) -> str:
        return f"Plan(model={self.model!r}, mesh={self.mesh!r}, hash={self.hash()!r}, step_time_s={self.step_time_s:.3e})"


def _encode(obj):
    if isinstance(obj, Strategy):
        return obj.to_json()
    if isinstance(obj, tuple) and obj and all(hasattr(p, "__dataclass_fields__") and type(p).__name__ in ("Shard", "Replicate", "Partial") for p in obj):
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
        nodes=tuple(NodeChoice(n["name"], n["target"], n["module_path"], Strategy.from_json(n["strategy"]), n["time_s"]) for n in d["nodes"]),
        transfers=tuple(
            Transfer(t["tensor"], t["consumer"], t["position"], parse(t["src"]), parse(t["dst"]), steps(t["forward"]), steps(t["backward"]), t["time_s"])
            for t in d["transfers"]
        ),
        params=tuple(
            ParamChoice(p["node"], seq(p["fqns"]), seq(p["shape"]), parse(p["layout"]), seq(p["grad_sync_axes"]), p["is_buffer"], p["time_s"])
            for p in d["params"]
        ),
        inputs=tuple(InputChoice(i["name"], seq(i["shape"]), parse(i["layout"])) for i in d["inputs"]),
        memory=MemoryBreakdown.from_dict(d["memory"]),
        compute_s=d["compute_s"],
        comm_s=d["comm_s"],
        solver=SolverInfo(**d["solver"]),
        fallbacks=seq(d["fallbacks"]),
        buckets=tuple(GradBucket(seq(b["axes"]), seq(b["params"]), b["nbytes"], b["time_s"]) for b in seq(d["buckets"])),
        version=d["version"],
    )
