"""Head-tail token order (`plan(token_order=True)`): every tensor split over the `cp` axis held as chunks r and 2P-1-r.

Parity runs 2 and 4 gloo ranks against one process (fp32: the loss, every gradient of the first step, every parameter
after 3 AdamW steps) and checks that the collectives executed equal the plan's, as tests/test_context_parallel.py
does for the contiguous kernels; the planning checks run in one process.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_context_parallel import (MEGATRON, SDPA, _build, _check_parity, _compare, _hf_train, _hf_worker, _kernels, _only,
                                   _plan, _train, _worker, flattened_in_place)

import meshplan
from meshplan.cost_model.compute import attention_pairs
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Replicate, Shard
from meshplan.ir.trace import trace
from meshplan.models import Llama, LlamaConfig
from meshplan.models.next_token_loss import NextTokenLoss
from meshplan.regions.log_softmax import LOG_SOFTMAX_REGION
from meshplan.regions.masked_lookup import MASKED_EMBEDDING_REGION, MASKED_GATHER_REGION
from meshplan.models.hf import hf_model
from meshplan.planner.annotations import AnnotationError
from meshplan.plans.plan import Plan
from meshplan.regions.context_parallel import causal_pairs, kernel_name
from meshplan.runtime import token_order
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor


def _ordered(name: str, world: int, variant: str | None, **kw):
    return _plan(name, world, kernel_name(variant, True) if variant else None, token_order=True, **kw)


# ---------------------------------------------------------------- the order

@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_place_holds_chunks_r_and_2p_minus_1_minus_r(n):
    x = torch.arange(4 * n * 3).view(2, 2 * n * 3).float()  # 2n chunks of 3 along dim 1
    blocks = [token_order.take(x, 1, n, p) for p in range(n)]
    for p, block in enumerate(blocks):
        first, second = token_order.owned_chunks(p, n)
        assert torch.equal(block, torch.cat([x[:, 3 * first:3 * first + 3], x[:, 3 * second:3 * second + 3]], dim=1))
    assert torch.equal(token_order.join(blocks, 1), x)
    assert torch.equal(token_order.stacked(x, 1, n), torch.stack(blocks))  # what a reduce-scatter or all-to-all sends
    assert torch.equal(sum(token_order.put(b, 1, n, p) for p, b in enumerate(blocks)), x)
    with pytest.raises(ValueError, match="length 10 does not split into 2 x 2 = 4 equal chunks"):
        token_order.take(torch.zeros(10), 0, 2, 0)


def test_inputs_are_sliced_in_token_order_inside_the_outer_axes_blocks():
    x = torch.arange(2 * 8).view(2, 8)
    mesh = MeshSpec((2, 2), ("dp", "cp"))
    # rank 3 = (dp 1, cp 1): batch row 1, then chunks 1 and 2 of 4 along the sequence
    assert torch.equal(shard_tensor(x, (Shard(0), Shard(1)), mesh, 3, head_tail_axis=1), x[1:, [2, 3, 4, 5]])
    assert torch.equal(shard_tensor(x, (Shard(0), Shard(1)), mesh, 2, head_tail_axis=1), x[1:, [0, 1, 6, 7]])
    assert torch.equal(shard_tensor(x, (Shard(0), Shard(1)), mesh, 2), x[1:, :4])  # the contiguous order


# ---------------------------------------------------------------- planning

def test_token_order_kernels_are_priced_balanced_without_the_swaps():
    """Compute as the balanced kernels' (chunks r and 2P-1-r: 68 of the contiguous split's 100 pairs on the busiest
    rank, see test_context_parallel.test_priced_with_the_issue_formulas), collectives as the unbalanced kernels'."""
    b, s, h, e, p = 2, 16, 32, 4, 2
    contiguous = {v: next(n for n in _plan("gpt", p, kernel_name(v, True)).nodes if n.target == SDPA)
                  for v in ("allgather", "balanced", "ring")}
    ordered = {v: next(n for n in _ordered("gpt", p, v).nodes if n.target == SDPA) for v in ("headtail", "ring_headtail")}
    assert causal_pairs("headtail", p, s // p) == 68 == attention_pairs(s, s, True) // p
    head = ordered["headtail"]
    assert [(st.kind, st.nbytes) for st in head.forward_comm] == [("all_gather", 2 * b * s * h * e)]
    assert [st.kind for st in head.backward_comm] == ["reduce_scatter"]
    assert head.time_s == pytest.approx(contiguous["allgather"].time_s * 68 / 100)
    # the balanced kernel's compute, less its swaps of half the queries and their output
    assert head.time_s == pytest.approx(contiguous["balanced"].time_s)
    assert [st.kind for st in contiguous["balanced"].forward_comm] == ["all_gather", "send_recv", "send_recv"]
    ring = ordered["ring_headtail"]
    assert [st.kind for st in ring.forward_comm] == [st.kind for st in contiguous["ring"].forward_comm] == ["send_recv"]
    assert [st.kind for st in ring.backward_comm] == ["send_recv"] * 3


def test_ulysses_in_token_order_is_priced_as_ulysses_and_needs_twice_the_heads():
    """The same four all-to-alls, bytes and work as Ulysses; its all-to-alls cut the heads as the sequence is (chunks r
    and 2P-1-r of 2P), so the heads on a device must divide by 2P."""
    contiguous = next(n for n in _plan("gpt", 2, kernel_name("ulysses", True)).nodes if n.target == SDPA)
    ordered = next(n for n in _ordered("gpt", 2, "ulysses_headtail").nodes if n.target == SDPA)
    assert [(st.kind, st.nbytes) for st in ordered.forward_comm] == [(st.kind, st.nbytes) for st in contiguous.forward_comm]
    assert [st.kind for st in ordered.forward_comm] == ["all_to_all"] * 4
    assert [(st.kind, st.nbytes) for st in ordered.backward_comm] == [(st.kind, st.nbytes) for st in contiguous.backward_comm]
    assert ordered.time_s == pytest.approx(contiguous.time_s)
    text = str(_ordered("gpt", 4, None).explain("scaled_dot_product_attention"))  # 4 heads over cp=4
    assert ("context-parallel attention (ulysses_headtail) over mesh axis cp=4: 4 query heads per device do not divide by 8 "
            "(all-to-all from sequence to heads)") in text
    assert "cp_attention(ulysses,causal) reads contiguous blocks on mesh axis 'cp'" in text


def test_explain_says_what_token_order_rules_out():
    plan = _ordered("llama", 4, None)
    text = str(plan.explain("scaled_dot_product_attention"))
    assert "cp_attention(balanced,causal) reads contiguous blocks on mesh axis 'cp', and token_order=True holds them" in text
    assert "cp_attention(headtail,causal)" in text and "cp_attention(ring_headtail,causal)" in text
    assert "does not cut into 2 x 4 equal chunks where mesh axis 'cp' splits it" in text  # 4 heads over cp=4
    without = str(_plan("llama", 4, None).explain("scaled_dot_product_attention"))
    assert "cp_attention(headtail,causal) runs on head-tail token-order blocks: plan with token_order=True" in without


def test_parameters_may_be_stored_split_over_cp_and_are_read_whole_on_it():
    """FSDP over cp in token order (torchtitan shards over dp x cp): a parameter's blocks over cp are contiguous, as
    DTensor, the optimizer and checkpoints hold them, so every op but the weight's own cast reads it whole on cp.
    Buffers stay unsplit on cp (a RoPE table is indexed by the sequence)."""
    plan = _ordered("llama", 4, "ring_headtail", axes=("dp", "cp"), tokens_layout="S(0)S(1)", param_layouts={"*weight": "S(0)S(0)"})
    assert plan.token_order and {p.layout for p in plan.params if not p.is_buffer} >= {(Shard(0), Shard(0))}
    model, tokens = _build("llama")
    graph = trace(model, (tokens,))
    readers = {(t.consumer, t.position): t.dst for t in plan.transfers}
    for node in plan.nodes:
        if node.name in graph.param_values:
            continue
        for pos, ref in enumerate(graph[node.name].inputs):
            if ref.node in graph.param_values:
                assert not isinstance(readers.get((node.name, pos), node.strategy.inputs[pos])[1], Shard), (node.name, pos)
    with pytest.raises(AnnotationError, match=r"cos in S\(0\)S\(0\).* \(token_order=True keeps buffers unsplit on mesh axis 'cp'.*"
                       r"allowed: RR, S\(0\)R, S\(1\)R"):
        _ordered("llama", 4, None, axes=("dp", "cp"), tokens_layout="S(0)S(1)", param_layouts={"*": "S(0)S(0)"})


def test_token_order_needs_a_cp_axis_and_whole_inputs():
    with pytest.raises(ValueError, match="token_order=True orders the splits of a mesh axis named 'cp', and mesh dp=2 has axes 'dp'"):
        _ordered("gpt", 2, None, axes=("dp",), tokens_layout="S(0)")
    with pytest.raises(ValueError, match="token_order=True takes whole inputs \\(inputs='global'\\); got inputs='local'"):
        _ordered("gpt", 2, None, inputs="local")
    model, tokens = _build("gpt")
    with pytest.raises(ValueError, match="token_order must be True, False or None; got 'yes'"):
        meshplan.plan(model, 2, (tokens,), token_order="yes")


def test_the_plan_file_keeps_the_order():
    plan = _ordered("gpt", 2, "headtail")
    again = Plan.from_json(plan.to_json())
    assert again.token_order and again.head_tail_axis == 0 and again.hash() == plan.hash()
    assert "token order: every tensor split over the cp axis is held as chunks r and 2P-1-r" in plan.summary()
    contiguous = _plan("gpt", 2, kernel_name("allgather", True))
    assert "token_order" not in contiguous.to_dict() and Plan.from_json(contiguous.to_json()).head_tail_axis is None
    d = plan.to_dict()
    with pytest.raises(ValueError, match="plan file is malformed: token_order is 'yes'; expected bool"):
        Plan.from_json(json.dumps({**d, "token_order": "yes"}))
    d["mesh"]["axis_names"] = ["dp"]
    with pytest.raises(ValueError, match="token_order is true, which orders the splits of a 'cp' axis, and mesh dp=2 has none"):
        Plan.from_json(json.dumps(d))


# ---------------------------------------------------------------- parity on gloo ranks

@pytest.mark.multiprocess
@pytest.mark.parametrize("name,world,variant", [("gpt", 2, "headtail"), ("gpt", 2, "ring_headtail"), ("llama", 2, "headtail"),
                                                ("llama", 4, "headtail"), ("llama", 4, "ring_headtail"),
                                                ("gpt", 2, "ulysses_headtail"), ("llama", 2, "ulysses_headtail"),
                                                ("gpt", 2, "torch_ring"), ("llama", 4, "torch_ring")])
def test_parity(name, world, variant):
    plan = _ordered(name, world, variant)
    assert plan.token_order and _kernels(plan) == {kernel_name(variant, True)}
    results = run_local(world, _worker, name, plan, timeout=900)
    _check_parity(name, plan, results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,variant", [("gpt", "headtail"), ("llama", "ring_headtail"), ("llama", "torch_ring")])
def test_parity_cp_by_tp(name, variant):
    """cp x tp (2 x 2): Megatron's projections on tp, the sequence on cp in token order."""
    plan = _ordered(name, 4, variant, axes=("cp", "tp"), tokens_layout="S(1)R", param_layouts=MEGATRON[name])
    node = next(n for n in plan.nodes if n.target == SDPA)
    assert node.strategy.inputs[0] == (Shard(2), Shard(1)), node.strategy
    results = run_local(4, _worker, name, plan, timeout=900)
    _check_parity(name, plan, results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["headtail", "ring_headtail", "ulysses_headtail", "torch_ring"])
def test_parity_dp_by_cp_with_fsdp_storage_on_dp(variant):
    plan = _ordered("gpt", 4, variant, axes=("dp", "cp"), tokens_layout="S(0)S(1)", param_layouts={"*": "S(0)R"})
    assert {p.layout for p in plan.params} == {(Shard(0), Replicate())}
    results = run_local(4, _worker, "gpt", plan, timeout=900)
    _check_parity("gpt", plan, results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("axes,layout", [(("dp", "cp"), "S(0)S(0)"), (("cp",), "S(0)")])
def test_parity_with_parameters_stored_split_over_cp(axes, layout):
    """FSDP over cp (and dp): the weights' blocks gathered over cp in contiguous order, the activations' in head-tail
    order. Fails with the weights' gathers in head-tail order."""
    world = 4 if len(axes) == 2 else 2
    plan = _ordered("llama", world, "ring_headtail", axes=axes, tokens_layout="S(0)S(1)" if len(axes) == 2 else "S(1)",
                    param_layouts={"*weight": layout})
    assert any(isinstance(p.layout[-1], Shard) for p in plan.params)
    results = run_local(world, _worker, "llama", plan, timeout=900)
    _check_parity("llama", plan, results)


def _wide_vocab():
    """A vocabulary wide enough that the loss runs vocabulary-parallel (the log-softmax and masked gather kernels)."""
    torch.manual_seed(0)
    model = NextTokenLoss(Llama(LlamaConfig(vocab_size=65536, seq_len=16, hidden=32, heads=4, kv_heads=2, intermediate=64, layers=1)))
    return model, torch.randint(0, 65536, (1, 16), generator=torch.Generator().manual_seed(1))


def _wide_vocab_worker(rank: int, world: int, plan):
    model, tokens = _wide_vocab()
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan)
    pmodel.reset_collective_counts()
    losses, grads = _train(pmodel, tokens, local_of, loss_of=lambda m: m(tokens))
    return losses, grads, {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}, pmodel.collective_counts()


def test_kernels_that_read_no_block_position_run_in_token_order():
    """The vocabulary-parallel log-softmax reduces over its dim and a masked gather with its rows split computes each
    row on its own: token order offers them over cp. A lookup whose table is split over cp along the looked-up dim
    reads its block's offset: ruled out."""
    node = SimpleNamespace(meta={"val": torch.empty(32, 64)})
    rows, vocab = (Shard(0), Shard(1)), (Shard(1), Shard(1))  # (cp, tp) layouts of the table
    assert not MASKED_GATHER_REGION.reads_block_positions(SimpleNamespace(inputs=(rows, rows)), (node, 1, node), 0)
    assert MASKED_GATHER_REGION.reads_block_positions(SimpleNamespace(inputs=(vocab, (Replicate(), Replicate()))), (node, 1, node), 0)
    assert MASKED_GATHER_REGION.reads_block_positions(SimpleNamespace(inputs=(vocab, vocab)), (node, -1, node), 0)
    assert MASKED_EMBEDDING_REGION.reads_block_positions(SimpleNamespace(inputs=((Shard(0),), (Replicate(),))), (node, node), 0)
    assert not LOG_SOFTMAX_REGION.reads_block_positions(SimpleNamespace(inputs=(vocab,)), (node, 1, False), 0)


@pytest.mark.multiprocess
def test_parity_of_a_vocabulary_parallel_loss_with_rows_over_cp():
    """cp x tp (2 x 2), the head's vocabulary over tp: the loss's log-softmax and masked gather run with their rows in
    head-tail token order over cp. Token order used to refuse every kernel but its own attention that split anything
    over cp, which left Llama-3-70B's dp x cp x tp stage plan at 131k tokens holding its logits whole over dp and cp."""
    model, tokens = _wide_vocab()
    with warnings.catch_warnings(), _only(kernel_name("ring_headtail", True)):
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, devices=4, mesh_shape=(2, 2), axis_names=("cp", "tp"), example_inputs=(tokens,),
                             input_layouts={"tokens": "S(1)R"}, token_order=True, param_layouts={"lm.lm_head.weight": "RS(0)"})
    used = {(n.strategy.kernel, n.strategy.inputs[0]) for n in plan.nodes if n.strategy.kernel and n.target != SDPA}
    assert used == {("log_softmax(dim=1)", (Shard(0), Shard(1))), ("masked", (Shard(0), Shard(1)))}, used
    results = run_local(4, _wide_vocab_worker, plan, timeout=900)
    ref_losses, ref_grads = _train(model, tokens, loss_of=lambda m: m(tokens))
    _compare(plan, dict(model.named_parameters()), ref_losses, ref_grads, results)


@pytest.mark.multiprocess
def test_parity_dp_by_cp_linear_layers_keep_the_sequence_split():
    """The linear layers' flatten of one sequence per dp rank keeps the cp chunks in token order."""
    plan = _ordered("llama", 4, "headtail", axes=("dp", "cp"), tokens_layout="S(0)S(1)", param_layouts={"*": "RR"})
    assert len(flattened_in_place(plan)) >= 14, flattened_in_place(plan)
    results = run_local(4, _worker, "llama", plan, timeout=900)
    _check_parity("llama", plan, results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,world,variant", [("llama", 2, "headtail"), ("llama", 4, "ring_headtail"), ("gpt2", 2, "headtail"),
                                                ("llama", 2, "ulysses_headtail"), ("llama", 4, "torch_ring")])
def test_hf_parity(name, world, variant):
    """Hugging Face's own positions, RoPE tables, causal mask and labels-shifting loss, all inside the model: each is
    made whole and chunked into token order where the plan splits it."""
    model, args, kwargs = hf_model(name)
    with warnings.catch_warnings(), _only(kernel_name(variant, True)):
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, devices=world, mesh_shape=(world,), axis_names=("cp",), example_inputs=args,
                             example_kwargs=kwargs, input_layouts={"input_ids": "S(1)", "labels": "S(1)"}, token_order=True)
    assert _kernels(plan) == {kernel_name(variant, True)}
    results = run_local(world, _hf_worker, plan, name, timeout=900)
    model, args, kwargs = hf_model(name)
    ref_losses, ref_grads = _hf_train(model, args, kwargs)
    _compare(plan, dict(model.named_parameters()), ref_losses, ref_grads, results)
