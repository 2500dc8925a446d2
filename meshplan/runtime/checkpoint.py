"""Checkpoints that load under any plan: torch.distributed.checkpoint (DCP) of DTensor parameters.

A `ParallelModule` holds each parameter and buffer as a DTensor on the plan's DeviceMesh (with a
pipeline: those its stages read, on its stage's sub-mesh; a torch optimizer keeps its state in DTensors
of the same layout), so DCP records where every shard sits in the whole tensor. Under a data-parallel plan they
are plain whole tensors (`Plan.plain_params`); their optimizer state is saved
as replicated DTensors, so the checkpoint looks the same. A checkpoint saved under one
plan (tp=4, or a pipeline, say) therefore loads under any other plan of the same model (dp=2 x tp=2,
another world size, with or without a pipeline): DCP reads the overlapping pieces.

A checkpoint is a directory: DCP's shard files and `.metadata`, plus `meshplan.json` (step,
optimizer hyper-parameters, the saving plan's hash and mesh, user `extra`), written last, so a
directory without it is an incomplete save. Nothing in it is unpickled except DCP's `.metadata`,
through an unpickler that admits only DCP's metadata classes; tensors load with
`weights_only=True` (DCP's reader) and byte payloads are refused.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from meshplan.ir.placement import Partial
from meshplan.plans.plan import ParamChoice
from meshplan.runtime.local_view import local_of

__all__ = [
    "CheckpointInfo", "checkpoint_state", "device_mesh", "latest_checkpoint", "load_checkpoint", "load_model_state_dict",
    "load_optimizer_state_dict", "model_state_dict", "optimizer_state_dict", "save_checkpoint", "write_info",
]

INFO_FILE = "meshplan.json"
FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """What `load_checkpoint` found next to the tensors."""

    step: int | None
    """The `step` given to `save_checkpoint`."""
    plan_hash: str
    """Hash of the plan the checkpoint was saved under (it may differ from the loading plan)."""
    mesh_shape: tuple[int, ...]
    """Mesh of the saving plan."""
    extra: Any
    """The JSON-serialisable `extra` given to `save_checkpoint`."""


# ------------------------------------------------------------------ DTensors by FQN


def device_mesh(pmodel) -> DeviceMesh:
    """The DeviceMesh `pmodel`'s parameters live on (the plan's mesh over its own groups)."""
    return pmodel.device_mesh


def _view(local: torch.Tensor, p: ParamChoice, mesh: DeviceMesh) -> DTensor:
    if any(isinstance(q, Partial) for q in p.layout):
        raise AssertionError(f"parameter {p.fqns[0]} has a partial layout {p.layout}; parameters are never partial")
    shape = torch.Size(p.shape)
    return DTensor.from_local(local, mesh, list(p.layout), run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride())


def _by_fqn(pmodel) -> dict[str, ParamChoice]:
    return {f: p for p in pmodel.plan.params for f in p.fqns}


def model_state_dict(pmodel) -> dict[str, torch.Tensor]:
    """`pmodel.state_dict()`: every value a DTensor over this rank's shard (a whole tensor where the plan
    replicates every parameter, `Plan.plain_params`), under the original model's keys
    (`model.state_dict()`), so a single process can load the model part of a checkpoint into the unsharded
    model with plain `dcp.load`."""
    return dict(pmodel.state_dict(keep_vars=True))


def load_model_state_dict(pmodel, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy `state_dict` into `pmodel`'s shards; values are DTensors (any layout) or whole tensors."""
    own = pmodel.state_dict(keep_vars=True)
    _check_keys("model state dict", set(state_dict), set(own))
    choice = _by_fqn(pmodel)
    with torch.no_grad():
        for k, target in own.items():
            local_of(target).copy_(_local_part(state_dict[k], choice[k], pmodel, k))


def _local_part(value: torch.Tensor, p: ParamChoice, pmodel, what: str) -> torch.Tensor:
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{what} has shape {list(value.shape)} but this model's {p.fqns[0]} is {list(p.shape)}")
    if isinstance(value, DTensor):
        if value.device_mesh == pmodel.device_mesh:  # this mesh, any layout: DTensor moves only what changes
            return value.redistribute(pmodel.device_mesh, list(p.layout)).to_local()
        value = value.full_tensor()  # another mesh: gather, then take our block
    # a whole tensor every rank holds: each takes its own block, no communication
    return distribute_tensor(value.to(pmodel.comm.device), pmodel.device_mesh, list(p.layout), src_data_rank=None).to_local()


def _check_keys(what: str, got: set[str], want: set[str]) -> None:
    if got != want:
        missing, unexpected = sorted(want - got), sorted(got - want)
        raise ValueError(f"{what} does not fit this model: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")


# ------------------------------------------------------------------ optimizer state by FQN


def _optimizer_params(pmodel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """FQNs of the optimizer's parameters, group by group (the key optimizer state is stored under)."""
    fqn_of = {id(t): fqn for fqn, t in _stepped(pmodel).items()}
    groups = []
    for g in optimizer.param_groups:
        names = []
        for t in g["params"]:
            if id(t) not in fqn_of:
                raise ValueError(f"the optimizer holds a tensor of shape {list(t.shape)} that is not a parameter of the "
                                 "ParallelModule; build the optimizer from pmodel.parameters()")
            names.append(fqn_of[id(t)])
        groups.append(names)
    return groups


def _stepped(pmodel) -> dict[str, torch.Tensor]:
    """FQN -> the tensor an optimizer from `pmodel.parameters()` or `pmodel.make_optimizer` steps (the host
    copy of an offloaded parameter)."""
    return dict(pmodel.named_parameters()) | getattr(pmodel, "offload_copies", {})


def optimizer_state_dict(pmodel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`{"state": {fqn: {key: value}}, "param_groups": [...]}`, keyed by parameter FQN as in
    `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`; state shaped like a parameter is
    a DTensor with its layout (torch's optimizers make it so; the state of a plain, replicated parameter
    is wrapped as a replicated DTensor, so a checkpoint loads alike under every plan), other tensors
    (Adam's `step`) stay plain."""
    groups = _optimizer_params(pmodel, optimizer)
    params = _stepped(pmodel)
    choice, state = _by_fqn(pmodel), {}
    for fqn in (f for g in groups for f in g):
        param = params[fqn]
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(param, DTensor) and _shaped_like(value, param):
                value = _view(value, choice[fqn], device_mesh(pmodel))
            state.setdefault(fqn, {})[key] = value
    param_groups = []
    for names, g in zip(groups, optimizer.param_groups):
        param_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": param_groups}


def _shaped_like(value, param: torch.Tensor) -> bool:
    """Optimizer state that follows its parameter's layout (Adam's moments; not its scalar `step`)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def load_optimizer_state_dict(pmodel, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Inverse of `optimizer_state_dict`: sharded state as DTensors (any layout), other values as they are."""
    groups = _optimizer_params(pmodel, optimizer)
    held = {fqn for fqn, _ in pmodel.named_parameters()}  # a pipeline rank holds its stages' only
    saved_groups = [[f for f in g["params"] if f in held] for g in state_dict["param_groups"]]
    if saved_groups != groups:
        raise ValueError(f"optimizer parameter groups {saved_groups} do not match this optimizer's {groups}; build "
                         "the optimizer with the same parameters and groups as the one that was saved")
    choice, mesh, index = _by_fqn(pmodel), device_mesh(pmodel), {}
    for fqn in (f for g in groups for f in g):
        index[fqn] = len(index)
    params, state = _stepped(pmodel), {}
    for fqn, entries in state_dict["state"].items():
        if fqn not in held:
            continue
        if fqn not in index:
            raise ValueError(f"optimizer state for {fqn!r}, which this optimizer does not hold")
        sharded = isinstance(params[fqn], DTensor)  # else a plain, replicated parameter: its state is whole too
        state[index[fqn]] = {}
        for k, v in entries.items():
            if isinstance(v, DTensor) or (not sharded and _shaped_like(v, params[fqn])):
                v = _local_part(v, choice[fqn], pmodel, f"optimizer state {fqn}.{k}")
                v = _view(v, choice[fqn], mesh) if sharded else v
            state[index[fqn]][k] = v
    param_groups = []
    for names, g, current in zip(groups, state_dict["param_groups"], optimizer.param_groups):
        restored = {k: (tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v) for k, v in g.items()}
        param_groups.append({**restored, "params": [index[f] for f in names]})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ------------------------------------------------------------------ save / load


def save_checkpoint(path: str | os.PathLike, pmodel, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int | None = None, extra: Any = None) -> None:
    """Save `pmodel` (and `optimizer`) to directory `path`; call on every rank.

    Returns once the checkpoint is complete on disk on every rank (`meshplan.json` written last).
    `extra` must be JSON-serialisable (no pickle in a checkpoint).
    """
    path = os.fspath(path)
    state, text = checkpoint_state(pmodel, optimizer, step=step, extra=extra)
    comm = pmodel.comm
    _dcp(comm, f"saving checkpoint {path}", lambda: dcp.save(state, storage_writer=FileSystemWriter(path), process_group=pmodel.process_group))
    with comm.guard(f"saving checkpoint {path}"):
        if dist.get_rank(pmodel.process_group) == 0:
            write_info(path, text)
        dist.barrier(group=pmodel.process_group)


def checkpoint_state(pmodel, optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
                     extra: Any = None, plan_hash: str | None = None) -> tuple[dict[str, Any], str]:
    """What `save_checkpoint` writes: the DCP state dict (this rank's tensors) and the text of `meshplan.json`.
    Every rank calls it (it gathers the optimizer's parameter groups); a saver that runs DCP itself
    (`dcp.async_save`) writes the text with `write_info` on the first rank once DCP has finished.
    `plan_hash`: `pmodel.plan.hash()` when the caller keeps it (hashing serialises the whole plan: 2-10 ms
    per save on small GPTs, more on large graphs, and a run saves the same plan many times)."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise ValueError(f"step must be an int or None, got {step!r}")
    state: dict[str, Any] = {"model": model_state_dict(pmodel)}
    info: dict[str, Any] = {
        "format": FORMAT, "step": step, "plan_hash": plan_hash or pmodel.plan.hash(), "mesh_shape": list(pmodel.plan.mesh.shape),
        "params": {p.fqns[0]: list(p.shape) for p in pmodel.plan.params}, "extra": extra,
    }
    if optimizer is not None:
        osd = optimizer_state_dict(pmodel, optimizer)
        state["optim"] = {"state": {}}
        layout: dict[str, dict[str, Any]] = {}
        for fqn, entries in osd["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    state["optim"]["state"].setdefault(fqn, {})[key] = value
                    layout.setdefault(fqn, {})[key] = {
                        "sharded": isinstance(value, DTensor), "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
                else:
                    layout.setdefault(fqn, {})[key] = {"value": value}
        param_groups, layout = _over_ranks(pmodel, osd["param_groups"], layout)
        info["optimizer"] = {"class": type(optimizer).__name__, "param_groups": param_groups, "state": layout}
    try:
        text = json.dumps(info, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint metadata must be JSON (extra, optimizer hyper-parameters): {e}") from None
    return state, text


def write_info(path: str | os.PathLike, text: str) -> None:
    """Write `meshplan.json` (from `checkpoint_state`) into `path` atomically: the mark of a complete checkpoint."""
    tmp = os.path.join(os.fspath(path), INFO_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(os.fspath(path), INFO_FILE))


def _over_ranks(pmodel, param_groups: list[dict], layout: dict) -> tuple[list[dict], dict]:
    """The optimizer's groups and state layout of the whole model: a pipeline rank's optimizer holds
    only its stages' parameters, so each group lists the union over ranks (first rank's hyper-parameters)."""
    gathered: list = [None] * dist.get_world_size(pmodel.process_group)
    with pmodel.comm.guard("gathering every rank's optimizer parameter groups"):
        dist.all_gather_object(gathered, ([g["params"] for g in param_groups], layout), group=pmodel.process_group)
    merged = [dict(g, params=list(g["params"])) for g in param_groups]
    every_layout: dict = {}
    for names, rank_layout in gathered:
        if len(names) != len(merged):
            raise ValueError(f"ranks hold optimizers with different numbers of parameter groups ({len(names)} and "
                             f"{len(merged)}); build every rank's optimizer with the same groups")
        for group, more in zip(merged, names):
            group["params"] += [f for f in more if f not in group["params"]]
        every_layout.update(rank_layout)
    return merged, every_layout


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """`meshplan.json` of a checkpoint directory, checked for the fields `load_checkpoint` reads."""
    file = os.path.join(os.fspath(path), INFO_FILE)
    try:
        with open(file) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a complete meshplan checkpoint: {INFO_FILE} is missing "
                         "(the save was interrupted, or the directory is not a checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint file {file} is not valid JSON: {e}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        got = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"checkpoint {path} has format {got!r}; this meshplan reads format {FORMAT}")
    if not isinstance(info.get("params"), dict) or not isinstance(info.get("mesh_shape"), list):
        raise ValueError(f"checkpoint file {file} is malformed: 'params' and 'mesh_shape' are required")
    return info


def load_checkpoint(path: str | os.PathLike, pmodel, optimizer: torch.optim.Optimizer | None = None) -> CheckpointInfo:
    """Load a checkpoint saved by `save_checkpoint` under any plan of the same model; call on every rank."""
    info = read_info(path)
    have = {p.fqns[0]: list(p.shape) for p in pmodel.plan.params}
    if info["params"] != have:
        diff = sorted(k for k in set(have) | set(info["params"]) if have.get(k) != info["params"].get(k))
        shown = "; ".join(f"{k}: {info['params'].get(k, 'absent')} in the checkpoint, {have.get(k, 'absent')} here" for k in diff[:3])
        raise ValueError(f"checkpoint {path} was saved from a different model: {len(diff)} parameters differ in name or "
                         f"shape ({shown}{'; ...' if len(diff) > 3 else ''})")
    state: dict[str, Any] = {"model": model_state_dict(pmodel)}
    plain: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        saved = info.get("optimizer")
        if not isinstance(saved, dict):
            raise ValueError(f"checkpoint {path} holds no optimizer state; load it without optimizer=")
        if saved.get("class") != type(optimizer).__name__:
            raise ValueError(f"checkpoint {path} holds {saved.get('class')} state but the optimizer is "
                             f"{type(optimizer).__name__}")
        try:
            state["optim"] = {"state": _optimizer_targets(path, saved["state"], pmodel, plain)}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"checkpoint file {os.path.join(os.fspath(path), INFO_FILE)} is malformed: optimizer state "
                             f"{type(e).__name__}: {e}") from None
    SafeFileSystemReader(path).read_metadata()  # a corrupt or unsafe .metadata is a ValueError here, on every rank
    comm = pmodel.comm
    _dcp(comm, f"loading checkpoint {path}", lambda: dcp.load(
        state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), process_group=pmodel.process_group))
    if optimizer is not None:
        osd = {"state": {f: {**state["optim"]["state"].get(f, {}), **plain.get(f, {})}
                         for f in set(state["optim"]["state"]) | set(plain)},
               "param_groups": info["optimizer"]["param_groups"]}
        load_optimizer_state_dict(pmodel, optimizer, osd)
    return CheckpointInfo(step=info.get("step"), plan_hash=str(info.get("plan_hash")),
                          mesh_shape=tuple(info["mesh_shape"]), extra=info.get("extra"))


def _optimizer_targets(path, saved: dict, pmodel, plain: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors (DTensors in this plan's layout where the state was sharded) for DCP to load into;
    non-tensor state values go to `plain`."""
    params = dict(pmodel.named_parameters())
    targets: dict[str, dict[str, torch.Tensor]] = {}
    in_model = set(_by_fqn(pmodel))
    for fqn, entries in saved.items():
        if fqn not in in_model:
            raise ValueError(f"checkpoint {path} has optimizer state for {fqn!r}, not a parameter of this model")
        if fqn not in params:
            continue  # held by another pipeline rank
        param = params[fqn]
        for key, spec in entries.items():
            if "value" in spec:
                plain.setdefault(fqn, {})[key] = spec["value"]
                continue
            dtype = getattr(torch, spec["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"checkpoint {path}: optimizer state {fqn}.{key} has unknown dtype {spec['dtype']!r}")
            targets.setdefault(fqn, {})[key] = (
                torch.empty_like(param, dtype=dtype) if spec["sharded"]  # a DTensor in this plan's layout
                else torch.empty(spec["shape"], dtype=dtype, device=param.device))
    return targets


def _dcp(comm, what: str, call) -> None:
    """Run a DCP save/load; its `CheckpointException` (a BaseException) becomes the first rank's error."""
    try:
        with comm.guard(what):
            call()
    except CheckpointException as e:
        rank, (first, _) = next(iter(e.failures.items()))
        kind = ValueError if isinstance(first, ValueError) else RuntimeError
        raise kind(f"{what} failed on ranks {sorted(e.failures)}; rank {rank}: {type(first).__name__}: {first}") from e


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The complete checkpoint directory under `root` whose name sorts last (`step_000012` style), or None."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, INFO_FILE)))
    return os.path.join(root, done[-1]) if done else None


# ------------------------------------------------------------------ loading without arbitrary pickle


_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's `.metadata` holds: DCP's own metadata classes, torch dtypes/layouts, Size, paths."""

    def find_class(self, module: str, name: str):
        obj = None
        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS:
                obj = super().find_class(module, name)
            elif module == "torch":
                value = getattr(torch, name, None)
                obj = value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
            elif module in _DCP_MODULES:
                value = super().find_class(module, name)
                obj = value if isinstance(value, type) and value.__module__ in _DCP_MODULES else None
        if obj is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `_MetadataUnpickler` (tensor data: `weights_only=True`)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise ValueError(f"{self.path} has no DCP metadata file {os.path.basename(path)}") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint metadata {path} is corrupt or unsafe: {e}") from None
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise ValueError(f"checkpoint metadata {path} holds {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Refuses pickled (non-tensor) entries: meshplan checkpoints keep those in JSON."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; meshplan loads only tensors")
