"""Gradient accumulation on real gloo processes: two backward passes before the optimizer step
give the gradients one process accumulates (each micro-step's gradient is summed over ranks once),
for data-parallel, Megatron and FSDP-style plans and for a pipeline's `step()` called twice."""

from __future__ import annotations

import warnings

import pytest
import torch
from _parity import build, loss_fn, plan_kwargs
from test_pipeline_parity import BATCH, data, pipe_plan, stage_plan
from test_pipeline_parity import loss_fn as pipe_loss

import meshplan
from meshplan.ir.trace import trace
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor

pytestmark = pytest.mark.multiprocess

KINDS = ["data_parallel", "megatron", "fsdp"]


def _batches():
    _, x, y = build("gpt")
    x2 = torch.randint(0, 128, x.shape, generator=torch.Generator().manual_seed(7))
    return [(x, y), (x2, x2)]


def _plans(world: int):
    model, x, _ = build("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [meshplan.plan(model, world, (x,), **plan_kwargs("gpt", kind, (world,))) for kind in KINDS]


def _accumulating_worker(rank, world, plans):
    warnings.simplefilter("ignore")
    out = []
    for plan in plans:
        model, x, _ = build("gpt")
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan)
        for xb, yb in _batches():  # no zero_grad between the two micro-steps
            loss_fn("gpt", pmodel(xb), yb).backward()
        accumulated = {k: local_of(v.grad).clone() for k, v in pmodel.named_parameters()}
        pmodel.zero_grad()
        xb, yb = _batches()[1]
        loss_fn("gpt", pmodel(xb), yb).backward()  # and a single backward after zero_grad is unchanged
        single = {k: local_of(v.grad).clone() for k, v in pmodel.named_parameters()}
        out.append((accumulated, single))
    return out


def test_two_backward_passes_accumulate_like_one_process():
    world = 2
    plans = _plans(world)
    results = run_local(world, _accumulating_worker, plans, timeout=600)
    model, _, _ = build("gpt")
    for xb, yb in _batches():
        loss_fn("gpt", model(xb), yb).backward()
    accumulated = {k: v.grad.clone() for k, v in model.named_parameters()}
    model.zero_grad()
    xb, yb = _batches()[1]
    loss_fn("gpt", model(xb), yb).backward()
    single = {k: v.grad.clone() for k, v in model.named_parameters()}
    for kind, plan, *per_rank in zip(KINDS, plans, *results):
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        for rank, (got_acc, got_single) in enumerate(per_rank):
            for fqn in accumulated:
                for got, ref, what in ((got_acc, accumulated, "accumulated"), (got_single, single, "single")):
                    want = shard_tensor(ref[fqn], layouts[fqn], plan.mesh, rank)
                    torch.testing.assert_close(got[fqn], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{kind} rank {rank} {fqn} {what}: {m}")


def _pipeline_worker(rank, world, plan):
    warnings.simplefilter("ignore")
    model, x = data()
    runner = ParallelModule(model, trace(model, (x[: BATCH // plan.pipeline.microbatches],)), plan, loss_fn=pipe_loss)
    x2 = torch.randint(0, 64, x.shape, generator=torch.Generator().manual_seed(7))
    runner.step(x, target=x)
    runner.step(x2, target=x2)
    return {n: local_of(p.grad).clone() for n, p in runner.named_parameters()}, runner.comm.rank


def test_two_pipeline_steps_accumulate_like_one_process():
    pipe = pipe_plan("1f1b", 2, ["pre", "layers.2"])
    plan = stage_plan("dp", (1,), pipe)
    results = run_local(2, _pipeline_worker, plan, timeout=600)
    model, x = data()
    x2 = torch.randint(0, 64, x.shape, generator=torch.Generator().manual_seed(7))
    for xb in (x, x2):
        pipe_loss(model(xb), xb).backward()
    layouts = {prm.fqns[0]: prm.layout for prm in plan.params}
    seen = set()
    for rank, (grads, local) in enumerate(results):
        for name, g in grads.items():
            want = shard_tensor(dict(model.named_parameters())[name].grad, layouts[name], plan.mesh, local)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
            seen.add(name)
    assert seen == {n for n, _ in model.named_parameters()}
