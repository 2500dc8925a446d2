"""Parity harness for the Hugging Face models: the loss comes out of the model (`labels=`), so one
launch of real gloo processes can train several (model, plan) pairs and report each one."""

from __future__ import annotations

import functools
import math
import warnings

import torch

import meshplan
from meshplan.models.hf import hf_model
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

STEPS = 2


def hf_model_called(name: str, flags: dict | None = None):
    """`hf_model(name)` with `flags` (non-tensor keyword inputs such as `use_cache=False`) among its kwargs."""
    model, args, kwargs = hf_model(name)
    return model, args, {**kwargs, **(flags or {})}


def hf_plan(name: str, mesh_shape: tuple[int, ...], *, flags: dict | None = None, **kw):
    model, args, kwargs = hf_model_called(name, flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(model, devices=math.prod(mesh_shape), example_inputs=args, example_kwargs=kwargs, mesh_shape=mesh_shape, **kw)


def hf_train(model, args, kwargs, steps: int = STEPS) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*args, **kwargs).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def hf_rank_worker(rank: int, world: int, jobs: list[tuple[str, object]], flags: dict | None = None):
    """On every rank, for each (model name, plan): train the planned model (called with `flags` too); report
    losses, counts, params."""
    out = []
    for name, plan in jobs:
        model, args, kwargs = hf_model_called(name, flags)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=args, example_kwargs=kwargs, plan=plan)
        pmodel.reset_collective_counts()
        losses = hf_train(pmodel, args, kwargs)
        params = {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}
        out.append((losses, pmodel.collective_counts(), params, pmodel.plan.hash()))
    return out


@functools.lru_cache(maxsize=None)
def hf_reference(name: str, flags: tuple = ()) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and parameters of the single-process model (called with the (key, value) `flags`) after `STEPS`
    steps (the same for every plan)."""
    model, args, kwargs = hf_model_called(name, dict(flags))
    losses = hf_train(model, args, kwargs)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def hf_check_parity(name: str, plan, results, *, flags: dict | None = None, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """`results`: one (losses, counts, params, plan hash) per rank for this (name, plan), called with `flags`."""
    reference, ref_params = hf_reference(name, tuple(sorted((flags or {}).items())))
    layouts = {f: p.layout for p in plan.params for f in p.fqns}
    expected = {k: v * STEPS for k, v in plan.collectives().items()}
    for rank, (losses, counts, params, plan_hash) in enumerate(results):
        where = f"{name} on mesh {plan.mesh.shape}, rank {rank}"
        assert plan_hash == plan.hash(), where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=rtol, atol=atol, msg=lambda m: f"{where} loss: {m}")
        assert set(params) == set(ref_params), f"{where}: ParallelModule must expose the model's own parameter names"
        for fqn, local in params.items():
            want = shard_tensor(ref_params[fqn], layouts[fqn], plan.mesh, rank)
            torch.testing.assert_close(local, want, rtol=rtol, atol=atol, msg=lambda m: f"{where} {fqn}: {m}")
        assert dict(counts) == expected, f"{where} executed {dict(counts)} but the plan lists {expected}"
