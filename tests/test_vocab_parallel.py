"""Vocabulary parallelism: the embedding table and the LM head split along the vocabulary, lookups
masked (DTensor's MaskPartial), log-softmax by max/sum all-reduces; the logits are never gathered."""

from __future__ import annotations

import warnings

import pytest
from _hf_parity import hf_check_parity, hf_plan, hf_rank_worker

from meshplan.ir.graph import TensorRef
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.ir.trace import trace
from meshplan.models.hf import hf_model
from meshplan.planner.strategies import generate
from meshplan.plans.plan import Plan
from meshplan.plans.strategy import Strategy
from meshplan.runtime.launch import run_local

BIG = "llama_big_vocab"
VOCAB = 32768
LOCAL_WHOLE_BATCH = {"inputs": "local", "input_layouts": {"input_ids": "R", "labels": "R"}}
"""Every rank passes the whole batch and gets its own shard of the outputs (the logits stay split)."""


@pytest.fixture(scope="module")
def big_plan():
    return hf_plan(BIG, (4,), **LOCAL_WHOLE_BATCH)


@pytest.fixture(scope="module")
def embedding_plan():
    """GPT-2 with the (tied) token embedding split along the vocabulary and no batch split."""
    return hf_plan("gpt2", (4,), param_layouts={"transformer.wte.weight": "S(0)"}, **LOCAL_WHOLE_BATCH)


def test_masked_and_log_softmax_kernels_are_candidates():
    model, args, kwargs = hf_model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, args, kwargs)
    cands = generate(graph, MeshSpec((2,)))
    emb = cands.by_node["embedding"]
    assert Strategy(((Shard(0),), (Replicate(),)), ((Partial(),),), "dtensor", "masked") in emb
    soft = [s for s in cands.by_node["_log_softmax"] if s.kernel]
    assert [str(s) for s in soft] == ["S(1)->S(1) [log_softmax(dim=1)]"] and soft[0].source == "meshplan"
    gather = {str(s) for s in cands.by_node["gather"] if s.kernel == "masked"}
    assert "S(1),R->P [masked]" in gather
    assert Strategy.from_json(soft[0].to_json()) == soft[0] and "kernel" not in emb[0].to_json()


def test_solver_picks_vocab_parallel_loss_and_never_gathers_logits(big_plan):
    kernels = {n.target: n.strategy.kernel for n in big_plan.nodes if n.strategy.kernel}
    assert kernels == {"aten._log_softmax.default": "log_softmax(dim=1)", "aten.gather.default": "masked"}
    model, args, kwargs = hf_model(BIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, args, kwargs)
    head = next(n for n in big_plan.nodes if n.module_path == "lm_head" and n.target == "aten.mm.default")
    assert head.strategy.outputs[0] == (Shard(1),)  # the logits are computed split along the vocabulary
    for t in big_plan.transfers:
        ref = _ref(t.tensor)
        if graph[ref.node].kind == "op" and graph.meta(ref).shape[-1] == VOCAB:
            assert "all_gather" not in {s.kind for s in t.forward}, f"the logits {t.tensor} {graph.meta(ref)} are gathered: {t}"
    counts = big_plan.collectives()
    # 2 all-reduces (max, sum) forward and 1 backward inside the sharded log-softmax
    assert counts["forward:all_reduce"] == 2 and counts["backward:all_reduce"] == 1


def _ref(text: str) -> TensorRef:
    name, _, idx = text.partition("[")
    return TensorRef(name, int(idx.rstrip("]") or 0))


def test_plan_file_keeps_the_kernels(big_plan):
    again = Plan.from_json(big_plan.to_json())
    assert again.hash() == big_plan.hash() and again.collectives() == big_plan.collectives()


@pytest.mark.multiprocess
def test_vocab_parallel_plans_train_with_parity(big_plan, embedding_plan):
    assert any(n.strategy.kernel == "masked" and n.target == "aten.embedding.default" for n in embedding_plan.nodes)
    jobs = [(BIG, big_plan), ("gpt2", embedding_plan)]
    results = run_local(4, hf_rank_worker, jobs, timeout=900)
    for i, (name, plan) in enumerate(jobs):
        hf_check_parity(name, plan, [r[i] for r in results])
