"""Tracing a stack of identical layers once and copying it (ir/repeat.py) gives the IR a full export gives."""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch
import transformers as tf
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from _parity import build, check_parity, plan_kwargs, rank_worker

import meshplan
from meshplan.ir.graph import Graph, TensorRef
from meshplan.ir.precision import resolve_precision
from meshplan.ir.repeat import Stack, repeated_stacks
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig, Llama, LlamaConfig
from meshplan.runtime.launch import run_local


def _renamed(graph: Graph) -> list:
    """The graph's nodes with every name replaced by the node's position: the IR up to fx's naming."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}

    def ref(r: TensorRef) -> TensorRef:
        return TensorRef(str(index[r.node]), r.index)

    nodes = [dataclasses.replace(n, name=str(index[n.name]), inputs=tuple(map(ref, n.inputs))) for n in graph.nodes]
    # the IR keeps no scalar arguments of ATen ops; the program does
    scalars = [(str(n.target), [repr(a) for a in pytree.tree_leaves((n.args, n.kwargs)) if not isinstance(a, fx.Node)])
               for n in graph.fx.gm.graph.nodes if n.op == "call_function"]
    return [nodes, scalars]


def _hf_llama(layers: int):
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    return tf.LlamaForCausalLM(cfg), (torch.zeros(2, 8, dtype=torch.long),)


def _hf_gpt2(layers: int, **kw):
    cfg = tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=4, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    return tf.GPT2LMHeadModel(cfg), (torch.zeros(2, 8, dtype=torch.long),)


def _hf_mixtral(layers: int):
    """Each MoE block traces as one meshplan region op (meshplan/regions/moe.py)."""
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                           router_jitter_noise=0.0, use_cache=False, attn_implementation="sdpa")
    return tf.MixtralForCausalLM(cfg), (torch.zeros(2, 8, dtype=torch.long),)


MODELS = {
    "gpt": lambda: (GPT(GPTConfig(layers=5)), (torch.zeros(2, 16, dtype=torch.long),)),
    "llama": lambda: (Llama(LlamaConfig(layers=6)), (torch.zeros(2, 16, dtype=torch.long),)),
    "llama_dict": lambda: (Llama(LlamaConfig(layers=6, module_dict=True)), (torch.zeros(2, 16, dtype=torch.long),)),
    "hf_mixtral": lambda: _hf_mixtral(4),
    "hf_llama": lambda: _hf_llama(5),
    "hf_gpt2": lambda: _hf_gpt2(4),
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_copied_layers_give_the_ir_of_a_full_trace(name: str, precision: str) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    stacks = repeated_stacks(model)
    assert len(stacks) == 1 and stacks[0].length >= 4, stacks
    policy = resolve_precision(precision, auto="fp32")
    full = trace(model, inputs, precision=policy, copy_repeated=False)
    copied = trace(model, inputs, precision=policy)
    assert len(copied.nodes) == len(full.nodes)
    assert len([n for n in copied.fx.gm.graph.nodes if n.op == "call_function"]) > 0
    assert _renamed(copied) == _renamed(full)
    assert [n.name for n in copied.nodes if n.kind in ("param", "buffer", "input")] == [n.name for n in full.nodes if n.kind in ("param", "buffer", "input")]
    # the copied program runs and computes what the model computes
    if precision == "fp32":
        params = {n.name: dict(model.named_parameters(remove_duplicate=False)).get(n.target) for n in copied.nodes if n.kind == "param"}
        assert all(p is not None for p in params.values())
        torch.manual_seed(1)
        tokens = torch.randint(0, 32, inputs[0].shape)
        want = model(tokens)
        want = want.logits if hasattr(want, "logits") else want
        got = _run(copied, model, tokens)
        torch.testing.assert_close(got, want)


def _run(graph: Graph, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The traced program on the model's own tensors."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    args = []
    for n in graph.fx.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        node = graph[n.name] if n.name in graph else None
        if node is None or node.kind == "input":
            args.append(tokens)
        elif node.kind == "constant":
            args.append(graph.fx.constants[n.name])
        else:
            args.append(tensors[node.target])
    out = graph.fx.gm(*args)
    return out[0] if isinstance(out, (list, tuple)) else out


class _IndexScaled(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (self.layer_idx + 1)  # the index in arithmetic, not in an attribute of its own


class _IndexScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_IndexScaled(i) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_whose_traces_differ_are_traced_whole() -> None:
    """An index attribute passes the structural check; blocks 1 and 2 then trace to different constants,
    so nothing is copied and the IR is the full trace's."""
    model, x = _IndexScaledStack(), torch.randn(2, 8)
    assert [s.path for s in repeated_stacks(model)] == ["layers"]
    copied = trace(model, (x,))
    assert _renamed(copied) == _renamed(trace(model, (x,), copy_repeated=False))
    torch.testing.assert_close(_run(copied, model, x), model(x))


def test_gpt2_scaled_by_inverse_layer_index_is_no_stack() -> None:
    """GPT-2 stores the per-layer scale as an attribute, so the structural check already tells its blocks apart."""
    model, _ = _hf_gpt2(4, scale_attn_by_inverse_layer_idx=True)
    assert repeated_stacks(model) == []


def test_stacks_with_different_blocks_or_shared_weights_are_not_copied() -> None:
    mixed = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)] + [nn.Linear(4, 8)])
    shared_block = nn.Linear(4, 4)
    shared = nn.ModuleList([shared_block] * 5)
    sliding = nn.ModuleList([nn.Linear(4, 4) for _ in range(5)])
    for i, m in enumerate(sliding):
        m.window = 16 if i % 2 else None  # Gemma-2-like alternating attention: an attribute, not an index
    indexed = nn.ModuleList([nn.Linear(4, 4) for _ in range(5)])
    for i, m in enumerate(indexed):
        m.layer_idx = i
    holder = nn.Module()
    holder.mixed, holder.shared, holder.sliding, holder.indexed = mixed, shared, sliding, indexed
    assert [s.path for s in repeated_stacks(holder)] == ["indexed"]


def test_a_module_dict_stack_traces_once_like_a_module_list(monkeypatch) -> None:
    """torchtitan keeps its blocks in an `nn.ModuleDict` keyed "0", "1", ...: the stack is found, exported
    with three blocks and copied, like the `nn.ModuleList` form; the IR, its layers and the plan are that form's."""
    exported: list[int] = []

    def counting(model, args, kwargs):
        exported.append(len(model.layers))
        return real(model, args, kwargs)

    trace_module = importlib.import_module("meshplan.ir.trace")  # `meshplan.ir.trace` the attribute is the function
    real = trace_module._export
    monkeypatch.setattr(trace_module, "_export", counting)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    graphs, plans = {}, {}
    for container in (nn.ModuleList, nn.ModuleDict):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(layers=4, module_dict=container is nn.ModuleDict))
        assert type(model.layers) is container
        assert repeated_stacks(model) == [Stack("layers", ("0", "1", "2", "3"))]
        graphs[container] = trace(model, (tokens,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[container] = meshplan.plan(model, 4, (tokens,), mesh_shape=(2, 2))
    assert exported == [3] * 4, "every trace exports the stack cut to three blocks, once"
    as_list, as_dict = graphs[nn.ModuleList], graphs[nn.ModuleDict]
    assert _renamed(as_dict) == _renamed(as_list)
    assert as_dict.layer_groups() == as_list.layer_groups() == {"layers.*": [f"layers.{k}" for k in range(4)]}
    assert plans[nn.ModuleDict].hash() == plans[nn.ModuleList].hash()  # same strategy for every node, same predicted step


class _KeyedStack(nn.Module):
    """Five identical blocks in an `nn.ModuleDict` under keys of its own, not in key order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"b{k}": _IndexScaled(0) for k in "zvxwy"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_a_module_dict_stack_with_other_keys_copies_under_its_own_names() -> None:
    """The keys are the blocks' names, in the dict's order: the copies take the later blocks' parameters."""
    model, x = _KeyedStack(), torch.randn(2, 8)
    assert repeated_stacks(model) == [Stack("layers", ("bz", "bv", "bx", "bw", "by"))]
    copied = trace(model, (x,))
    assert [n.target for n in copied.nodes if n.kind == "param"] == [f"layers.b{k}.fc.{w}" for k in "zvxwy" for w in ("weight", "bias")]
    assert _renamed(copied) == _renamed(trace(model, (x,), copy_repeated=False))
    torch.testing.assert_close(_run(copied, model, x), model(x))


@pytest.mark.multiprocess
def test_parity_of_a_module_dict_llama() -> None:
    """The runtime on a plan of the ModuleDict form (copied trace, Megatron layouts on `layers.k`): 2 gloo ranks
    train as one process does, and run the plan's collectives."""
    model, x, _ = build("llama_dict")
    assert type(model.layers) is nn.ModuleDict and repeated_stacks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan = meshplan.plan(model, devices=2, example_inputs=(x,), **plan_kwargs("llama_dict", "megatron", (2,)))
    results = run_local(2, rank_worker, "llama_dict", plan, timeout=600)
    check_parity("llama_dict", plan, results)
