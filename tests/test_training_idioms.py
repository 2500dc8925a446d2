"""The training loop users write, unchanged on a ParallelModule, gives one process's numbers.

One loop, under a data-parallel, a Megatron tensor-parallel and a 2-D plan on 4 gloo ranks:
gradient accumulation over two micro-batches with `no_sync()` on the first, `clip_grad_norm_`
with a limit small enough to bite, AdamW with weight decay, a StepLR scheduler,
`zero_grad(set_to_none=True)` and `(set_to_none=False)` in turn, and `torch.no_grad()` inference.
Each rank's losses, clip norms, gradient shards, parameters and inference outputs are compared with
the same loop on the plain model in one process, and the collectives of the deferred micro-step are
counted.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from _parity import loss_fn, megatron_layouts

import meshplan
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.launch import run_local
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor

MICRO = 2
STEPS = 2
MAX_NORM = 0.02  # the reference's gradient norms are ~0.5: clipping scales every step


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    data = torch.randint(0, 128, (STEPS * MICRO + 1, 8, 16), generator=torch.Generator().manual_seed(1))
    return model, data


def train(model, data, *, no_sync=None, counts=None):
    """The user's loop. Returns losses, clip norms, the gradients seen by the last step, inference output."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            deferred = micro < MICRO - 1
            with no_sync() if (deferred and no_sync) else contextlib.nullcontext():
                if counts is not None:
                    counts.reset_collective_counts()
                tokens = data[step * MICRO + micro]
                loss = loss_fn("gpt", model(tokens), tokens) / MICRO
                loss.backward()
                if counts is not None:
                    counts.log.append((deferred, dict(counts.collective_counts())))
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        grads = {k: (v.grad.to_local() if hasattr(v.grad, "to_local") else v.grad).clone() for k, v in model.named_parameters()}
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    with torch.no_grad():
        out = model(data[-1])
    return losses, norms, grads, out


class _Counts:
    def __init__(self, pmodel):
        self.reset_collective_counts, self.collective_counts, self.log = pmodel.reset_collective_counts, pmodel.collective_counts, []


def _plans():
    model, data = build()
    tp, tp_inputs = megatron_layouts("gpt", 1)
    tp2, tp2_inputs = megatron_layouts("gpt", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = lambda shape, **kw: meshplan.plan(model, devices=4, example_inputs=(data[0],), mesh_shape=shape, **kw)  # noqa: E731
        return {
            "data parallel (4,)": plan((4,), mode="data_parallel"),
            "tensor parallel (4,)": plan((4,), param_layouts=tp, input_layouts=tp_inputs),
            "data x tensor parallel (2,2)": plan((2, 2), param_layouts=tp2, input_layouts=tp2_inputs),
        }


def _worker(rank, world, graph, plans):
    out = {}
    for name, plan in plans.items():
        model, data = build()
        pmodel = ParallelModule(model, graph, plan)
        counts = _Counts(pmodel)
        losses, norms, grads, inferred = train(pmodel, data, no_sync=pmodel.no_sync, counts=counts)
        params = {k: v.detach().to_local() for k, v in pmodel.named_parameters()}
        out[name] = (losses, norms, grads, params, inferred, counts.log)
    return out


@pytest.mark.multiprocess
def test_user_training_loop_matches_one_process_under_dp_tp_and_2d():
    model, data = build()
    graph = trace(model, (data[0],))
    plans = _plans()
    model, data = build()
    ref_losses, ref_norms, ref_grads, ref_out = train(model, data)
    assert min(ref_norms) > 10 * MAX_NORM, "the limit must make clipping scale the gradients"
    ref_params = dict(model.named_parameters())
    results = run_local(4, _worker, graph, plans, timeout=900)
    for name, plan in plans.items():
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        buckets = len(plan.buckets)
        for rank, result in enumerate(results):
            losses, norms, grads, params, inferred, log = result[name]
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} losses: {m}")
            # one global norm on every rank, as one process computes it
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} clip norms: {m}")
            for fqn, local in grads.items():
                want = shard_tensor(ref_grads[fqn], layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} grad {fqn}: {m}")
            for fqn, local in params.items():
                want = shard_tensor(ref_params[fqn].detach(), layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} param {fqn}: {m}")
            torch.testing.assert_close(inferred, ref_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} no_grad output: {m}")
            # no_sync defers every gradient all-reduce to the last micro-step, which runs each bucket once
            for deferred, counts in log:
                synced = counts.get("grad_sync:all_reduce", 0)
                assert synced == (0 if deferred else buckets), f"{where}: {'deferred' if deferred else 'last'} micro-step ran {synced} bucket all-reduces"
        if "data" in name:
            assert buckets > 0, f"{name} must reduce gradients over the data-parallel axis"
