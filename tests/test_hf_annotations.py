"""Semi-auto annotations and propagation search on Hugging Face models (issue 5 on issue 3's models):
the annotated layouts hold in the plan, everything else is searched (or propagated), and the plans
train with the single-process model's losses, parameters and the plan's collectives on gloo ranks."""

from __future__ import annotations

import warnings

import pytest
from _hf_parity import hf_check_parity, hf_plan, hf_rank_worker

import meshplan
from meshplan.models.hf import hf_model
from meshplan.runtime.launch import run_local

S0, S1, R = meshplan.Shard(0), meshplan.Shard(1), meshplan.Replicate()

# Megatron on HF Llama's own module names (nn.Linear weights are [out, in])
LLAMA_TP = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _layouts(plan) -> dict[str, tuple]:
    return {f: p.layout for p in plan.params for f in p.fqns}


@pytest.fixture(scope="module")
def plans():
    # Megatron by name patterns, plus MindSpore strategy tuples on one module of the same model:
    # layer 0's up_proj sees x split over dp (the outer axis) and its out features over tp
    model, args, kwargs = hf_model("llama")
    meshplan.shard(model.get_submodule("model.layers.0.mlp.up_proj"), in_strategy=((2, 1), (2, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        semi = meshplan.plan(
            model, devices=4, example_inputs=args, example_kwargs=kwargs, mesh_shape=(2, 2), mode="semi_auto", parallelize_plan=LLAMA_TP,
        )
    # GPT-2's Conv1D weights are [in, out]: a per-parameter plan on them, the rest propagated
    prop = hf_plan(
        "gpt2", (2,), search="propagation",
        parameter_plan={"transformer.h.*.attn.c_attn.weight": (S1,), "transformer.h.*.attn.c_proj.weight": (S0,)},
    )
    return {"semi": semi, "prop": prop}


def test_semi_auto_keeps_the_annotations_and_searches_the_rest(plans):
    semi = _layouts(plans["semi"])
    for layer in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert semi[f"model.layers.{layer}.{name}.weight"][1] == S0, name  # colwise on the inner (tp) axis
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert semi[f"model.layers.{layer}.{name}.weight"][1] == S1, name  # rowwise
    up = next(n for n in plans["semi"].nodes if n.module_path == "model.layers.0.mlp.up_proj" and n.target.startswith("aten.mm"))
    assert up.strategy.inputs[0] == (S0, R), "the meshplan.shard strategy pins the matmul's x: rows over dp"
    assert plans["semi"].mode == "semi_auto" and plans["semi"].solver.status == "optimal"


def test_propagation_spreads_the_annotated_layouts(plans):
    prop = plans["prop"]
    layouts = _layouts(prop)
    assert layouts["transformer.h.0.attn.c_attn.weight"] == (S1,) and layouts["transformer.h.1.attn.c_proj.weight"] == (S0,)
    assert prop.solver.backend == "propagation"
    assert any(t.forward for t in prop.transfers), "a row-parallel c_proj needs a reduction somewhere"


def test_bad_annotation_on_an_hf_model_names_both_sides():
    with pytest.raises(ValueError, match="model.layers.9"):
        hf_plan("llama", (2,), mode="semi_auto", parallelize_plan={"model.layers.9.mlp.up_proj": "colwise"})


@pytest.mark.multiprocess
def test_parity_of_annotated_hf_plans(plans):
    semi, prop = plans["semi"], plans["prop"]
    results_4 = run_local(4, hf_rank_worker, [("llama", semi)], timeout=900)
    hf_check_parity("llama", semi, [r[0] for r in results_4])
    results_2 = run_local(2, hf_rank_worker, [("gpt2", prop)], timeout=900)
    hf_check_parity("gpt2", prop, [r[0] for r in results_2])
