"""The runtime on GPUs: one GPU in one process, and NCCL parity on every GPU of the machine.

Skipped without CUDA (the default test run has none); run them where a GPU is lent with
`python -m pytest tests/gpu -m cuda`. docs/runtime.md says which of them have ever run.

The user's loop by hand on one GPU (`test_world_one_on_one_gpu`); then `pmodel.step()` with batches left on the
host, as a data loader gives them (the runtime moves inputs and targets to the device), and
`pmodel.clip_grad_norm_`, against one process: on one GPU a model with tensor literals, the moe op and
offloaded optimizer state; on two or more, NCCL parity of data-parallel, tensor-parallel, FSDP-style, pipelined
(pp=2), expert-parallel and context-parallel (ring, balanced ring, Ulysses, torch's ring) plans and of the tensor-literal model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/_parity.py, tests/_small_models.py
from _parity import build, loss_fn, plan_kwargs  # noqa: E402
from _small_models import EXPERT_PARALLEL, gpt, moe, pipelined, scaled  # noqa: E402

import meshplan  # noqa: E402
from meshplan.regions.context_parallel import force_context_parallel, kernel_name  # noqa: E402
from meshplan.regions.moe import MOE_TARGET, moe_axes  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402
from meshplan.runtime.local_view import local_of  # noqa: E402
from meshplan.runtime.parallel_module import shard_tensor  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 3
MAX_NORM = 0.02
"""Below these models' gradient norms: clipping scales every step."""
LR = {torch.optim.SGD: 1.0, torch.optim.Adam: 1e-2}
"""Steps of about MAX_NORM (SGD) and lr (Adam) per element: parameters that move well beyond the tolerances."""


def _train(model, x, y, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for _ in range(steps):
        loss = loss_fn("gpt", model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _reference(device: str):
    model, x, y = build("gpt")
    model.to(device)
    return _train(model, x.to(device), y.to(device)), {k: v.detach().cpu() for k, v in model.named_parameters()}


def _one_gpu(rank, world):
    model, x, y = build("gpt")  # built on the CPU, run on the GPU: auto_parallelize moves the shards
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = meshplan.auto_parallelize(model, devices=1, example_inputs=(x,), mixed_precision="fp32")  # as the reference
    assert all(p.device.type == "cuda" for p in pmodel.parameters())
    losses, norms = _train(pmodel, x.cuda(), y.cuda())
    return losses, norms


def test_world_one_on_one_gpu():
    (ref_losses, ref_norms), _ = _reference("cuda")
    [(losses, norms)] = run_local(1, _one_gpu, backend="nccl", timeout=600)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- pmodel.step() on host batches, against one process

def _steps(model, x, y, loss_fn, opt, *, planned: bool):
    """STEPS clipped steps; (losses, norms). A planned model takes the host batch through `step()` and clips with
    `clip_grad_norm_`, every plan's calls; the reference runs the same by hand."""
    losses, norms = [], []
    for _ in range(STEPS):
        if planned:
            loss = model.step(x, target=y)
            norm = model.clip_grad_norm_(MAX_NORM)
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
        norms.append(float(norm))
    return losses, norms


def _one_process(build_case, optimizer=torch.optim.SGD):
    """The reference: the model of `build_case()` trained in this process, on the host: the models' tensor literals
    are host tensors, which only the runtime moves to the device."""
    model, x, y, loss = build_case()
    result = _steps(model, x, y, loss, optimizer(model.parameters(), lr=LR[optimizer]), planned=False)
    return result, {k: v.detach().cpu() for k, v in model.named_parameters()}


def _assert_parity(losses, norms, params, layouts, mesh, rank, reference) -> None:
    (ref_losses, ref_norms), ref_params = reference
    for got, want in zip(losses, ref_losses):  # None on a pipeline's first stage: the loss lives on the last
        if got is not None:
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-5)
    for fqn, local in params.items():  # a pipeline rank's, of its stages, on its stage's mesh
        want = shard_tensor(ref_params[fqn], layouts[fqn], mesh, rank % mesh.size)
        torch.testing.assert_close(local, want, rtol=1e-3, atol=1e-5, msg=lambda m: f"rank {rank} {fqn}: {m}")


def _planned(rank, world, build_case, options, optimizer=torch.optim.SGD):
    model, x, y, loss = build_case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), loss_fn=loss, mixed_precision="fp32",
                                           **options)
    losses, norms = _steps(pmodel, x, y, loss, pmodel.make_optimizer(optimizer, lr=LR[optimizer]), planned=True)
    params = {k: local_of(v.detach()).cpu() for k, v in pmodel.named_parameters()}
    layouts = {f: p.layout for p in pmodel.plan.params for f in p.fqns}
    expert_axes = [moe_axes(n.strategy.inputs)[0] for n in pmodel.plan.nodes if n.target == MOE_TARGET]
    kernels = {n.strategy.kernel for n in pmodel.plan.nodes if n.strategy.kernel}
    return losses, norms, params, layouts, pmodel.plan.mesh, expert_axes, kernels


ONE_GPU = {
    # name: (model, batch and loss; plan options; optimizer)
    "tensor literals": (scaled, {}, torch.optim.SGD),
    "moe": (moe, {}, torch.optim.SGD),
    "offloaded Adam": (gpt, dict(offload="always", cluster="h100"), torch.optim.Adam),  # a preset with host memory
}


def _one_gpu_cases(rank, world):
    return {name: _planned(rank, world, *case) for name, case in ONE_GPU.items()}


def test_one_gpu_runs_literals_moe_and_offload_from_host_batches():
    """Lifted constants, the moe op, host targets and offloaded optimizer state on the GPU, against one process."""
    [results] = run_local(1, _one_gpu_cases, backend="nccl", timeout=600)
    for name, (build_case, _, optimizer) in ONE_GPU.items():
        losses, norms, params, layouts, mesh, _, _ = results[name]
        _assert_parity(losses, norms, params, layouts, mesh, 0, _one_process(build_case, optimizer))


CP = dict(axis_names=("cp",), input_layouts={"tokens": "S(1)"})

NCCL = {
    # name: (model, batch and loss; plan options by world[; context-parallel kernels forced]); data parallel takes
    # every GPU, the others two
    "dp": (gpt, lambda world: plan_kwargs("gpt", "data_parallel", (world,))),
    "tp": (gpt, lambda world: plan_kwargs("gpt", "megatron", (world,))),
    "fsdp": (gpt, lambda world: plan_kwargs("gpt", "fsdp", (world,))),
    "pp": (gpt, lambda world: pipelined(world)),
    "ep": (functools.partial(moe, split=2), lambda world: dict(mesh_shape=(world,), **EXPERT_PARALLEL)),
    "literals": (scaled, lambda world: dict(mesh_shape=(world,), param_layouts={"layers.*.weight": "S(0)"})),
    # context parallel (the GPT's causal attention split along the sequence, the kernel forced): the blocks on the
    # kernel SDPA picks, the ring's and the swap's point-to-point exchanges and Ulysses' all-to-alls over NCCL
    "cp ring": (gpt, lambda world: dict(CP, mesh_shape=(world,)), ("ring",)),
    "cp balanced ring": (gpt, lambda world: dict(CP, mesh_shape=(world,)), ("ring_balanced",)),
    "cp ulysses": (gpt, lambda world: dict(CP, mesh_shape=(world,)), ("ulysses",)),
    # torch's ring templates with the blocks on the kernel SDPA picks (regions/torch_ring.py), in head-tail token order
    "cp torch ring": (gpt, lambda world: dict(CP, mesh_shape=(world,), token_order=True), ("torch_ring",)),
}


def _nccl_worker(rank, world, kind):
    build_case, options, *forced = NCCL[kind]
    with force_context_parallel(*forced[0]) if forced else contextlib.nullcontext():
        return _planned(rank, world, build_case, options(world))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", NCCL)
def test_nccl_parity(kind):
    world = torch.cuda.device_count() if kind == "dp" else 2
    reference = _one_process(NCCL[kind][0])
    forced = NCCL[kind][2] if len(NCCL[kind]) > 2 else ()
    for rank, (losses, norms, params, layouts, mesh, expert_axes, kernels) in enumerate(
            run_local(world, _nccl_worker, kind, backend="nccl", timeout=600)):
        assert kind != "ep" or expert_axes == [(0,)], f"the moe op is not expert parallel: experts split over {expert_axes}"
        assert kernels == {kernel_name(v, True) for v in forced}, f"{kind}: the plan runs kernels {kernels}"
        _assert_parity(losses, norms, params, layouts, mesh, rank, reference)
