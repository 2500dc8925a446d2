"""ir/rebatch.py: a trace at another batch size derived from two traces equals a fresh trace, or is refused."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from meshplan.ir.rebatch import rebatched
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig

_spec = importlib.util.spec_from_file_location("rebatch_zoo", Path(__file__).resolve().parents[1] / "benchmarks" / "rebatch_zoo.py")
rebatch_zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rebatch_zoo)


def _assert_same(derived, fresh) -> None:
    """Names, ops, inputs, tensor metas and attrs; the generated code (every argument); every `val`'s shape and strides."""
    assert rebatch_zoo.verdict(derived, fresh) == "EQUAL"


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=2))


@pytest.mark.parametrize("n", [3, 4, 8])
def test_gpt_at_another_batch_is_its_fresh_trace(n):
    model = _gpt()

    def at(b):
        return trace(model, (torch.zeros(b, 16, dtype=torch.long),))

    _assert_same(rebatched(at(1), 1, at(2), 2, n), at(n))


def test_hf_llama_at_another_batch_is_its_fresh_trace():
    """Grouped-query attention (the KV heads expanded), RoPE, the loss inside, on the meta device. Export leaves the
    shifted labels' copy out of a batch of 1 (a slice of a [1, s] tensor is contiguous); derived from sizes 1 and 2,
    in either order, the trace at 4 holds it as the fresh one does (refused before 2026-11-28: another program)."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)

    def at(b):
        tokens = torch.zeros(b, 32, dtype=torch.long, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return trace(model, (tokens,), {"labels": tokens})

    one, two, four = at(1), at(2), at(4)
    _assert_same(rebatched(two, 2, four, 4, 8), at(8))
    assert len(one.nodes) == len(two.nodes) - 1 and sum(n.target == "aten.clone.default" for n in two.nodes) == 1 + sum(
        n.target == "aten.clone.default" for n in one.nodes)
    _assert_same(rebatched(one, 1, two, 2, 4), four)
    _assert_same(rebatched(two, 2, one, 1, 4), four)


def test_a_trace_derived_from_a_derived_trace_is_its_fresh_trace():
    """The pipeline search holds derived traces beside exported ones (8 from 2 and 4, then 16 from 4 and 8): a derived
    trace's `val` metas are meta tensors where an exported one's are fake tensors, and the two still pair up."""
    model = _gpt()

    def at(b):
        return trace(model, (torch.zeros(b, 16, dtype=torch.long),))

    four = at(4)
    eight = rebatched(at(2), 2, four, 4, 8)
    _assert_same(rebatched(eight, 8, four, 4, 16), at(16))


class _PerSample(torch.nn.Module):
    """Scales by a float computed from the batch: the program depends on it out of proportion."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.lin(x) * (1.0 / x.shape[0])).sum()


def test_a_program_that_depends_on_the_batch_otherwise_is_refused():
    model = _PerSample()
    two, four = (trace(model, (torch.zeros(b, 4),)) for b in (2, 4))
    assert rebatched(two, 2, four, 4, 8) is None


def test_a_size_the_proportion_does_not_reach_is_refused():
    """A view to [n * 16, ...] from batches 2 and 4 scales to any n; a dim that is n / 2 does not reach n = 3."""

    class Halves(torch.nn.Module):
        def forward(self, x):
            return x.reshape(2, x.shape[0] // 2, 4).sum(0)

    two, four = (trace(Halves(), (torch.zeros(b, 4),)) for b in (2, 4))
    assert rebatched(two, 2, four, 4, 3) is None
    _assert_same(rebatched(two, 2, four, 4, 8), trace(Halves(), (torch.zeros(8, 4),)))


def _hf_llama():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_the_pipeline_search_derives_traces_and_returns_the_same_plan(monkeypatch, name):
    """plan_pipeline exports the model at fewer microbatch sizes and returns the plan it returned tracing each. The
    Hugging Face Llama (its loss inside, labels shifted) derives its sizes from 1 and 2."""
    import importlib

    import meshplan.ir.rebatch as rebatch_module
    from meshplan.cost_model.presets import get_cluster
    from meshplan.planner.pipeline import PipelineOptions, plan_pipeline

    model = _gpt() if name == "gpt" else _hf_llama()
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    kwargs = {} if name == "gpt" else {"labels": x}
    exported = []
    trace_module = importlib.import_module("meshplan.ir.trace")  # `meshplan.ir.trace` the attribute is the function
    real_trace = trace_module.trace

    def counting(*args, **kwargs):
        exported.append(int(args[1][0].shape[0]))
        return real_trace(*args, **kwargs)

    monkeypatch.setattr(trace_module, "trace", counting)
    opts = PipelineOptions(degrees=(2,), microbatch_sizes=(1, 2, 4))

    def search():
        exported.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = plan_pipeline(model, 4, (x,), cluster=get_cluster("h100"), options=opts, example_kwargs=kwargs)
        return result, list(exported)

    derived, few = search()
    monkeypatch.setattr(rebatch_module, "rebatched", lambda *a: None)
    fresh, every = search()
    assert len(few) < len(every) and (name == "gpt" or few[:2] == [1, 2] and 4 not in few), (few, every)
    assert derived.plan.to_json() == fresh.plan.to_json()


def test_zoo_models_derive_equal_or_refuse():
    """benchmarks/rebatch_zoo.py on ResNet (batch norm's running statistics updated in forward) and Mixtral (the MoE
    region op's static arguments): every derived trace is the fresh one or refused, and from 2 and 4 samples to 8 each
    is derived."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/rebatch_zoo.py", "--only", "resnet_small", "mixtral"], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| resnet_small") or line.startswith("| mixtral")]
    assert len(rows) == 2
    for cells in rows:
        assert "WRONG" not in " ".join(cells)
        assert cells[3] == "EQUAL"  # 2, 4 -> 8


def test_tensor_metas_of_another_dtype_or_rank_are_refused_not_raised():
    """Two traces whose node outputs differ in dtype or rank are another program: refused (None), never an error or
    the first trace's dtype kept."""
    from dataclasses import replace

    from meshplan.ir.graph import Graph, TensorMeta

    model = _gpt()
    two, four = (trace(model, (torch.zeros(b, 16, dtype=torch.long),)) for b in (2, 4))
    k = next(i for i, n in enumerate(four.nodes) if n.kind == "op" and n.outputs and n.outputs[0] is not None)
    meta = four.nodes[k].outputs[0]
    for changed in (TensorMeta(meta.shape, "float16" if meta.dtype != "float16" else "float32"), TensorMeta(meta.shape + (1,), meta.dtype)):
        nodes = list(four.nodes)
        nodes[k] = replace(nodes[k], outputs=(changed, *nodes[k].outputs[1:]))
        other = Graph(nodes, fx=four.fx, input_names=four.input_names, precision=four.precision)
        assert rebatched(two, 2, other, 4, 8) is None
