"""Measured costs: the profile database that planning reads (JSON, never pickle).

A `Profile` holds what `meshplan profile compute` and `meshplan profile comm` measured on one
device kind with one torch version:

- op times: forward and backward seconds of each distinct (op, local input/output shapes, dtype);
- collective fits: alpha + bytes * beta per (collective kind, group size, world size), from
  timings over a range of message sizes, measured the way the runtime issues them;
- contention: how much slower a rank's compute gets when `world` ranks run at once (on a CPU
  whose cores the ranks share, e.g. 4 ranks on 2 cores, this is about 2);
- pipeline action overhead: seconds the pipelining runtime spends per schedule action at `world` ranks;
- DTensor optimizer overhead: what an optimizer step costs more per parameter that is a DTensor;
- copy and op-overhead rates used for the runtime's local copies and for ops not profiled.

Planning attaches a profile to a cluster preset (`ClusterPreset.with_profile`); the cost functions
in `estimate.py` use a measurement where one exists and the preset's roofline / ring model
elsewhere. Profiles live in files keyed by device name and torch version (`profile_path`), by
default under `$MESHPLAN_PROFILE_DIR` or `~/.cache/meshplan/profiles`.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from meshplan.cost_model.line_fit import nonnegative_line
from meshplan.ir.graph import TensorMeta

log = logging.getLogger("meshplan")

FORMAT = "meshplan-profile"
VERSION = 1
PROFILE_DIR_ENV = "MESHPLAN_PROFILE_DIR"
LOCAL = "local"
"""`profile="local"`: the database entry for this machine's device and torch version."""


def axis_label(mesh_shape: tuple[int, ...], axis: int) -> str:
    """How a collective fit names the mesh axis it was measured on, e.g. `2x2 axis 1`."""
    return f"{'x'.join(map(str, mesh_shape))} axis {axis}"


def torch_version() -> str:
    """`2.13.0+cpu` -> `2.13.0`: the build suffix does not change op semantics, the release does."""
    return torch.__version__.split("+", 1)[0]


def device_name(device: str | torch.device | None = None) -> str:
    """What a profile is keyed by: the GPU's marketing name, or the CPU model and core count."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            model = m.group(1).strip()
    except OSError:
        pass
    return f"cpu {model} x{os.cpu_count()}"


def op_key(target: str, inputs: Sequence[TensorMeta | None], outputs: Sequence[TensorMeta | None]) -> str:
    """`aten.mm.default(float32[8,64],float32[64,64])->float32[8,64]`: an op on local shapes."""
    ins = ",".join("-" if m is None else str(m) for m in inputs)
    outs = ",".join("-" if m is None else str(m) for m in outputs)
    return f"{target}({ins})->{outs}"


@dataclass(frozen=True, kw_only=True, slots=True)
class OpTiming:
    """Median seconds of one op on local shapes."""

    forward_s: float
    backward_s: float | None = None
    """None when the op was timed without gradients (nothing it reads needs one)."""
    runs: int = 0
    """Timed repetitions the medians are over (after warm-up)."""
    host_forward_s: float | None = None
    """Timed with the launch hidden (`op_profiler.Timer`, CUDA): forward_s and backward_s are the kernels alone and
    these the host's seconds issuing them; None when not timed so."""
    host_backward_s: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    """time(bytes) = alpha_s + bytes * seconds_per_byte for one collective on one group."""

    kind: str
    """all_reduce | all_gather | reduce_scatter | all_to_all | send_recv."""
    group: int
    """Ranks in the collective's group (the mesh axis size)."""
    world: int
    """Ranks running at once when it was measured (other groups of the mesh run theirs concurrently)."""
    alpha_s: float
    seconds_per_byte: float
    sizes: tuple[int, ...] = ()
    """Message sizes measured (bytes of the full tensor, as `collective_time` counts them)."""
    times: tuple[float, ...] = ()
    """Median seconds at each size."""
    axis: str = ""
    """Which mesh axis it was measured on, e.g. `2x2 axis 1`."""

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.seconds_per_byte


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Measurements for one device kind and torch version (see the module docstring)."""

    device: str
    """`device_name()` where it was measured."""
    torch_version: str
    cluster: str
    """The cluster preset it calibrates (`"cpu"`, `"h100"`, ...): used for whatever was not measured."""
    threads: int = 1
    """Intra-op threads per rank during the op timings."""
    ops: Mapping[str, OpTiming] = field(default_factory=dict)
    """`op_key(...)` -> timing."""
    collectives: tuple[CollectiveFit, ...] = ()
    contention: Mapping[int, float] = field(default_factory=dict)
    """world size -> factor by which per-rank compute slows when that many ranks run together."""
    copy_seconds_per_byte: float | None = None
    """Local copy rate (bytes written): prices the runtime's chunk/cat/stack copies around collectives."""
    op_overhead_s: float | None = None
    """Forward seconds of a tiny op: the floor added to the roofline of ops that were not profiled."""
    backend: str = ""
    """Process-group backend of the collective fits (gloo, nccl)."""
    optimizer_steps: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """optimizer name -> (seconds per parameter tensor, seconds per element) of `optimizer.step()`."""
    node_overhead_s: float | None = None
    """Seconds a whole program spends per op it runs (forward, and again in backward where gradients
    flow) beyond the ops' isolated timings: the model's one-device program, timed forward + backward,
    minus the sum of its ops' profiles, over the ops it ran. It is the per-op work of a real step
    that timing one op at a time misses (autograd's graph and engine, Python between ops,
    allocator and cache state). With `program_overheads` of two programs of different sizes or more, an op is priced by
    `overhead_line` instead."""
    program_overheads: tuple[tuple[float, float], ...] = ()
    """Per program measured: (its ops' mean isolated seconds per run, its `node_overhead_s`). `overhead_line` is
    fitted through them."""
    host_op_run_s: float | None = None
    """On a GPU, the host's seconds per op run issuing the same one-device program (its median host time over the
    ops it ran): an op's price is at least its runs' share of it (`estimate.profiled_seconds`), since a step whose
    kernels are short waits for the host that issues them. None on a CPU, where an op's timing is its host's work."""

    pipeline_action_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """schedule -> world size -> seconds the pipelining runtime spends per schedule action (one stage's forward or
    backward of one microbatch) beyond the stage's work and sends (profiling/pipeline_overhead.py)."""
    pipeline_step_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """schedule -> world size -> seconds the pipelining runtime spends once per step outside its actions (splitting
    the batch into microbatches, starting and ending the schedule), measured with `pipeline_action_s`."""
    dtensor_optimizer_s: Mapping[str, float] = field(default_factory=dict)
    """optimizer name -> extra seconds of `optimizer.step()` per parameter that is a DTensor (torch's foreach
    ops dispatch through DTensor; the runtime keeps plain parameters only where every one is replicated)."""
    dtensor_view_s: float | None = None
    """Extra seconds per trainable parameter of each forward + backward when it is a DTensor: the per-rank program
    reads it through `runtime.local_view` and its gradient arrives as a DTensor (`op_profiler.dtensor_view_overhead`)."""
    overhead_line: tuple[float, float] = field(init=False, repr=False, compare=False, default=(0.0, 0.0))
    """(a, r): an op run of t isolated seconds pays a + r t of in-program overhead (`estimate.profiled_seconds`). The
    least-squares line through `program_overheads`, each program's overhead per op run against its ops' mean isolated
    seconds per run, neither coefficient below zero; with fewer than two program sizes, (`node_overhead_s`, 0). Summed
    over a measured program's ops, the line gives that program's overhead per run at its mean. Measured on one
    process, the overhead is neither a fixed cost per op run nor a share of each op's time alone: the medium fidelity
    GPT's program ran 2.1-2.8x its ops' isolated sum at batch 16, 8, 4 and 2 alike (133-143, 56-66, 32-33, 20-27 us
    per op run) in an hour when 2026-11-27's ran 1.1-1.2x (docs/cost_model.md)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", MappingProxyType(dict(self.ops)))
        object.__setattr__(self, "program_overheads", tuple((float(x), float(y)) for x, y in self.program_overheads))
        object.__setattr__(self, "overhead_line", _fitted_line(self.program_overheads, self.node_overhead_s))
        object.__setattr__(self, "contention", MappingProxyType({int(k): float(v) for k, v in self.contention.items()}))
        for name in ("pipeline_action_s", "pipeline_step_s"):
            by_schedule = {str(k): MappingProxyType({int(w): float(x) for w, x in v.items()}) for k, v in getattr(self, name).items()}
            object.__setattr__(self, name, MappingProxyType(by_schedule))
        object.__setattr__(self, "dtensor_optimizer_s", MappingProxyType({k: float(v) for k, v in self.dtensor_optimizer_s.items()}))
        object.__setattr__(self, "optimizer_steps", MappingProxyType({k: (float(a), float(b)) for k, (a, b) in self.optimizer_steps.items()}))

    # ---------------------------------------------------------------- lookups the cost model uses

    def op(self, target: str, inputs: Sequence[TensorMeta | None], outputs: Sequence[TensorMeta | None]) -> OpTiming | None:
        return self.ops.get(op_key(target, inputs, outputs))

    def slowdown(self, world: float) -> float:
        """Compute contention at `world` ranks (a pipeline's average count of ranks computing at once may be
        fractional): measured, else linear between the two measured worlds around it, else the nearest smaller
        measured world, else 1."""
        below = [w for w in self.contention if w <= world]
        above = [w for w in self.contention if w > world]
        if below and above:
            lo, hi = max(below), min(above)
            return self.contention[lo] + (self.contention[hi] - self.contention[lo]) * (world - lo) / (hi - lo)
        return self.contention[max(below)] if below else 1.0

    def pipeline_action(self, world: int, schedule: str) -> float:
        """Seconds per action of `schedule` at `world` ranks: measured, else the nearest smaller measured world, else 0;
        a schedule not measured takes 1F1B's (profiles before 2026-11-26 measured only 1F1B)."""
        return _at_world(_of_schedule(self.pipeline_action_s, schedule), world, 0.0)

    def pipeline_step(self, world: int, schedule: str) -> float:
        """Seconds per step of `schedule` outside its actions at `world` ranks, found as `pipeline_action`."""
        return _at_world(_of_schedule(self.pipeline_step_s, schedule), world, 0.0)

    def collective(self, kind: str, group: int, world: int, axis: str = "") -> CollectiveFit | None:
        """The fit for `kind` on groups of `group` ranks: measured on this mesh axis (`axis_label`)
        if possible, else at this world size (the latest measured mesh), else the nearest world."""
        fits = [f for f in self.collectives if f.kind == kind and f.group == group]
        if not fits:
            return None
        exact = [f for f in fits if axis and f.axis == axis and f.world == world]
        if exact:
            return exact[-1]
        nearest = min(abs(f.world - world) for f in fits)
        # of the nearest worlds the larger one, and of its fits the latest measured (a 2-D mesh)
        return max(((f.world, i), f) for i, f in enumerate(fits) if abs(f.world - world) == nearest)[1]

    # ---------------------------------------------------------------- combining and checking

    def merged(self, other: Profile) -> Profile:
        """This profile with `other`'s measurements added (other wins where both measured)."""
        self.check_compatible(other.device, other.torch_version)
        keep = [f for f in self.collectives
                if not any((f.kind, f.group, f.world, f.axis) == (g.kind, g.group, g.world, g.axis) for g in other.collectives)]
        return replace(
            self,
            ops={**self.ops, **other.ops},
            collectives=tuple(keep) + other.collectives,
            contention={**self.contention, **other.contention},
            pipeline_action_s=_merged_by_schedule(self.pipeline_action_s, other.pipeline_action_s),
            pipeline_step_s=_merged_by_schedule(self.pipeline_step_s, other.pipeline_step_s),
            dtensor_optimizer_s={**self.dtensor_optimizer_s, **other.dtensor_optimizer_s},
            dtensor_view_s=other.dtensor_view_s if other.dtensor_view_s is not None else self.dtensor_view_s,
            optimizer_steps={**self.optimizer_steps, **other.optimizer_steps},
            copy_seconds_per_byte=other.copy_seconds_per_byte or self.copy_seconds_per_byte,
            op_overhead_s=other.op_overhead_s or self.op_overhead_s,
            node_overhead_s=other.node_overhead_s if other.node_overhead_s is not None else self.node_overhead_s,
            program_overheads=tuple(p for p in self.program_overheads if p[0] not in dict(other.program_overheads))
            + other.program_overheads,
            host_op_run_s=other.host_op_run_s if other.host_op_run_s is not None else self.host_op_run_s,
            backend=other.backend or self.backend,
            threads=other.threads if other.ops else self.threads,
        )

    def check_compatible(self, device: str, version: str) -> None:
        if device != self.device or version != self.torch_version:
            raise ValueError(
                f"profile measured on {self.device!r} with torch {self.torch_version} cannot be combined with or used as "
                f"{device!r} with torch {version}; allowed: measurements of the same device and torch version"
            )

    # ---------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "device": self.device,
            "torch_version": self.torch_version,
            "cluster": self.cluster,
            "threads": self.threads,
            "backend": self.backend,
            "copy_seconds_per_byte": self.copy_seconds_per_byte,
            "op_overhead_s": self.op_overhead_s,
            "node_overhead_s": self.node_overhead_s,
            "program_overheads": [list(p) for p in self.program_overheads],
            "host_op_run_s": self.host_op_run_s,
            "contention": {str(k): v for k, v in sorted(self.contention.items())},
            "pipeline_action_s": {k: {str(w): x for w, x in sorted(v.items())} for k, v in sorted(self.pipeline_action_s.items())},
            "pipeline_step_s": {k: {str(w): x for w, x in sorted(v.items())} for k, v in sorted(self.pipeline_step_s.items())},
            "dtensor_optimizer_s": dict(sorted(self.dtensor_optimizer_s.items())),
            "dtensor_view_s": self.dtensor_view_s,
            "optimizer_steps": {k: list(v) for k, v in sorted(self.optimizer_steps.items())},
            "ops": {k: _timing_json(t) for k, t in sorted(self.ops.items())},
            "collectives": [
                {"kind": f.kind, "group": f.group, "world": f.world, "axis": f.axis, "alpha_s": f.alpha_s,
                 "seconds_per_byte": f.seconds_per_byte, "sizes": list(f.sizes), "times": list(f.times)}
                for f in self.collectives
            ],
        }

    @staticmethod
    def from_json(d: Any, source: str = "profile") -> Profile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{source} is not a meshplan profile (expected a JSON object with format={FORMAT!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"{source} has profile format version {d.get('version')!r}; this meshplan reads version {VERSION}")
        try:
            return Profile(
                device=_str(d["device"]), torch_version=_str(d["torch_version"]), cluster=_str(d["cluster"]),
                threads=int(d["threads"]), backend=_str(d.get("backend", "")),
                copy_seconds_per_byte=_opt_float(d.get("copy_seconds_per_byte")),
                op_overhead_s=_opt_float(d.get("op_overhead_s")),
                node_overhead_s=_opt_float(d.get("node_overhead_s")),
                program_overheads=tuple((_pos(x), _pos(y)) for x, y in d.get("program_overheads", [])),
                host_op_run_s=_opt_float(d.get("host_op_run_s")),
                contention={int(k): _pos(v) for k, v in d.get("contention", {}).items()},
                pipeline_action_s=_by_schedule(d.get("pipeline_action_s", {})),
                pipeline_step_s=_by_schedule(d.get("pipeline_step_s", {})),
                dtensor_optimizer_s={_str(k): float(v) for k, v in d.get("dtensor_optimizer_s", {}).items()},
                dtensor_view_s=_opt_float(d.get("dtensor_view_s")),
                optimizer_steps={_str(k): (_pos(v[0]), _pos(v[1])) for k, v in d.get("optimizer_steps", {}).items()},
                ops={_str(k): OpTiming(forward_s=_pos(v["forward_s"]), backward_s=_opt_float(v.get("backward_s")), runs=int(v.get("runs", 0)),
                                       host_forward_s=_opt_float(v.get("host_forward_s")), host_backward_s=_opt_float(v.get("host_backward_s")))
                     for k, v in d.get("ops", {}).items()},
                collectives=tuple(
                    CollectiveFit(kind=_str(f["kind"]), group=int(f["group"]), world=int(f["world"]), axis=_str(f.get("axis", "")),
                                  alpha_s=float(f["alpha_s"]), seconds_per_byte=float(f["seconds_per_byte"]),
                                  sizes=tuple(int(x) for x in f.get("sizes", ())), times=tuple(float(x) for x in f.get("times", ())))
                    for f in d.get("collectives", [])
                ),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source} is a corrupt meshplan profile: {type(e).__name__}: {e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a file
        return path

    def summary(self) -> str:
        per = ", ".join(f"{w} ranks x{f:.2f}" for w, f in sorted(self.contention.items())) or "not measured"
        return (
            f"profile for {self.device} (torch {self.torch_version}, calibrates cluster {self.cluster!r}): "
            f"{len(self.ops)} op timings, {len(self.collectives)} collective fits ({self.backend or '-'}), contention {per}, "
            f"in-program overhead {'not measured' if self.node_overhead_s is None else f'{self.node_overhead_s * 1e6:.1f} us per op'}"
            + ("" if not self.overhead_line[1] else f" (priced {self.overhead_line[0] * 1e6:.1f} us + {self.overhead_line[1]:.3f} x its "
                   f"isolated time per op run, through {len(self.program_overheads)} programs)")
            + ("" if self.host_op_run_s is None else f", host {self.host_op_run_s * 1e6:.1f} us per op run")
        )


def _fitted_line(points: Sequence[tuple[float, float]], fallback: float | None) -> tuple[float, float]:
    """`Profile.overhead_line` of `points` (x, y); (`fallback`, 0) without two different xs."""
    fit = nonnegative_line([x for x, _ in points], [y for _, y in points]) if len(points) >= 2 else None
    return fit if fit is not None else ((fallback or 0.0), 0.0)


def _of_schedule(by_schedule: Mapping[str, Mapping[int, float]], schedule: str) -> Mapping[int, float]:
    return by_schedule.get(schedule) or by_schedule.get("1f1b") or {}


def _merged_by_schedule(a: Mapping[str, Mapping[int, float]], b: Mapping[str, Mapping[int, float]]) -> dict:
    return {k: {**a.get(k, {}), **b.get(k, {})} for k in {*a, *b}}


def _by_schedule(d: Any) -> dict[str, dict[int, float]]:
    """schedule -> world -> seconds from JSON; a flat world -> seconds map (files before 2026-11-26) is 1F1B's."""
    if all(not isinstance(v, dict) for v in d.values()):
        d = {"1f1b": d} if d else {}
    return {_str(k): {int(w): _pos(x) for w, x in v.items()} for k, v in d.items()}


def _at_world(by_world: Mapping[int, float], world: int, default: float) -> float:
    """The value measured at `world` ranks, else at the nearest smaller measured world, else `default`."""
    known = [w for w in by_world if w <= world]
    return by_world[max(known)] if known else default


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {v!r}")
    return v


def _pos(v: Any) -> float:
    x = float(v)
    if not x >= 0:
        raise ValueError(f"expected a non-negative number, got {v!r}")
    return x


def _opt_float(v: Any) -> float | None:
    return None if v is None else _pos(v)


def _timing_json(t: OpTiming) -> dict[str, Any]:
    """An op's timing as saved; the host's seconds only where they were timed (profiles without them read the same)."""
    d: dict[str, Any] = {"forward_s": t.forward_s, "backward_s": t.backward_s, "runs": t.runs}
    if t.host_forward_s is not None:
        d.update(host_forward_s=t.host_forward_s, host_backward_s=t.host_backward_s)
    return d


# ---------------------------------------------------------------- the database: files by device and torch version


def profile_dir() -> Path:
    return Path(os.environ.get(PROFILE_DIR_ENV) or Path.home() / ".cache" / "meshplan" / "profiles")


def profile_path(device: str | None = None, version: str | None = None, directory: str | os.PathLike | None = None) -> Path:
    """The database file for `device` and torch `version` (default: this machine's)."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device or device_name()}__torch-{version or torch_version()}").strip("-")
    return Path(directory or profile_dir()) / f"{slug}.json"


def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile file; a missing, corrupt or foreign file is a `ValueError` that names it."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read profile {str(path)!r}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}); re-measure it with `meshplan profile`") from None
    return Profile.from_json(data, source=f"profile {str(path)!r}")


def save_merged(profile: Profile, path: str | os.PathLike) -> Profile:
    """Add `profile`'s measurements to the file at `path` (created if absent) and return the result."""
    if Path(path).exists():
        profile = load_profile(path).merged(profile)
    profile.save(path)
    return profile


_warned_presets: set[str] = set()


def resolve_profile(profile: Profile | str | os.PathLike | None, cluster: str | None, default_cluster: str = "cpu") -> Profile | None:
    """What `meshplan.plan(profile=...)` accepts: a Profile, a file path, `"local"` (this machine's
    database entry) or None (presets only, said once per cluster and process)."""
    if profile is None:
        name = cluster or default_cluster
        if name not in _warned_presets:
            _warned_presets.add(name)
            log.warning(
                "meshplan: planning with the %r cluster presets (roofline compute, alpha-beta links), no measured profile; "
                "measure one with `meshplan profile compute` / `meshplan profile comm` and pass profile=", name,
            )
        return None
    if isinstance(profile, Profile):
        prof = profile
    elif isinstance(profile, (str, os.PathLike)):
        if str(profile) == LOCAL:
            path = profile_path()
            if not path.exists():
                raise ValueError(
                    f"profile='local': no profile for this machine ({device_name()}, torch {torch_version()}) at {path}; "
                    "make one with `python -m meshplan profile compute MODULE:FACTORY --devices N`"
                )
            profile = path
        prof = load_profile(profile)
    else:
        raise ValueError(f"profile must be a Profile, a path to a profile JSON file, 'local' or None; got {profile!r}")
    if prof.torch_version != torch_version():
        raise ValueError(
            f"profile for {prof.device!r} was measured with torch {prof.torch_version} but this is torch {torch_version()}; "
            "allowed: a profile measured with the running torch version (re-measure with `meshplan profile`)"
        )
    if cluster is not None and cluster != prof.cluster:
        raise ValueError(
            f"profile measured on {prof.device!r} calibrates cluster {prof.cluster!r}, but cluster={cluster!r} was asked for; "
            f"allowed: cluster={prof.cluster!r} (or no cluster) with this profile"
        )
    return prof
