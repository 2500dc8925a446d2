"""Where a rank's parameter shards come from: the model's own tensors, a safetensors checkpoint, or the
model's own initialisation on the meta device.

Each source gives this rank only its blocks (`blocks(params, comm)`: node -> local tensor). The
runtime wraps them in DTensors; no source makes a rank hold the whole model, except `FromModel`,
whose model is already whole on every rank.

- `FromModel`: the model's real tensors, each broadcast from the group's first rank (as DDP starts).
- `FromSafetensors`: Hugging Face `save_pretrained` output (one file, or an index and its shards);
  every name, shape and dtype is checked before anything is read, then each rank reads its slices
  with safetensors' lazy slicing.
- `FromInit` (runtime/init_on_meta.py): a model on the meta device, initialised by its own code.
"""

from __future__ import annotations

import json
import math
import os
from typing import Protocol

import torch
import torch.distributed as dist

from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Placements, Shard
from meshplan.plans.plan import ParamChoice
from meshplan.runtime.collectives import MeshComm


class WeightSource(Protocol):
    def blocks(self, params: tuple[ParamChoice, ...], comm: MeshComm, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        """node -> this rank's contiguous block of that parameter or buffer, on `comm.device`, for the nodes in
        `wanted` (default: all of `params`; a pipeline stage wants only the parameters its stages read)."""


def block_slices(shape: tuple[int, ...], layout: Placements, mesh: MeshSpec, rank: int) -> tuple[slice, ...]:
    """Rank `rank`'s block of a whole tensor of `shape`, as slices (the blocks `shard_tensor` takes:
    `torch.chunk` per sharded axis, outer axes first)."""
    start, length = [0] * len(shape), list(shape)
    coord = mesh.coordinate(rank)
    for a, p in enumerate(layout):
        if isinstance(p, Shard):
            n, d = mesh.shape[a], p.dim
            chunk = math.ceil(length[d] / n) if length[d] else 0
            offset = min(coord[a] * chunk, length[d])
            start[d] += offset
            length[d] = max(0, min(chunk, length[d] - offset))
    return tuple(slice(s, s + n) for s, n in zip(start, length))


class FromModel:
    """The model's real tensors; the group's first rank's values win (`whole_job`: rank 0 of the job's, for a
    pipeline, whose stages each have their own group but must agree on the weights they share)."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, whole_job: bool = False) -> None:
        self._tensors, self._whole_job = tensors, whole_job

    def blocks(self, params: tuple[ParamChoice, ...], comm: MeshComm, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        src, group = (0, None) if self._whole_job else (comm.ranks[0], comm.world)
        out = {}
        for p in params:  # every rank takes part in every broadcast
            whole = self._tensors[p.fqns[0]].detach().to(comm.device, copy=True)
            with comm.guard(f"broadcasting {p.fqns[0]} from rank {src}"):
                dist.broadcast(whole, src=src, group=group)
            if wanted is None or p.node in wanted:
                # a copy, not a view: a chunk view would keep the whole tensor alive
                out[p.node] = whole[block_slices(p.shape, p.layout, comm.mesh, comm.rank)].clone(memory_format=torch.contiguous_format)
        return out


class Empty:
    """Uninitialised blocks, for a checkpoint to load into (meshplan.load_checkpoint)."""

    def blocks(self, params: tuple[ParamChoice, ...], comm: MeshComm, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for p in params:
            if wanted is not None and p.node not in wanted:
                continue
            shape = tuple(s.stop - s.start for s in block_slices(p.shape, p.layout, comm.mesh, comm.rank))
            out[p.node] = torch.empty(shape, dtype=getattr(torch, p.dtype), device=comm.device)
        return out


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class FromSafetensors:
    """`path`: a `.safetensors` file, or a directory holding `model.safetensors` or
    `model.safetensors.index.json` and its shards (what `save_pretrained` writes). Buffers the model
    does not save (`persistent=False`, such as rotary frequencies) come from `rest`, if given."""

    def __init__(self, path: str | os.PathLike, saved: set[str] | None = None, rest: WeightSource | None = None) -> None:
        self.path = os.fspath(path)
        self._saved, self._rest = saved, rest
        self._where = self._index()

    def _index(self) -> dict[str, str]:
        """Tensor name -> file holding it."""
        from safetensors import safe_open

        path = self.path
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"{index} has no 'weight_map'; it is not a safetensors index")
                return {name: os.path.join(path, file) for name, file in weight_map.items()}
            path = os.path.join(path, "model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"{self.path} is neither a .safetensors file nor a directory with model.safetensors or "
                             "model.safetensors.index.json")
        with safe_open(path, framework="pt") as f:
            return {name: path for name in f.keys()}

    def _name(self, p: ParamChoice) -> str | None:
        return next((f for f in p.fqns if f in self._where), None)

    def _by_file(self, params: tuple[ParamChoice, ...]) -> dict[str, list[ParamChoice]]:
        """The parameters grouped by the file that holds them (each file is opened once)."""
        out: dict[str, list[ParamChoice]] = {}
        for p in params:
            out.setdefault(self._where[self._name(p)], []).append(p)
        return out

    def _unsaved(self, params: tuple[ParamChoice, ...]) -> list[ParamChoice]:
        """Buffers the file lacks because the model never saves them."""
        if self._saved is None:
            return []
        return [p for p in params if self._name(p) is None and p.is_buffer and not set(p.fqns) & self._saved]

    def check(self, params: tuple[ParamChoice, ...]) -> None:
        """Every parameter present with the model's shape and dtype: ValueError before anything is read."""
        from safetensors import safe_open

        unsaved = {p.node for p in self._unsaved(params)}
        if unsaved and self._rest is None:
            raise ValueError(f"{self.path} lacks the unsaved buffers {sorted(unsaved)[:5]} and nothing initialises them")
        params = tuple(p for p in params if p.node not in unsaved)
        missing = [p.fqns[0] for p in params if self._name(p) is None]
        if missing:
            raise ValueError(f"{self.path} lacks {len(missing)} of the model's tensors: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}; it was saved from another model")
        for file, ps in self._by_file(params).items():
            with safe_open(file, framework="pt") as f:
                for p in ps:
                    sl = f.get_slice(self._name(p))
                    shape, dtype = tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype())
                    if shape != tuple(p.shape):
                        raise ValueError(f"{self._name(p)} in {file} has shape {list(shape)} but the model's is {list(p.shape)}")
                    if dtype is None or str(dtype).removeprefix("torch.") != p.dtype:
                        raise ValueError(f"{self._name(p)} in {file} is {sl.get_dtype()} but the model's is {p.dtype}; "
                                         "cast the model (or the file) so they agree")

    def blocks(self, params: tuple[ParamChoice, ...], comm: MeshComm, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        self.check(params)
        wanted = {p.node for p in params} if wanted is None else wanted
        out = {}
        unsaved = {p.node for p in self._unsaved(params)}
        if unsaved:  # the model's own initialisation makes them (it runs over every tensor: its draws stay in order)
            out = self._rest.blocks(params, comm, wanted=unsaved & wanted)
        params = tuple(p for p in params if p.node not in unsaved and p.node in wanted)
        for file, ps in self._by_file(params).items():
            with safe_open(file, framework="pt") as f:
                for p in ps:  # only this rank's block is read
                    block = f.get_slice(self._name(p))[block_slices(p.shape, p.layout, comm.mesh, comm.rank)]
                    # a copy: the slice may be backed by the file's memory map, which must not outlive the load
                    out[p.node] = block.to(comm.device, copy=True).contiguous()
        return out
