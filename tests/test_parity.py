"""Invariants 1-3 on real gloo processes: loss and every parameter after 3 steps equal the
single-process model's; the collectives executed equal the plan's; every rank has the same plan."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _parity import build, check_parity, plan_kwargs, rank_worker, train

import meshplan
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of

pytestmark = pytest.mark.multiprocess

CONFIGS = [(2, (2,)), (4, (4,)), (4, (2, 2))]


def _plan(name: str, kind: str, mesh_shape):
    model, x, _ = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=math.prod(mesh_shape), example_inputs=(x,), **plan_kwargs(name, kind, mesh_shape))


@pytest.mark.parametrize("kind", ["auto", "data_parallel", "megatron"])
@pytest.mark.parametrize("world,mesh_shape", CONFIGS, ids=["w2", "w4", "w2x2"])
@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_parity(name, world, mesh_shape, kind):
    plan = _plan(name, kind, mesh_shape)
    results = run_local(world, rank_worker, name, plan, timeout=600)
    check_parity(name, plan, results)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_parity_of_fsdp_style_sharded_parameters(name):
    """ZeRO/FSDP: parameters, gradients and optimizer state live sharded; each use all-gathers."""
    plan = _plan(name, "fsdp", (4,))
    assert all(p.layout == (meshplan.Shard(0),) for p in plan.params if not p.is_buffer)
    assert plan.collectives()["forward:all_gather"] > 0
    results = run_local(4, rank_worker, name, plan, timeout=600)
    check_parity(name, plan, results)


def test_forced_plans_have_the_requested_layouts():
    dp = _plan("gpt", "data_parallel", (2, 2))
    assert {p.layout for p in dp.params} == {(meshplan.Replicate(), meshplan.Replicate())}
    assert [i.layout for i in dp.inputs] == [(meshplan.Shard(0), meshplan.Shard(0))]
    mt = _plan("gpt", "megatron", (2, 2))
    by_fqn = {f: p.layout for p in mt.params for f in p.fqns}
    assert by_fqn["layers.0.attn.q_proj.weight"] == (meshplan.Replicate(), meshplan.Shard(0))
    assert by_fqn["layers.1.mlp.fc2.weight"] == (meshplan.Replicate(), meshplan.Shard(1))


def _plan_on_rank(rank, world):
    model, x, y = build("gpt")
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), mesh_shape=(world,))
    return pmodel.plan.hash()


def test_every_rank_plans_identically():
    """Each rank plans on its own (no plan passed in); the solver is deterministic."""
    hashes = run_local(2, _plan_on_rank, timeout=600)
    assert hashes[0] == hashes[1]


def _local_inputs_worker(rank, world, plan):
    model, x, y = build("mlp")
    rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan)
    losses = train(pmodel, x[rows], y[rows], "mlp")  # each rank loads only its slice
    return losses, {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}


def test_local_inputs_train_like_the_whole_batch():
    """inputs="local": ranks pass their own data-parallel slice; gradients average like DDP's."""
    model, x, y = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan = meshplan.plan(model, devices=2, example_inputs=(x,), mode="data_parallel", inputs="local")
    assert plan.inputs[0].layout == (meshplan.Shard(0),)
    results = run_local(2, _local_inputs_worker, plan, timeout=300)
    reference = train(model, x, y, "mlp")
    mean_losses = [sum(r[0][i] for r in results) / 2 for i in range(3)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    for fqn, p in model.named_parameters():
        for _, params in results:
            torch.testing.assert_close(params[fqn], p.detach(), rtol=1e-4, atol=1e-6)
