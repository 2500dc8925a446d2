"""The runtime on GPUs: one GPU in one process, and NCCL parity on every GPU of the machine.

Skipped without CUDA (the default test run has none); run them where a GPU is lent with
`python -m pytest tests/gpu -m cuda`. docs/runtime.md says which of them have ever run.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/_parity.py
from _parity import build, loss_fn, megatron_layouts  # noqa: E402

import meshplan  # noqa: E402
from meshplan.runtime.launch import run_local  # noqa: E402
from meshplan.runtime.local_view import local_of  # noqa: E402
from meshplan.runtime.parallel_module import shard_tensor  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 3


def _train(model, x, y, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for _ in range(steps):
        loss = loss_fn("gpt", model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.02)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _reference(device: str):
    model, x, y = build("gpt")
    model.to(device)
    return _train(model, x.to(device), y.to(device)), {k: v.detach().cpu() for k, v in model.named_parameters()}


def _one_gpu(rank, world):
    torch.cuda.set_device(0)
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


def _nccl_worker(rank, world, kind):
    model, x, y = build("gpt")
    kw = {"mode": "data_parallel"} if kind == "dp" else dict(zip(("param_layouts", "input_layouts"), megatron_layouts("gpt", 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), mesh_shape=(world,), mixed_precision="fp32", **kw)
    losses, norms = _train(pmodel, x.cuda(), y.cuda())
    layouts = {f: p.layout for p in pmodel.plan.params for f in p.fqns}
    # a data-parallel plan keeps plain (replicated) parameters: a plain tensor is its own local
    return losses, norms, {k: local_of(v.detach()).cpu() for k, v in pmodel.named_parameters()}, layouts, pmodel.plan.mesh


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["dp", "tp"])
def test_nccl_parity(kind):
    world = 2 if kind == "tp" else torch.cuda.device_count()
    (ref_losses, ref_norms), ref_params = _reference("cuda")
    for rank, (losses, norms, params, layouts, mesh) in enumerate(run_local(world, _nccl_worker, kind, backend="nccl", timeout=600)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-5)
        for fqn, local in params.items():
            torch.testing.assert_close(local, shard_tensor(ref_params[fqn], layouts[fqn], mesh, rank), rtol=1e-3, atol=1e-5)
