"""Mixture of experts (transformers' Mixtral): the moe region op, its strategies and costs, and
parity of data-, expert- and expert-split parallel plans on real gloo processes."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from _moe import BATCH, SEQ, build_mixtral, mixtral_config, plan_traced, train

import meshplan
from meshplan.cost_model.collectives import collective_time
from meshplan.cost_model.presets import get_cluster
from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.ir.trace import trace
from meshplan.plans.plan import Plan
from meshplan.plans.strategy import Strategy
from meshplan.regions.moe import MOE_REGION, MOE_TARGET, moe_reference
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor

WIDE = 256
"""Experts' intermediate size at which expert parallelism still pays with recomputed layers on the CPU preset (at
the default 64, gathering the experts is cheaper than rerunning the all-to-alls)."""


@functools.lru_cache(maxsize=1)
def _traced():
    model, tokens = build_mixtral()
    return trace(model, (tokens,))


def _moe_strategies(plan: Plan) -> list:
    return [n.strategy for n in plan.nodes if n.target == MOE_TARGET]


def test_moe_op_matches_the_mixtral_block():
    model, _ = build_mixtral()
    block = model.model.layers[0].mlp
    x = torch.randn(3, 5, 32, requires_grad=True)
    ours = torch.ops.meshplan.moe(x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, 2, True, "silu")
    theirs = block(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ours)
    got = torch.autograd.grad(ours, [x, block.gate.weight, block.experts.gate_up_proj], g)
    want = torch.autograd.grad(theirs, [x, block.gate.weight, block.experts.gate_up_proj], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mixtral_traces_each_moe_block_as_one_op():
    model, tokens = build_mixtral()
    graph = trace(model, (tokens,))
    assert graph.fingerprint() == _traced().fingerprint()
    moes = [n for n in graph.nodes if n.target == MOE_TARGET]
    assert [n.module_path for n in moes] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(n.attrs == (2, True, "silu") for n in moes)
    assert "forward" not in model.model.layers[0].mlp.__dict__, "the trace must leave the model as it was"
    with pytest.raises(ValueError, match="top_k=5"):
        moe_reference(torch.randn(2, 32), *(torch.randn(4, 32), torch.randn(4, 128, 32), torch.randn(4, 32, 64)), 5, True, "silu")
    with pytest.raises(ValueError, match="activation 'tanh'"):
        moe_reference(torch.randn(2, 32), torch.randn(4, 32), torch.randn(4, 128, 32), torch.randn(4, 32, 64), 2, True, "tanh")


def test_expert_parallel_cost_prices_its_all_to_alls():
    graph = _traced()
    node = next(n for n in graph.nodes if n.target == MOE_TARGET)
    metas = [graph.meta(r) for r in node.inputs]
    cluster = get_cluster("h100")
    r, s = (Replicate(),), (Shard(0),)
    dp = MOE_REGION.cost(node, metas, Strategy((s, r, r, r), (s,)), (4,), cluster, backward=True)
    ep = MOE_REGION.cost(node, metas, Strategy((s, r, s, s), (s,)), (4,), cluster, backward=True)
    split = MOE_REGION.cost(node, metas, Strategy((r, r, s, s), ((Partial(),),)), (4,), cluster, backward=True)
    assert dp.forward == () and split.forward == () and dp.comm_s == 0.0
    assert [c.kind for c in ep.forward] == ["all_to_all"] * 3 and [c.kind for c in ep.backward] == ["all_to_all"] * 2
    routed = BATCH * SEQ // 4 * 2 * 32 * 4  # local tokens x top_k x hidden x fp32
    assert ep.forward[1].nbytes == routed
    link = cluster.link_for_axis((4,), 0)
    expected = sum(collective_time("all_to_all", c.nbytes, 4, link) for c in ep.forward + ep.backward)
    assert ep.comm_s == pytest.approx(expected) and ep.comm_s > 0
    assert dp.compute_s > ep.compute_s  # same FLOPs, but data parallel reads every expert's weights


@functools.lru_cache(maxsize=1)
def _traced_wide():
    model, tokens = build_mixtral(intermediate_size=WIDE)
    return trace(model, (tokens,))


def _expert_parallel_plan(graph, recompute: str, **kw):
    """Tokens enter each moe block split over 4 devices, experts split: expert parallel, with `recompute`."""
    model, _ = build_mixtral(intermediate_size=WIDE)
    for layer in model.model.layers:
        meshplan.shard(layer.mlp, in_strategy=((4, 1, 1),))
    return plan_traced(model, graph, (4,), param_layouts={"*.experts.*": "S(0)"}, recompute=recompute, **kw)


def test_a_recomputed_moe_layer_prices_its_forward_and_its_token_exchanges_again():
    graph = _traced_wide()
    keep, again = _expert_parallel_plan(graph, "never"), _expert_parallel_plan(graph, "always")
    assert again.recompute and [n.strategy for n in keep.nodes] == [n.strategy for n in again.nodes]
    cluster = get_cluster("cpu")
    rerun_comm = 0.0
    for a, b in zip(keep.nodes, again.nodes):
        if a.target != MOE_TARGET:
            continue
        assert b.strategy.inputs[2] == (Shard(0),)  # expert parallel
        node = graph[a.name]
        forward = MOE_REGION.cost(node, [graph.meta(r) for r in node.inputs], b.strategy, (4,), cluster, backward=False)
        assert [s.kind for s in forward.forward] == ["all_to_all"] * 3 and forward.comm_s > 0
        assert b.time_s == pytest.approx(a.time_s + forward.compute_s)  # the experts run again in backward
        rerun_comm += forward.comm_s  # and so do the token exchanges
    moves_again = sum(t.time_s for t in again.transfers) - sum(t.time_s for t in keep.transfers)
    assert again.comm_s - keep.comm_s == pytest.approx(moves_again + rerun_comm)
    assert again.collectives()["recompute:all_to_all"] == 6


def test_the_planner_chooses_expert_parallelism_when_it_pays():
    """Experts of 2 x 1024 x 4096 on 8 H100s: replicating them costs more gradient all-reduce and
    memory than moving the routed tokens all-to-all."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(hidden_size=1024, intermediate_size=4096, num_local_experts=8, vocab_size=1024,
                         max_position_embeddings=512, num_attention_heads=8, num_key_value_heads=8)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    tokens = torch.zeros(16, 512, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, devices=8, example_inputs=(tokens,), mesh_shape=(8,), cluster="h100")
    for s in _moe_strategies(plan):
        assert s.inputs[2] == (Shard(0),) and isinstance(s.inputs[0][0], Shard), f"expected expert parallel, got {s}"
    assert plan.collectives()["forward:all_to_all"] == 6 and plan.collectives()["backward:all_to_all"] == 4
    assert Plan.from_json(plan.to_json()) == plan


def _plans(graph):
    model, _ = build_mixtral()
    plans = {
        "auto (2,2)": plan_traced(model, graph, (2, 2)),
        "experts split, tokens replicated (4,)": plan_traced(model, graph, (4,), param_layouts={"*.experts.*": "S(0)"}),
    }
    for layer in model.model.layers:  # tokens enter each moe block split over every device
        meshplan.shard(layer.mlp, in_strategy=((4, 1, 1),))
    plans["expert parallel (4,)"] = plan_traced(model, graph, (4,), param_layouts={"*.experts.*": "S(0)"})
    plans["data x expert parallel (2,2)"] = plan_traced(model, graph, (2, 2), param_layouts={"*.experts.*": "RS(0)"})
    return plans


def _worker(rank, world, graph, plans, overrides):
    model, tokens = build_mixtral(**overrides)
    out = {}
    for name, plan in plans.items():
        pmodel = ParallelModule(model, graph, plan)
        pmodel.reset_collective_counts()
        losses = train(pmodel, tokens)
        out[name] = (losses, pmodel.collective_counts(), {k: local_of(v.detach()) for k, v in pmodel.named_parameters()})
    return out


@pytest.mark.multiprocess
def test_mixtral_parity_under_expert_parallel_plans():
    graph = _traced()
    plans = _plans(graph)
    ep = _moe_strategies(plans["expert parallel (4,)"])
    assert all(s.inputs[0] == (Shard(0),) and s.inputs[2] == (Shard(0),) for s in ep), ep
    dxe = _moe_strategies(plans["data x expert parallel (2,2)"])
    assert all(s.inputs[0] == (Shard(0), Shard(0)) and s.inputs[2] == (Replicate(), Shard(0)) for s in dxe), dxe
    split = _moe_strategies(plans["experts split, tokens replicated (4,)"])
    assert all(s.outputs[0] == (Partial(),) for s in split), split

    _check_parity(graph, plans, {})
    assert plans["expert parallel (4,)"].collectives()["forward:all_to_all"] == 6


@pytest.mark.multiprocess
def test_mixtral_parity_under_expert_parallelism_with_recomputed_layers():
    """Each layer's forward, the token exchanges included, runs again in backward, as the plan lists."""
    graph = _traced_wide()
    plan = _expert_parallel_plan(graph, "always")
    assert plan.collectives()["recompute:all_to_all"] == 6
    _check_parity(graph, {"expert parallel (4,), recomputed": plan}, {"intermediate_size": WIDE})


def _check_parity(graph, plans: dict, overrides: dict) -> None:
    """Every plan trains 3 steps on 4 gloo ranks like one process and runs the collectives it lists."""
    model, tokens = build_mixtral(**overrides)
    results = run_local(4, _worker, graph, plans, overrides, timeout=900)
    reference = train(model, tokens)
    ref_params = dict(model.named_parameters())
    for name, plan in plans.items():
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        expected = {k: v * 3 for k, v in plan.collectives().items()}
        for rank, per_plan in enumerate(results):
            losses, counts, params = per_plan[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-6)
            assert set(params) == set(ref_params)
            for fqn, local in params.items():
                want = shard_tensor(ref_params[fqn].detach(), layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} rank {rank} {fqn}: {m}")
            assert dict(counts) == expected, f"{name}: rank {rank} ran {dict(counts)}, the plan lists {expected}"