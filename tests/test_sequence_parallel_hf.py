"""Megatron sequence parallelism on Hugging Face Llama: tensor-parallel attention and MLP, and the
RMS norms between them computed on sequence shards, so each tensor-parallel region ends in a
reduce-scatter and starts with an all-gather instead of an all-reduce."""

from __future__ import annotations

import pytest
from _hf_parity import hf_check_parity, hf_plan, hf_rank_worker

from meshplan.ir.placement import Shard
from meshplan.runtime.launch import run_local

TP = {f"model.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")} | {
    "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
}
SP = {"model.layers.*.input_layernorm": "sequence_parallel", "model.layers.*.post_attention_layernorm": "sequence_parallel"}
WHOLE_BATCH = {"input_ids": "R", "labels": "R"}
"""No data parallelism: the 2 devices split only the model."""


@pytest.fixture(scope="module")
def plans():
    tp = hf_plan("llama", (2,), mode="semi_auto", parallelize_plan=TP, input_layouts=WHOLE_BATCH)
    sp = hf_plan("llama", (2,), mode="semi_auto", parallelize_plan=TP | SP, input_layouts=WHOLE_BATCH)
    return tp, sp


def test_norms_run_on_sequence_shards_between_tp_regions(plans):
    tp, sp = plans
    norms = [n for n in sp.nodes if n.module_path.endswith("layernorm") and n.target == "aten.mul.Tensor"]
    assert norms and all(n.strategy.outputs[0] == (Shard(1),) for n in norms)
    # Megatron TP: one all-reduce after each of the 2 x 2 row-parallel projections (and its dual in backward)
    assert tp.collectives()["forward:all_reduce"] == 4 and "forward:reduce_scatter" not in tp.collectives()
    # with SP the all-reduces become reduce-scatters into the sequence shards (all-gathers in backward) ...
    c = sp.collectives()
    assert "forward:all_reduce" not in c and c["forward:reduce_scatter"] == 4 and c["backward:all_gather"] >= 4
    # ... and the tensors between the regions are kept split in half: less activation memory per device (the solver's
    # sum of what is kept; the walked peak on gloo also holds each reduce-scatter's full-size scratch)
    assert sp.solver.memory_bound < tp.solver.memory_bound


@pytest.mark.multiprocess
def test_sequence_parallel_llama_trains_with_parity(plans):
    tp, sp = plans
    results = run_local(2, hf_rank_worker, [("llama", tp), ("llama", sp)], timeout=900)
    for i, plan in enumerate((tp, sp)):
        hf_check_parity("llama", plan, [r[i] for r in results])
