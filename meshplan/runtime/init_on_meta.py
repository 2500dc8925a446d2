"""A model on the meta device, initialised by its own code, one parameter at a time.

The model's initialisation runs as written (`init_weights()` when the root has one, the torchtitan
and Hugging Face convention; otherwise every submodule's `reset_parameters()`; or the user's
`init_fn(model)`), under a dispatch mode that gives each op touching a meta parameter a real
whole tensor in its place: the first op to touch a parameter allocates it on the host, and when the
initialisation moves on to another parameter, the finished one is cut to this rank's block and the
whole is dropped. So a rank holds one whole parameter at a time, and it draws from the CPU
generator exactly what one process running `model.to_empty(device="cpu")` and the same
initialisation draws: with the same `torch.manual_seed(s)` on every rank, replicas agree and the
gathered weights equal that process's.

Aliases (views, `.data`) are recognised by their storage, which a meta tensor's views share. An
initialisation that comes back to a parameter it already left, or leaves one untouched, is a
`ValueError` naming it, never a silently uninitialised weight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.plans.plan import ParamChoice
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.weights import block_slices


_aten = torch.ops.aten
OVERWRITES = {_aten.normal_, _aten.uniform_, _aten.fill_, _aten.zero_, _aten.copy_, _aten.bernoulli_, _aten.exponential_,
              _aten.random_, _aten.geometric_, _aten.log_normal_, _aten.cauchy_}
"""In-place ops whose result does not depend on the tensor's old values: they may start a parameter over."""


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Materialise(TorchDispatchMode):
    def __init__(self, tracked: dict[int, ParamChoice], meta: dict[str, torch.Tensor], finish: Callable[[ParamChoice, torch.Tensor], None]) -> None:
        super().__init__()
        self._tracked, self._meta, self._finish = tracked, meta, finish
        self._current: ParamChoice | None = None
        self._whole: torch.Tensor | None = None
        self.done: set[str] = set()

    def _real(self, t, overwrites: bool = False):
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        p = self._tracked.get(_storage_key(t))
        if p is None:
            return t
        if p.node in self.done:
            base = self._meta[p.node]
            whole = (t.shape, t.stride(), t.storage_offset()) == (base.shape, base.stride(), base.storage_offset())
            if not (overwrites and whole):
                raise ValueError(f"the initialisation came back to {p.fqns[0]} after initialising another parameter; "
                                 "meshplan materialises one parameter at a time: initialise each parameter in one go, or "
                                 "load the weights from a checkpoint (weights=)")
            self.done.discard(p.node)  # initialised again from scratch (a tied weight's second owner): start over
        if self._current is not p:
            self.close()
            base = self._meta[p.node]
            self._current, self._whole = p, torch.empty_strided(base.size(), base.stride(), dtype=base.dtype, device="cpu")
        return self._whole.as_strided(t.size(), t.stride(), t.storage_offset())

    def close(self) -> None:
        """The current parameter is finished: keep this rank's block."""
        if self._current is not None:
            self._finish(self._current, self._whole)
            self.done.add(self._current.node)
        self._current, self._whole = None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = {p.fqns[0] for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "meta"
                   and (p := self._tracked.get(_storage_key(t))) is not None}
        if len(touched) > 1:
            raise ValueError(f"the initialisation runs {func} on several parameters at once ({sorted(touched)}); meshplan "
                             "materialises one parameter at a time: load the weights from a checkpoint (weights=) instead")
        # an overwriting op may start a parameter over through its first argument (the one it writes) only
        overwrites = func.overloadpacket in OVERWRITES
        first = pytree.tree_map(lambda t: self._real(t, overwrites), args[0]) if args else None
        real_args, real_kwargs = pytree.tree_map(self._real, (args[1:], kwargs))
        real_args = (first, *real_args) if args else real_args
        out = func(*real_args, **real_kwargs)
        if any(r.alias_info is not None for r in func._schema.returns):
            return func(*args, **kwargs)  # an in-place op or a view of the parameter: the meta alias, still tracked
        return out


class FromInit:
    """This rank's blocks of a meta model's parameters and buffers, from the model's own initialisation."""

    def __init__(self, model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
        self.model, self.init_fn = model, init_fn

    def _initialise(self) -> None:
        if self.init_fn is not None:
            self.init_fn(self.model)
        elif callable(getattr(self.model, "init_weights", None)):
            self.model.init_weights()
        else:
            for module in self.model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()

    def blocks(self, params: tuple[ParamChoice, ...], comm: MeshComm, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Every parameter is initialised (so the generator's draws stay in one process's order); the blocks of
        `wanted` ones are kept."""
        full = dict(self.model.named_parameters(remove_duplicate=False)) | dict(self.model.named_buffers(remove_duplicate=False))
        meta = {p.node: full[p.fqns[0]] for p in params}
        tracked = {_storage_key(t): p for p in params if (t := meta[p.node]).device.type == "meta"}
        if len(tracked) != len(params):
            real = [p.fqns[0] for p in params if meta[p.node].device.type != "meta"]
            raise ValueError(f"the model mixes real and meta tensors ({real[:3]} are real); build all of it on the meta "
                             "device, or none")
        out: dict[str, torch.Tensor] = {}

        def keep(p: ParamChoice, whole: torch.Tensor) -> None:
            if wanted is not None and p.node not in wanted:
                return
            out[p.node] = whole[block_slices(p.shape, p.layout, comm.mesh, comm.rank)].to(comm.device, copy=True).contiguous()

        mode = _Materialise(tracked, meta, keep)
        with torch.no_grad(), mode:
            self._initialise()
        mode.close()
        missing = [p.fqns[0] for p in params if p.node not in mode.done]
        if missing:
            how = "init_fn" if self.init_fn is not None else ("init_weights()" if hasattr(self.model, "init_weights") else "reset_parameters()")
            raise ValueError(f"{how} does not initialise {missing[:5]}{' ...' if len(missing) > 5 else ''} of the model on the meta "
                             "device; pass auto_parallelize(..., init_fn=fn) where fn(model) initialises every parameter and "
                             "buffer, or load the weights (weights='path')")
        _check_same_draws(comm)
        return out


def _check_same_draws(comm: MeshComm) -> None:
    """Replicas agree only if every rank drew from the same generator state: compare the states after."""
    digest = int(hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:15], 16)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=comm.device)
    with comm.guard("comparing random generator states after initialisation"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.world)
    if t[0].item() != digest or -t[1].item() != digest:
        raise ValueError("ranks initialised the model from different random generator states, so their copies of replicated "
                         "weights differ; call torch.manual_seed(s) with the same s on every rank before auto_parallelize")
