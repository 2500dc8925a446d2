"""Dropout with p > 0: every rank draws the single-device model's masks, so parity holds under
tensor and data parallelism (planner/rules/random.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _parity import STEPS, loss_fn, megatron_layouts

import meshplan
from meshplan.ir.op_kinds import is_random
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.2))
    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, tokens


def train(model, tokens) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn("gpt", model(tokens), tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _plans():
    model, tokens = build()
    params, inputs = megatron_layouts("gpt", 1)
    params22, inputs22 = megatron_layouts("gpt", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = lambda shape, **kw: meshplan.plan(model, devices=4, example_inputs=(tokens,), mesh_shape=shape, **kw)  # noqa: E731
        return {
            "tensor parallel (4,)": plan((4,), param_layouts=params, input_layouts=inputs),
            "data parallel (4,)": plan((4,), mode="data_parallel"),
            "data x tensor parallel (2,2)": plan((2, 2), param_layouts=params22, input_layouts=inputs22),
        }


def _worker(rank, world, graph, plans):
    out = {}
    for name, plan in plans.items():
        model, tokens = build()  # the reference's generator state at the start of training
        if rank:
            torch.manual_seed(1234 + rank)  # ranks start apart; ParallelModule makes them agree
        pmodel = ParallelModule(model, graph, plan)
        losses = train(pmodel, tokens)
        out[name] = (losses, {k: local_of(v.detach()) for k, v in pmodel.named_parameters()})
    return out


@pytest.mark.multiprocess
def test_dropout_parity_under_tensor_and_data_parallel():
    model, tokens = build()
    graph = trace(model, (tokens,))
    random_nodes = [n for n in graph.nodes if is_random(n.target)]
    assert random_nodes, "the GPT with dropout must trace random ops"
    plans = _plans()
    for plan in plans.values():
        assert all(plan.strategy_of(n.name).outputs[0] == (meshplan.Replicate(),) * plan.mesh.ndim for n in random_nodes)
    # the masks are drawn: the output differs from the same model's without dropout
    model, tokens = build()
    with torch.no_grad():
        dropped = model(tokens)
        assert (dropped - model.eval()(tokens)).abs().max() > 1e-2
    model, tokens = build()
    reference = train(model, tokens)
    results = run_local(4, _worker, graph, plans, timeout=900)
    ref_params = dict(model.named_parameters())
    for name, plan in plans.items():
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        for rank, per_plan in enumerate(results):
            losses, params = per_plan[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} rank {rank}: {m}")
            for fqn, local in params.items():
                want = shard_tensor(ref_params[fqn].detach(), layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} rank {rank} {fqn}: {m}")


def test_random_ops_are_only_ever_drawn_whole():
    """DTensor would let a mask be drawn shard by shard (a different mask); meshplan's rule allows
    only the whole draw, on every mesh the solver may consider."""
    from meshplan.ir.mesh import MeshSpec
    from meshplan.planner.strategies import generate

    model, tokens = build()
    graph = trace(model, (tokens,))
    for shape in ((4,), (2, 2)):
        cands = generate(graph, MeshSpec(shape, tuple("xy"[: len(shape)])))
        for n in graph.nodes:
            if is_random(n.target):
                assert [s.source for s in cands.by_node[n.name]] == ["meshplan"], n.name
                assert all(p == meshplan.Replicate() for s in cands.by_node[n.name] for p in s.outputs[0])
