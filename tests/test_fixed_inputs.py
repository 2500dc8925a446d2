"""Non-tensor inputs (issue 31, item 1): flags such as Hugging Face's `use_cache=False` / `return_dict=True`,
sizes, strings and None, positional or keyword, are constants of the trace. The runtime takes them as the
model does (`pmodel(ids, use_cache=False, return_dict=True)`, `runner.step(x, flag, target=y, scale=0.5)`)
and refuses a value other than the traced one, which the program would silently ignore. A dict given as
`example_inputs` says to pass keyword inputs with `example_kwargs=`."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from _hf_parity import hf_check_parity, hf_model_called, hf_plan, hf_rank_worker

import meshplan
from meshplan.ir.trace import FixedInput, trace
from meshplan.models.hf import hf_llama
from meshplan.models.mlp import MLP
from meshplan.plans.plan import Plan
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

HF_FLAGS = {"use_cache": False, "return_dict": True}
KW = {"scale": 0.5, "mode": "tanh", "mask": None, "return_dict": True}
"""The flagged MLP's keyword inputs as planned (its positional flag `double` is True)."""
PIPE_KW = {**KW, "return_dict": False}
"""As planned for a pipeline: torch's pipeline stages cannot return a dict (`'dict' object has no attribute '_is_view'`)."""


class FlaggedMLP(MLP):
    """An MLP whose call takes a flag, a float, a string, None and an output switch besides its tensor."""

    def forward(self, x, double=False, *, scale=1.0, mode="none", mask=None, return_dict=False):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x, approximate=mode)
        x = x * scale
        if double:
            x = x * 2
        if mask is not None:
            x = x * mask
        return {"out": x} if return_dict else x


def _flagged():
    torch.manual_seed(0)
    return FlaggedMLP(8, 8, 8, depth=4), torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def _loss(out, _target):
    return (out["out"] if isinstance(out, dict) else out).square().mean()


def _bad_calls(x, kw: dict = KW) -> list[tuple[tuple, dict, str]]:
    """(args, kwargs, the error they must raise) of calls the program traced with `(x, True), kw` cannot honour."""
    return [
        ((x, False), kw, r"args\[1\]=False, but the model was traced \(and planned\) with args\[1\]=True"),
        ((x, True), {**kw, "mode": "none"}, r"mode='none', but the model was traced \(and planned\) with mode='tanh'.*pass mode='tanh'"),
        ((x, True), {**kw, "mask": x}, r"mask=a tensor of shape \[16, 8\], but the model was traced \(and planned\) with mask=None"),
        ((x, True), {k: v for k, v in kw.items() if k != "mask"},
         "the model was traced with 2 positional inputs and keywords scale, mode, mask, return_dict and is called with "
         "2 positional inputs and keywords scale, mode, return_dict"),
        ((True, True), kw, r"args\[0\] was traced as a tensor; got True"),
    ]


def test_non_tensor_inputs_are_constants_of_the_trace():
    model, x = _flagged()
    graph = trace(model, (x, True), KW)
    assert graph.input_names == ("x",) and [n.name for n in graph.nodes if n.kind == "input"] == ["x"]
    assert graph.fx.fixed == (FixedInput("args[1]", 1, True), FixedInput("scale", 2, 0.5), FixedInput("mode", 3, "tanh"),
                              FixedInput("mask", 4, None), FixedInput("return_dict", 5, True))
    assert [n.name for n in graph.fx.gm.graph.nodes if n.op == "placeholder"][-1] == "x"  # no placeholder for a constant
    reordered = dict(reversed(KW.items()))  # keywords in any order
    (got,) = graph.fx.user_inputs((x, True), reordered)
    assert got is x
    for args, kwargs, message in _bad_calls(x):
        with pytest.raises(ValueError, match=message):
            graph.fx.user_inputs(args, kwargs)


class TwoKeywords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, *, a, b):
        return self.fc(x) * a - b


def test_keyword_tensors_reach_the_program_in_traced_order_whatever_the_calls_order():
    """The runtime used to take the call's tensors in the order the call named them: `b=, a=` swapped a and b."""
    x, a, b = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    graph = trace(TwoKeywords(), (x,), {"a": a, "b": b})
    assert graph.input_names == ("x", "a", "b")
    got = graph.fx.user_inputs((x,), {"b": b, "a": a})
    assert [t is want for t, want in zip(got, (x, a, b))] == [True] * 3


def test_hf_llama_plans_with_use_cache_and_return_dict_and_the_plan_file_round_trips():
    """Was `AttributeError: 'bool' object has no attribute 'shape'` from the trace."""
    plan = hf_plan("llama", (2,), flags=HF_FLAGS)
    assert [i.name for i in plan.inputs] == ["input_ids", "labels"]  # the plan records tensor inputs only
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.hash() == plan.hash()
    model, args, kwargs = hf_model_called("llama", HF_FLAGS)
    assert trace(model, args, kwargs).fingerprint() == plan.graph_fingerprint


def test_a_dict_as_example_inputs_says_to_pass_keywords_as_example_kwargs():
    """Was `embedding(): argument 'indices' (position 2) must be Tensor, not dict`."""
    model, (ids,), _ = hf_llama()
    with pytest.raises(ValueError, match=r"example_inputs must be a tuple of positional inputs; got a dict with keys "
                                         r"'input_ids', 'use_cache': pass keyword inputs as example_kwargs="):
        meshplan.plan(model, devices=2, example_inputs={"input_ids": ids, "use_cache": False})
    with pytest.raises(ValueError, match=r"example_kwargs must be a dict of keyword inputs \(or None\); got tuple"):
        meshplan.plan(model, devices=2, example_inputs=(ids,), example_kwargs=(False,))


def _flagged_worker(rank: int, world: int, flat: Plan, piped: Plan):
    """A flat and a pipelined plan of the flagged MLP, each refusing calls with other constants (on every rank,
    before any collective) and computing one step with the traced ones."""
    warnings.simplefilter("ignore")
    errors = []
    model, x = _flagged()
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x, True), example_kwargs=KW, plan=flat)
    for args, kwargs, _ in _bad_calls(x):
        with pytest.raises(ValueError) as info:
            pmodel(*args, **kwargs)
        errors.append(str(info.value))
    _loss(pmodel(x, True, **dict(reversed(KW.items()))), None).backward()
    flat_grads = {n: local_of(p.grad).clone() for n, p in pmodel.named_parameters()}

    model, x = _flagged()
    runner = meshplan.auto_parallelize(model, devices=world, example_inputs=(x, True), example_kwargs=PIPE_KW, plan=piped,
                                       loss_fn=_loss)
    for args, kwargs, _ in _bad_calls(x, PIPE_KW):
        with pytest.raises(ValueError) as info:
            runner.step(*args, target=x, **kwargs)
        errors.append(str(info.value))
    loss = runner.step(x, True, target=x, **dict(reversed(PIPE_KW.items())))
    piped_grads = {n: local_of(p.grad).clone() for n, p in runner.named_parameters()}
    return errors, flat_grads, None if loss is None else float(loss), piped_grads


@pytest.mark.multiprocess
def test_flat_and_pipelined_runtimes_take_the_constants_as_traced():
    model, x = _flagged()
    flat = meshplan.plan(model, 2, (x, True), example_kwargs=KW, mode="data_parallel")
    assert [str(i.layout) for i in flat.inputs] == ["(Shard(dim=0),)"]  # each rank takes half of x
    piped = meshplan.plan(model, 2, (x, True), example_kwargs=PIPE_KW,
                          pipeline=meshplan.PipelineOptions(degrees=(2,), schedules=("1f1b",), microbatch_sizes=(8,)))
    assert piped.pipeline is not None and piped.pipeline.microbatches == 2
    results = run_local(2, _flagged_worker, flat, piped, timeout=600)

    ref = _loss(model(x, True, **KW), None)
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    layouts = {p.fqns[0]: p.layout for p in flat.params}
    losses = [loss for _, _, loss, _ in results if loss is not None]
    assert losses and all(abs(loss - ref.item()) < 1e-6 for loss in losses)
    seen = set()
    for rank, (errors, flat_grads, _, piped_grads) in enumerate(results):
        for got, (_, _, message) in zip(errors, _bad_calls(x) * 2):
            assert re.search(message, got), (rank, got)
        assert len(errors) == 2 * len(_bad_calls(x))
        assert set(flat_grads) == set(ref_grads)
        for name, g in flat_grads.items():
            torch.testing.assert_close(g, shard_tensor(ref_grads[name], layouts[name], flat.mesh, rank), rtol=1e-5, atol=1e-7)
        for name, g in piped_grads.items():  # a data-parallel stage per pipeline rank: whole gradients
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)
            seen.add(name)
    assert seen == set(ref_grads)


@pytest.mark.multiprocess
def test_hf_llama_called_with_use_cache_and_return_dict_trains_with_parity_on_two_ranks():
    """Loss and parameters after two SGD steps against one process, for the plan the search returns and a data-parallel
    one (the batch split); the ranks run the plans read back from JSON."""
    plans = [Plan.from_json(hf_plan("llama", (2,), flags=HF_FLAGS, **kw).to_json()) for kw in ({}, {"mode": "data_parallel"})]
    results = run_local(2, hf_rank_worker, [("llama", plan) for plan in plans], HF_FLAGS, timeout=900)
    for i, plan in enumerate(plans):
        hf_check_parity("llama", plan, [r[i] for r in results], flags=HF_FLAGS)
