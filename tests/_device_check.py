"""Run the runtime on a device other than the CPU, on this CPU machine, and record every op that mixes devices.

`OnDevice` is a tensor that says it lives on `DEVICE` (the meta device) but holds real values in a CPU tensor,
so data-dependent code (a MoE's token counts, `.item()`) runs as on an accelerator. `DeviceCheck` is the
dispatch mode that makes it so: a factory or copy to `DEVICE` gives an `OnDevice`, an op on `OnDevice` tensors
runs on their values and gives `OnDevice` results, a copy to the CPU gives a plain tensor. Before running an
op, it records it if its tensor arguments sit on more than one device, as a GPU would refuse it ("Expected all
tensors to be on the same device"), except 0-dim CPU tensors, which torch takes as scalars, and `copy_`, whose
purpose is to cross devices.

`simulated_rank(rank, world)` makes this process one rank of a "fake" process group
(`torch.testing._internal.distributed.fake_pg`), whose collectives return deterministic stand-ins of the right
shapes: enough to run every rank's program, one rank after another.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
"""The device the simulated ranks run on: not the CPU, so a CPU tensor meeting the program's is a mix."""

_CROSSING = {torch.ops.aten.copy_.default}
"""Ops whose purpose is to take tensors across devices."""


class OnDevice(torch.Tensor):
    """A tensor on `DEVICE` whose values are the CPU tensor `inner`."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
                                                   dtype=inner.dtype, layout=inner.layout, device=DEVICE, requires_grad=False)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"

    def tolist(self):
        return self.inner.tolist()

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return OnDevice(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _is_device(d) -> bool:
    return d is not None and torch.device(d).type == DEVICE.type


def _run(func, args, kwargs):
    """`func` on the values of its `OnDevice` arguments; its results on `DEVICE` where an argument was, or where
    it was asked to put them."""
    wrapper_of: dict[int, OnDevice] = {}

    def unwrap(t):
        if isinstance(t, OnDevice):
            wrapper_of[id(t.inner)] = t
            return t.inner
        return t

    args, kwargs = pytree.tree_map(unwrap, (args, kwargs))
    on_device = bool(wrapper_of)
    if "device" in kwargs and kwargs["device"] is not None:
        on_device = _is_device(kwargs["device"])
        if on_device:
            kwargs = {**kwargs, "device": torch.device("cpu")}
    out = func(*args, **kwargs)
    if not on_device:
        return out
    # in place and out= results are the arguments' own wrappers; new tensors get new ones
    return pytree.tree_map_only(torch.Tensor, lambda t: wrapper_of[id(t)] if id(t) in wrapper_of else OnDevice(t), out)


_suspended = [False]
"""Set by `suspended()`: the modes pass every call through."""


class DeviceCheck(TorchDispatchMode):
    """Runs `OnDevice` tensors (module doc) and records in `mixed` every op whose tensors span devices."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []
        """'op: devices' of every op that mixed devices, in the order they ran"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _suspended[0]:
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {str(t.device) for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1 and func not in _CROSSING:
            shapes = ", ".join(f"{list(t.shape)} on {t.device}" for t in tensors)
            self.mixed.append(f"{func}: {shapes}")
        out = _run(func, args, kwargs)
        if func is torch.ops.c10d.recv_.default:
            # the fake group leaves a receive's buffer as it was; torch's pipeline stages take a zero received in
            # their warm-up for a vote to exchange shapes as pickled objects, which the fake group cannot carry
            for t in args[0]:
                t.fill_(1)
        return out


class _Factories(TorchFunctionMode):
    """`torch.tensor(data, device=DEVICE)` and its kin as `OnDevice`: they copy their data to the device below the
    dispatch modes, which would see a meta tensor without values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _suspended[0] or not _is_device(kwargs.get("device")):
            return func(*args, **kwargs)
        out = func(*args, **{**kwargs, "device": torch.device("cpu")})
        return pytree.tree_map_only(torch.Tensor, lambda t: OnDevice(t.detach()).requires_grad_(t.requires_grad), out)


@contextlib.contextmanager
def on_device():
    """The block on `DEVICE` (module doc); yields the `DeviceCheck` recording its mixed ops."""
    check = DeviceCheck()
    with _Factories(), check:
        yield check


@contextlib.contextmanager
def suspended():
    """The block as if outside `on_device`: for tracing, which makes meta tensors of its own."""
    _suspended[0] = True
    try:
        yield
    finally:
        _suspended[0] = False


@contextlib.contextmanager
def simulated_rank(rank: int, world: int):
    """This process as rank `rank` of `world` in a fake process group, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # fake on the device too: a pipeline's sends and receives look the group's backend up by their tensors' device
    dist.init_process_group(f"cpu:fake,{DEVICE.type}:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
