"""A ResNet (conv, batch norm, max pool, residual adds): convolution and batch-norm strategies, and
parity of batch- (SyncBN) and channel-sharded plans on real gloo processes, running statistics included."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _moe import plan_traced

import meshplan
from meshplan.ir.placement import Replicate, Shard
from meshplan.ir.trace import trace
from meshplan.models.resnet import ResNet
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor

STEPS = 3
BN = "aten._native_batch_norm_legit_functional.default"
CONV = "aten.convolution.default"


def build():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return ResNet(), x, y


def train(model, x, y) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=1)
def _traced():
    model, x, _ = build()
    return trace(model, (x,))


def _strategies(plan, target):
    return [n.strategy for n in plan.nodes if n.target == target]


CHANNELS = {  # every conv and batch norm split on its output channels
    "*conv*": "S(0)", "*bn*.weight": "S(0)", "*bn*.bias": "S(0)", "*bn*.running_*": "S(0)",
    "stem.0.weight": "S(0)", "stem.1.weight": "S(0)", "stem.1.bias": "S(0)", "stem.1.running_*": "S(0)",
}


def _plans(graph):
    model, _, _ = build()
    plans = {
        "auto (4,)": plan_traced(model, graph, (4,)),
        "auto (2,2)": plan_traced(model, graph, (2, 2)),
        "output channels (4,)": plan_traced(model, graph, (4,), param_layouts=CHANNELS, input_layouts={"x": "R"}),
    }
    for m in model.modules():  # every batch norm sees a quarter of the batch
        if isinstance(m, torch.nn.BatchNorm2d):
            meshplan.shard(m, in_strategy=((4, 1, 1, 1),))
    plans["batch, SyncBN (4,)"] = plan_traced(model, graph, (4,), mode="semi_auto", input_layouts={"x": "S(0)"})
    plans["batch, SyncBN (2,2)"] = plan_traced(model, graph, (2, 2), mode="semi_auto", input_layouts={"x": "S(0)S(0)"})
    return plans


def test_rules_offer_batch_and_channel_sharding():
    from meshplan.ir.mesh import MeshSpec
    from meshplan.planner.strategies import generate

    cands = generate(_traced(), MeshSpec((4,), ("x",)))
    conv = next(n.name for n in _traced().nodes if n.target == CONV and n.module_path == "layers.0.conv1")  # 8 -> 8 channels
    bn = next(n.name for n in _traced().nodes if n.target == BN)
    convs = {str(s) for s in cands.by_node[conv]}
    assert {"R,R->R", "S(0),R->S(0)", "R,S(0)->S(1)", "S(1),S(1)->P"} <= convs, convs
    bns = {str(s) for s in cands.by_node[bn]}
    assert "S(0),R,R,R,R->S(0),R,R,R,R" in bns and "S(1),S(0),S(0),S(0),S(0)->S(1),S(0),S(0),S(0),S(0)" in bns, bns
    assert not cands.fallbacks


def _worker(rank, world, graph, plans):
    model, x, y = build()
    out = {}
    for name, plan in plans.items():
        pmodel = ParallelModule(model, graph, plan)
        pmodel.reset_collective_counts()
        losses = train(pmodel, x, y)
        out[name] = (losses, pmodel.collective_counts(), {k: local_of(v.detach()).clone() for k, v in pmodel.state_dict().items()})
    return out


@pytest.mark.multiprocess
def test_resnet_parity_with_sync_batch_norm_and_channel_sharding():
    graph = _traced()
    plans = _plans(graph)
    for name in ("batch, SyncBN (4,)", "batch, SyncBN (2,2)"):
        plan = plans[name]
        assert all(all(p == Shard(0) for p in s.inputs[0]) for s in _strategies(plan, BN)), name
        bn_nodes = [n for n in plan.nodes if n.target == BN]
        assert all(len(n.forward_comm) == plan.mesh.ndim and len(n.backward_comm) == plan.mesh.ndim for n in bn_nodes)
    assert any(s.inputs[1] == (Shard(0),) and s.outputs[0] == (Shard(1),) for s in _strategies(plans["output channels (4,)"], CONV))
    assert any(s.inputs[0] == (Shard(1),) for s in _strategies(plans["output channels (4,)"], BN))
    assert all(not p.fallbacks for p in plans.values())

    results = run_local(4, _worker, graph, plans, timeout=900)
    model, x, y = build()
    reference = train(model, x, y)
    state = model.state_dict()
    for name, plan in plans.items():
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        expected = {k: v * STEPS for k, v in plan.collectives().items()}
        for rank, per_plan in enumerate(results):
            losses, counts, local = per_plan[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-6)
            assert set(local) == set(state)
            for fqn, value in local.items():  # parameters and running statistics
                want = shard_tensor(state[fqn], layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} rank {rank} {fqn}: {m}")
            assert dict(counts) == expected, f"{name}: rank {rank} ran {dict(counts)}, the plan lists {expected}"
    assert Replicate() not in plans["batch, SyncBN (4,)"].inputs[0].layout
