"""Every tensor a rank's program touches lives on the rank's device.

The runtime has run on one GPU only; on CPU ranks every tensor is on the CPU, so a tensor the runtime left
there (a lifted constant, a region op's index tensor, a target) goes unnoticed until a GPU refuses the op.
Here every rank of each plan runs, one after another in this process under a fake process group, with the
runtime's device forced to a device other than the CPU (tests/_device_check.py: the meta device, with real
values); the setup, a training step (forward, loss, backward, gradient reduction) and clipping must not run
one op whose tensors sit on two devices.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist

import meshplan
import meshplan.api
from meshplan.regions.moe import MOE_OP, moe_axes
from meshplan.runtime import parallel_module
from meshplan.runtime.launch import _own_device
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import group_device

from _device_check import DEVICE, OnDevice, on_device, simulated_rank, suspended
from _parity import plan_kwargs
from _small_models import EXPERT_PARALLEL, gpt, moe, pipelined, scaled

CASES = {
    # name: (model, batch and loss; plan options), on 2 ranks
    "data parallel": (gpt, plan_kwargs("gpt", "data_parallel", (2,))),
    "tensor parallel": (gpt, plan_kwargs("gpt", "megatron", (2,))),
    "fsdp": (gpt, plan_kwargs("gpt", "fsdp", (2,))),
    "pipelined": (gpt, pipelined()),
    "expert parallel": (functools.partial(moe, split=2), dict(mesh_shape=(2,), **EXPERT_PARALLEL)),
    "tensor literals": (scaled, dict(mesh_shape=(2,), param_layouts={"layers.*.weight": "S(0)"})),
    "tensor literals, pipelined": (scaled, pipelined()),
}


@pytest.fixture
def forced_device(monkeypatch):
    """The runtime takes `DEVICE` as its process group's device (the fake group's would be the CPU); DTensor asks
    the device's module how many devices a host has (the CPU's answer); tracing runs on meta tensors of its own."""
    monkeypatch.setattr(parallel_module, "group_device", lambda group=None: DEVICE)
    monkeypatch.setattr(meshplan.api, "group_device", lambda group=None: DEVICE)
    monkeypatch.setattr(torch, DEVICE.type, torch.cpu, raising=False)
    trace = meshplan.api.trace

    def trace_off_device(*args, **kwargs):
        with suspended():
            return trace(*args, **kwargs)

    monkeypatch.setattr(meshplan.api, "trace", trace_off_device)


@pytest.mark.parametrize("case", CASES)
def test_every_op_of_every_rank_runs_on_the_rank_device(case, forced_device):
    build, options = CASES[case]
    world, (model, x, y, loss_fn) = 2, build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, world, (x,), **options)
    assert (plan.pipeline is not None) == ("pipeline" in options)
    if case == "expert parallel":
        [node] = [n for n in plan.nodes if n.target == str(MOE_OP)]
        assert moe_axes(node.strategy.inputs)[0] == (0,), f"not expert parallel: {node.strategy}"
    for rank in range(world):
        with simulated_rank(rank, world), on_device() as check:
            pmodel = meshplan.auto_parallelize(model, world, (x,), plan=plan, loss_fn=loss_fn)
            loss = pmodel.step(x, target=y)  # the batch as a data loader gives it: on the CPU
            pmodel.clip_grad_norm_(1.0)
        assert not check.mixed, f"rank {rank} ran ops on two devices:\n" + "\n".join(dict.fromkeys(check.mixed))
        assert loss is None or isinstance(loss, OnDevice)
        for name, p in pmodel.named_parameters():
            assert isinstance(local_of(p), OnDevice) and isinstance(local_of(p.grad), OnDevice), name


@pytest.fixture
def eight_gpus(monkeypatch):
    """This process on a node of 8 CUDA devices (as torch.accelerator reports them), device 0 current."""
    current = [0]
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 8)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: current[0])
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: current.__setitem__(0, i))
    return current


def test_a_group_made_without_set_device_is_refused(eight_gpus, monkeypatch):
    """NCCL runs each rank on its current device: a group made by hand without `set_device` would put every rank of
    the node on cuda:0."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3, so its device is cuda:3, but the current device is cuda:0.*"
                                         r"set_device_index\(3\)"):
        group_device()
    eight_gpus[0] = 3
    assert group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)  # one visible device per process
    eight_gpus[0] = 0
    assert group_device() == torch.device("cuda", 0)


def test_meshplan_binds_its_own_groups_to_the_local_rank_device(eight_gpus):
    assert _own_device("nccl", 3) == torch.device("cuda", 3) and eight_gpus[0] == 3
    assert _own_device("nccl", 9) == torch.device("cuda", 1) and eight_gpus[0] == 1
    assert _own_device("gloo", 3) is None and eight_gpus[0] == 1
