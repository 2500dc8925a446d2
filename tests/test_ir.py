"""Tracing into the IR: nodes, metas, parameter FQNs, tied weights, repeated layers, verifier, printer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.ir import TensorMeta, TensorRef, trace
from meshplan.ir.printer import format_graph
from meshplan.ir.verify import verify
from meshplan.models import GPT, GPTConfig, Llama, LlamaConfig


@pytest.fixture(scope="module")
def gpt_graph():
    return trace(GPT(GPTConfig()), (torch.randint(0, 128, (4, 16)),))


def test_tied_embedding_is_one_parameter_node(gpt_graph):
    tied = [n for n in gpt_graph.nodes if "lm_head.weight" in n.fqns]
    assert len(tied) == 1 and tied[0].fqns == ("wte.weight", "lm_head.weight")
    assert tied[0].out == TensorMeta((128, 64), "float32")


def test_nodes_carry_ops_metas_and_module_paths(gpt_graph):
    mms = [n for n in gpt_graph.nodes if n.target == "aten.addmm.default"]
    assert len(mms) == 12  # 4 attention + 2 MLP projections per layer, 2 layers
    q = next(n for n in mms if n.module_path == "layers.0.attn.q_proj")
    assert q.out.shape == (64, 64)
    sdpa = [n for n in gpt_graph.nodes if n.target == "aten.scaled_dot_product_attention.default"]
    assert [n.out.shape for n in sdpa] == [(4, 4, 16, 16)] * 2
    ln = next(n for n in gpt_graph.nodes if n.target == "aten.native_layer_norm.default")
    assert len(ln.outputs) == 3 and ln.requires_grad == (True, False, False)


def test_requires_grad_follows_parameters_not_inputs(gpt_graph):
    assert gpt_graph["tokens"].requires_grad == (False,)
    by_target = {n.target: n for n in gpt_graph.nodes}
    assert by_target["aten.arange.start_step"].requires_grad == (False,)
    assert by_target["aten.embedding.default"].requires_grad == (True,)


def test_repeated_layers_are_grouped():
    g = trace(Llama(LlamaConfig(layers=3)), (torch.randint(0, 128, (2, 16)),))
    assert g.layer_groups() == {"layers.*": ["layers.0", "layers.1", "layers.2"]}
    assert {n.kind for n in g.nodes if n.fqns and n.fqns[0] in ("cos", "sin")} == {"buffer"}


def test_verifier_catches_broken_order(gpt_graph):
    verify(gpt_graph)
    nodes = list(gpt_graph.nodes)
    i = next(i for i, n in enumerate(nodes) if n.kind == "op")
    bad = dataclasses.replace(nodes[i], inputs=(TensorRef("output"),))
    with pytest.raises(AssertionError, match="before it is produced"):
        verify(type(gpt_graph)(nodes[:i] + [bad] + nodes[i + 1 :]))


def test_printer_lists_every_node(gpt_graph):
    text = format_graph(gpt_graph)
    assert text.splitlines()[0].startswith(f"graph: {len(gpt_graph)} nodes, repeated layers: layers.* x2")
    assert "wte.weight = lm_head.weight" in text
    assert len(text.splitlines()) == len(gpt_graph) + 1


def test_fingerprint_changes_with_shapes():
    a = trace(GPT(GPTConfig()), (torch.randint(0, 128, (4, 16)),))
    b = trace(GPT(GPTConfig()), (torch.randint(0, 128, (2, 16)),))
    assert a.fingerprint() != b.fingerprint()
