"""Models that update their own state in forward (issue 28, item 3): parameters rescaled in place, buffers and
module attributes. The traced program returns each updated parameter's new value with the gradient still going to
the parameter (ir/mutations.py); the runtime writes each rank's part back in the parameter's layout
(runtime/write_back.py), and where a forward moves on module attributes that pick later forwards' branches (Hugging
Face RWKV's `layers_are_rescaled`) runs programs traced from the attributes it left (runtime/model_state.py).
Parity with one process on 2 gloo ranks: a model rescaling its weights on every call (train and eval, under
data-parallel, tensor-parallel and FSDP-style plans); Hugging Face RWKV's eval mode, whose first call halves its
deeper blocks' output weights and whose next leaves them; and a model that does what RWKV does, and doubles its
weight back on its next training call, through training and evaluation in turn."""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.ir.placement import Replicate, Shard
from meshplan.ir.trace import TraceError, trace
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

STEPS = 3


class Rescaling(nn.Module):
    """Normalises fc1's rows in place before using them and nudges fc2's bias after using it, on every call."""

    def __init__(self, style: str = "normalise") -> None:
        super().__init__()
        self.fc1, self.fc2, self.style = nn.Linear(16, 32), nn.Linear(32, 8), style

    def forward(self, x):
        w = self.fc1.weight
        with torch.no_grad():
            if self.style == "normalise":
                w.div_(w.norm(dim=1, keepdim=True))
            elif self.style == "row":  # through a view
                w[0].zero_()
            elif self.style == "copy":
                w.copy_(w * 0.5)
            elif self.style == "twice":  # read between two updates
                w.mul_(0.5)
        if self.style == "twice":
            x = x + w.sum()
            with torch.no_grad():
                w.add_(0.1)
        y = self.fc2(torch.relu(self.fc1(x)))
        with torch.no_grad():
            self.fc2.bias.add_(0.01)  # after its use: that use reads the old value
        return y


def _rescaling(cls: type[nn.Module] = Rescaling):
    torch.manual_seed(0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    return cls(), x, y


def _rwkv():
    """Hugging Face RWKV, tiny; `rescale_every=1` so its eval forward halves block 1's output weights."""
    from transformers import RwkvConfig, RwkvForCausalLM

    cfg = RwkvConfig(vocab_size=128, hidden_size=64, attention_hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, context_length=16, rescale_every=1, use_cache=False)
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return RwkvForCausalLM(cfg), (tokens,), {"labels": tokens.clone()}


RWKV_LAYOUTS = {"*.attention.output.weight": "S(0)", "*.feed_forward.value.weight": "S(1)"}
"""The weights RWKV's eval forward rescales, stored split (the write-back takes each rank's block)."""


# ---------------------------------------------------------------- the trace (one process)


@pytest.mark.parametrize("style", ["normalise", "row", "copy", "twice"])
def test_updated_parameters_come_out_of_the_program_with_their_own_gradients(style):
    """The program returns each updated parameter's new value, detached, and computes the eager model's output
    and gradients: later reads of an updated weight differentiate into the weight, not through the update."""
    torch.manual_seed(0)
    model, x = Rescaling(style), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    expected_out = eager(x)
    expected_out.square().sum().backward()
    graph = trace(copy.deepcopy(model), (x,))
    program = graph.fx
    assert program.mutations == ("fc1.weight", "fc2.bias")
    params = dict(model.named_parameters())
    call = [params[graph[n.name].fqns[0]] if graph[n.name].kind == "param" else x
            for n in program.gm.graph.nodes if n.op == "placeholder"]
    *new, out = program.gm(*call)
    out.square().sum().backward()
    expected = dict(eager.named_parameters())
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for fqn, value in zip(program.mutations, new):
        assert not value.requires_grad, fqn
        torch.testing.assert_close(value, expected[fqn].detach(), rtol=0, atol=0)
    for fqn, p in params.items():
        torch.testing.assert_close(p.grad, expected[fqn].grad, msg=lambda m: f"{style}, gradient of {fqn}: {m}")


def test_writing_into_an_input_is_a_trace_error():
    class Scales(nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x.sum()

    with pytest.raises(TraceError, match=r"writes in place into its input x \(aten\.mul\.Tensor at <top>\)"):
        trace(Scales(), (torch.randn(4),))


class Flagged(nn.Module):
    """As Hugging Face RWKV: its first eval-mode call halves its weight and records that in a flag, and its first
    training call after that doubles the weight back; it also counts its calls in an attribute nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.rescaled, self.calls = nn.Linear(16, 8), False, 0

    def forward(self, x):
        self.calls += 1
        if self.rescaled == self.training:
            with torch.no_grad():
                self.fc.weight.mul_(2) if self.training else self.fc.weight.div_(2)
            self.rescaled = not self.training
        return self.fc(x) * (2 if self.rescaled else 1)


def test_attributes_that_pick_the_branch_are_state_changes():
    """A flag the forward sets, from which the program traces differently, is recorded with the value it is left at;
    a counter nothing reads is not. Tracing leaves both as they were."""
    model = Flagged().eval()
    program = trace(model, (torch.randn(2, 16),)).fx
    assert program.state_changes == {"rescaled": True}
    assert program.attributes["rescaled"] is False and program.attributes["calls"] == 0
    assert (model.rescaled, model.calls) == (False, 0)
    assert trace(model.train(), (torch.randn(2, 16),)).fx.state_changes == {}


def _plan(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(model, devices=2, example_inputs=(x,), **kw)


def test_updates_a_plan_cannot_honour_are_errors_naming_the_parameter_and_op():
    from meshplan.runtime.write_back import updates

    model, x, _ = _rescaling()
    graph = trace(model, (x,))
    plan = _plan(model, x, param_layouts={"fc1.weight": "S(0)"})
    assert [(u.fqn, u.whole) for u in updates(graph, plan, plan.params)] == [("fc1.weight", True), ("fc2.bias", False)]
    # the new value arriving split along the other dim: taking this rank's rows would need a collective
    other = [dataclasses.replace(t, dst=(Shard(1),)) if (t.consumer, t.position) == ("output", 0) else t for t in plan.transfers]
    with pytest.raises(ValueError, match=r"parameter fc1\.weight in place \(aten\.div\.Tensor at <top>\); the plan returns "
                                         r"its new value as \(Shard\(dim=1\),\), but it is stored as \(Shard\(dim=0\),\)"):
        updates(graph, dataclasses.replace(plan, transfers=tuple(other)), plan.params)
    with pytest.raises(ValueError, match=r"parameter fc1\.weight in place .* recomputes layers in backward \(fc1\)"):
        updates(graph, dataclasses.replace(plan, recompute=("fc1",)), plan.params)


def test_a_program_traced_before_an_earlier_forward_moved_its_attributes_is_refused():
    """Without a source to trace it again (a ParallelModule built without eval_source), a program whose attributes an
    earlier forward moved on is a ValueError naming the attribute (runtime/model_state.py)."""
    from meshplan.runtime.model_state import ModelState

    model = Flagged()
    train, evaluated = trace(model, (torch.randn(2, 16),)).fx, trace(model.eval(), (torch.randn(2, 16),)).fx
    state = ModelState(train.attributes)
    state.check(evaluated, "eval")
    state.after(evaluated)
    assert state.moved == {"rescaled": True}
    with pytest.raises(ValueError, match="set the model's attribute rescaled to True, and it was False when the "
                                         "train-mode program was traced"):
        state.check(train, "train")
    assert state.program(True, lambda training, attributes: (training, attributes)) == (True, {"rescaled": True})


def test_pipelined_plans_refuse_forwards_that_update_state():
    """A pipeline's stages hand on only the model's outputs, and each microbatch runs the program traced before the
    first: ParallelModule refuses both kinds of update for a pipelined plan (runtime/write_back.py)."""
    from meshplan.runtime.write_back import refuse_in_pipeline

    model, x, _ = _rescaling()
    with pytest.raises(ValueError, match=r"updates tensor fc1\.weight in place \(aten\.div\.Tensor at <top>\); pipelined"):
        refuse_in_pipeline(trace(model, (x,)))
    flagged = trace(Flagged().eval(), (torch.randn(2, 16),))
    with pytest.raises(ValueError, match="updates tensor fc.weight"):
        refuse_in_pipeline(flagged)
    flagged.fx.mutations = ()
    with pytest.raises(ValueError, match="sets the model's attribute rescaled to True"):
        refuse_in_pipeline(flagged)
    refuse_in_pipeline(trace(Flagged(), (torch.randn(2, 16),)))  # train mode: nothing to refuse


# ---------------------------------------------------------------- parity on 2 gloo ranks


def _train_and_evaluate(model, x, y) -> tuple[list[float], list[torch.Tensor], dict[str, torch.Tensor]]:
    """SGD steps (each forward rescales), then two eval-mode calls: losses, eval outputs, parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        outs = [model(x) for _ in range(2)]
    return losses, outs, {k: local_of(v.detach()) for k, v in model.named_parameters()}


def _rwkv_eval(model, args, kwargs):
    """Two eval-mode calls (the first halves block 1's output weights, the second leaves them): each call's loss and
    logits, then the parameters."""
    model.eval()
    with torch.no_grad():
        calls = [model(*args, **kwargs) for _ in range(2)]
    return [(c.loss, c.logits) for c in calls], {k: local_of(v.detach()) for k, v in model.named_parameters()}


def _cycle(model, x, y) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Training and evaluation in turn (train, eval, eval, train, train, eval): each call's output (a training step's
    loss), then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs = []
    for training in (True, False, False, True, True, False):
        model.train(training)
        if training:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            outs.append(loss.detach())
        else:
            with torch.no_grad():
                outs.append(model(x))
    return outs, {k: local_of(v.detach()) for k, v in model.named_parameters()}


def _worker(rank: int, world: int, jobs: list):
    results = []
    for name, plan in jobs:
        if name == "rwkv":
            model, args, kwargs = _rwkv()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=args, example_kwargs=kwargs, plan=plan)
            results.append(_rwkv_eval(pmodel, args, kwargs))
        elif name == "flagged":
            model, x, y = _rescaling(Flagged)
            results.append(_cycle(meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan), x, y))
        else:
            model, x, y = _rescaling()
            results.append(_train_and_evaluate(meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan), x, y))
    return results


@functools.lru_cache(maxsize=1)
def _jobs() -> list:
    model, x, _ = _rescaling()
    jobs = [("rescaling", _plan(model, x, mode="data_parallel")),
            ("rescaling", _plan(model, x, param_layouts={"fc1.weight": "S(0)", "fc2.weight": "S(1)", "fc2.bias": "R"})),
            ("rescaling", _plan(model, x, param_layouts={"*": "S(0)"}))]
    flagged, x, _ = _rescaling(Flagged)
    jobs.append(("flagged", _plan(flagged, x, param_layouts={"fc.weight": "S(0)"})))
    model, args, kwargs = _rwkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jobs.append(("rwkv", meshplan.plan(model, devices=2, example_inputs=args, example_kwargs=kwargs,
                                           param_layouts=RWKV_LAYOUTS)))
    return jobs


def _check_params(params: dict, expected: dict, plan, rank: int, where: str) -> None:
    layouts = {f: p.layout for p in plan.params for f in p.fqns}
    assert set(params) == set(expected), where
    for fqn, local in params.items():
        want = shard_tensor(expected[fqn].detach(), layouts[fqn], plan.mesh, rank)
        torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, {fqn}: {m}")


@pytest.mark.multiprocess
def test_models_updating_their_parameters_run_with_parity_on_two_ranks():
    jobs = _jobs()
    assert [p.layout for p in jobs[1][1].params if p.fqns == ("fc1.weight",)] == [(Shard(0),)]
    assert all(p.layout == (Shard(0),) for p in jobs[3][1].params if p.fqns[0].endswith(".output.weight"))
    assert any(p.layout != (Replicate(),) for p in jobs[2][1].params)
    results = run_local(2, _worker, jobs, timeout=900)

    model, x, y = _rescaling()
    losses, outs, params = _train_and_evaluate(model, x, y)
    rwkv_calls, rwkv_params = _rwkv_eval(*_rwkv())
    assert not torch.equal(rwkv_params["rwkv.blocks.1.attention.output.weight"], _rwkv()[0].rwkv.blocks[1].attention.output.weight)
    flagged_outs, flagged_params = _cycle(*_rescaling(Flagged))
    for rank, ranks in enumerate(results):
        for (name, plan), result in zip(jobs, ranks):
            where = f"{name} on rank {rank}, plan {[str(p.layout) for p in plan.params][:4]}"
            if name == "rwkv":
                calls, got = result
                for i, ((loss, logits), (want_loss, want_logits)) in enumerate(zip(calls, rwkv_calls)):
                    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, call {i} loss: {m}")
                    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}, call {i}: {m}")
                _check_params(got, rwkv_params, plan, rank, where)
            elif name == "flagged":
                cycle, got = result
                for i, (a, b) in enumerate(zip(cycle, flagged_outs)):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, call {i}: {m}")
                _check_params(got, flagged_params, plan, rank, where)
            else:
                got_losses, got_outs, got = result
                torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
                for a, b in zip(got_outs, outs):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, eval output: {m}")
                _check_params(got, params, plan, rank, where)
