"""Annotated plans on real gloo processes: each annotation form and mode trains with the loss and
gradients of one process, and executes exactly the collectives its plan lists."""

from __future__ import annotations

import math
import warnings

import pytest
from _parity import build, check_parity, rank_worker
from torch.distributed.tensor import Shard as DShard

import meshplan
from meshplan import Layout
from meshplan.ir.placement import fmt
from meshplan.runtime.launch import run_local

pytestmark = pytest.mark.multiprocess

MEGATRON_LLAMA = {
    "layers.*.attn.q_proj": "colwise", "layers.*.attn.k_proj": "colwise", "layers.*.attn.v_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def _plan(model, x, mesh_shape, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=math.prod(mesh_shape), example_inputs=(x,), mesh_shape=mesh_shape, **kw)


def _run(name: str, plan) -> None:
    results = run_local(plan.mesh.size, rank_worker, name, plan, timeout=600)
    check_parity(name, plan, results)


def _layouts(plan) -> dict[str, str]:
    return {f: fmt(p.layout) for p in plan.params for f in p.fqns}


def test_semi_auto_with_mindspore_tuples_on_gpt_2x2():
    model, x, _ = build("gpt")
    for block in model.layers:  # Megatron MLP in MindSpore's MatMul strategies: batch on dp, features on tp
        meshplan.shard(block.mlp.fc1, in_strategy=((2, 1), (2, 1)))
        meshplan.shard(block.mlp.fc2, in_strategy=((2, 2), (1, 2)))
    plan = _plan(model, x, (2, 2), mode="semi_auto")
    lay = _layouts(plan)
    assert lay["layers.0.mlp.fc1.weight"] == "RS(0)" and lay["layers.1.mlp.fc2.weight"] == "RS(1)"
    _run("gpt", plan)


def test_layout_with_a_dim_over_two_axes_on_gpt_2x2():
    model, x, _ = build("gpt")
    layout = Layout((2, 2), ("dp", "tp"))
    plan = _plan(
        model, x, (2, 2), mode="semi_auto",
        parameter_plan={"layers.*.mlp.fc1.weight": layout(("dp", "tp"), "None")},
        input_layouts={"tokens": layout(("dp", "tp"), "None")},
    )
    assert _layouts(plan)["layers.0.mlp.fc1.weight"] == "S(0)S(0)" and fmt(plan.inputs[0].layout) == "S(0)S(0)"
    _run("gpt", plan)


def test_name_pattern_megatron_on_llama_world4():
    model, x, _ = build("llama")
    plan = _plan(model, x, (4,), mode="semi_auto", parallelize_plan=MEGATRON_LLAMA)
    lay = _layouts(plan)
    assert lay["layers.0.attn.q_proj.weight"] == "S(0)" and lay["layers.1.mlp.down_proj.weight"] == "S(1)"
    _run("llama", plan)


def test_manual_mode_on_llama_world4():
    model, x, _ = build("llama")
    plan = _plan(
        model, x, (4,), mode="manual", parallelize_plan=MEGATRON_LLAMA,
        parameter_plan={"*norm.weight": "R", "embed.weight": "R", "lm_head.weight": "R"}, input_layouts={"tokens": "R"},
    )
    assert plan.solver.backend == "propagation"
    _run("llama", plan)


def test_propagation_search_with_dtensor_placements_on_gpt_world2():
    model, x, _ = build("gpt")
    ilp = _plan(model, x, (2,), parameter_plan={"layers.*.mlp.fc1.weight": (DShard(0),)})
    plan = _plan(model, x, (2,), parameter_plan={"layers.*.mlp.fc1.weight": (DShard(0),)}, search="propagation")
    assert plan.solver.backend == "propagation" and plan.solver.objective_s >= ilp.solver.objective_s
    assert _layouts(plan)["layers.1.mlp.fc1.weight"] == "S(0)"
    _run("gpt", plan)


def test_sequence_parallel_norms_with_megatron_on_llama_world2():
    model, x, _ = build("llama")
    styles = MEGATRON_LLAMA | {"layers.*.input_norm": "sequence_parallel", "layers.*.post_attn_norm": "sequence_parallel"}
    plan = _plan(model, x, (2,), mode="semi_auto", parallelize_plan=styles)
    norm_ops = [n for n in plan.nodes if n.module_path == "layers.1.post_attn_norm"]
    assert norm_ops and all(fmt(n.strategy.outputs[0]) == "S(1)" for n in norm_ops)  # computed on sequence shards
    _run("llama", plan)
