"""Hugging Face transformers models (GPT-2, Llama, BERT, T5, ViT; tiny configs, random weights):
each traces, plans on a (4,) and a (2, 2) mesh, and trains on 4 real gloo processes with the loss,
gradients (parameters after SGD steps) and collectives of the single-process model and its plan.
One launch runs all ten plans."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from _hf_parity import hf_check_parity, hf_plan, hf_rank_worker

from meshplan.inspect.ops import graph_ops
from meshplan.ir.mesh import MeshSpec
from meshplan.models.hf import HF_MODELS
from meshplan.runtime.launch import run_local

MESHES = [(4,), (2, 2)]
HEAVY = 0.01
"""An op above this share of the model's FLOPs may not run replicated."""


def _gen_models():
    spec = importlib.util.spec_from_file_location("gen_models", Path(__file__).resolve().parents[1] / "docs" / "gen_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _gen_models()


@pytest.fixture(scope="module")
def graphs():
    return GEN.graphs()


@pytest.fixture(scope="module")
def plans():
    return {(name, mesh): hf_plan(name, mesh) for name in HF_MODELS for mesh in MESHES}


@pytest.mark.multiprocess
def test_hf_models_train_with_parity_on_both_meshes(plans):
    jobs = list(plans)
    results = run_local(4, hf_rank_worker, [(name, plans[name, mesh]) for name, mesh in jobs], timeout=1200)
    for i, (name, mesh) in enumerate(jobs):
        hf_check_parity(name, plans[name, mesh], [r[i] for r in results])


@pytest.mark.parametrize("name", HF_MODELS)
def test_no_heavy_op_is_replicated(name, plans, graphs):
    """No op above 1% of the FLOPs lacks a rule or has only replicated candidates, and no plan runs
    one on the replicate fallback. (The solver may still choose to compute one whole where moving
    its inputs costs more than the compute, as for GPT-2's small LM head on a 4-way batch.)"""
    graph = graphs[name]
    for mesh in MESHES:
        report = graph_ops(graph, MeshSpec(mesh))
        assert report.total_flops > 0
        heavy = [o for o in report.ops if o.share > HEAVY]
        assert heavy, f"{name}: no op above {HEAVY:.0%} of the FLOPs"
        assert not report.replicated_over(HEAVY), f"{name} on {mesh}: {report.replicated_over(HEAVY)}"
        plan = plans[name, mesh]
        assert not [f for f in plan.fallbacks if any(f.startswith(f"{o.target} ({o.node})") for o in heavy)]
        chosen = {n.name: n.strategy for n in plan.nodes}
        for o in heavy:
            assert chosen[o.node].source != "fallback", f"{name}: {o.node} ({o.target}) falls back"


def test_flop_shares_add_up(graphs):
    graph = graphs["gpt2"]
    report = graph_ops(graph, MeshSpec((4,)))
    assert abs(sum(o.share for o in report.ops) - 1.0) < 1e-9
    mm = [o for o in report.ops if o.target == "aten.addmm.default"]
    # GPT-2's 8 block projections and no others are addmm; each is 2*M*K*N
    def two_mkn(o) -> int:  # addmm(bias, x [M, K], w [K, N])
        _, x, w = (graph.meta(r) for r in graph[o.node].inputs)
        return 2 * x.shape[0] * x.shape[1] * w.shape[1]

    assert len(mm) == 8 and all(o.flops == two_mkn(o) for o in mm)
    assert mm[0].flops == 2 * 64 * 64 * 192


def test_models_page_is_current(graphs):
    """docs/models.md is what docs/gen_models.py writes for the models as they trace now."""
    assert GEN.PAGE.read_text() == GEN.render(graphs), "docs/models.md is out of date: run python docs/gen_models.py"
