"""Invariant 4, continued (issue 8): models that cannot be traced, plan files for another world,
checkpoints of another model, bad timeouts. Each error is a ValueError naming what was given
and what is allowed. docs/reliability.md lists these messages (tests/test_reliability_doc.py)."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
from _parity import build

import meshplan
from meshplan.ir.trace import TraceError
from meshplan.runtime.collectives import resolve_timeout
from meshplan.runtime.launch import run_local


class DataDependent(torch.nn.Module):
    """Python control flow on a tensor's value: torch.export cannot trace it without example data."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        # the next line is the one the error must point at
        if y.sum() > 0:
            return y * 2
        return y


def _line_of(text: str, obj) -> int:
    source, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(source) if text in line)


def test_untraceable_model_error_points_at_the_users_line():
    line = _line_of("if y.sum() > 0:", DataDependent.forward)
    with pytest.raises(ValueError) as info:
        meshplan.plan(DataDependent(), devices=2, example_inputs=(torch.randn(4, 8),))
    err = info.value
    assert isinstance(err, TraceError)
    assert re.match(
        rf"could not trace DataDependent with torch.export \(non-strict\) at {re.escape(__file__)}:{line} in forward: "
        r"`if y.sum\(\) > 0:`: GuardOnDataDependentSymNode: Could not guard on data-dependent expression", str(err)), str(err)
    assert err.__cause__ is not None and type(err.__cause__).__name__ == "GuardOnDataDependentSymNode"


class CallsNumpy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.from_numpy(self.fc(x).detach().numpy())  # leaves torch: untraceable


def test_error_raised_deep_in_torch_still_names_the_users_line():
    line = _line_of("numpy()", CallsNumpy.forward)
    with pytest.raises(TraceError, match=rf"at {re.escape(__file__)}:{line} in forward: `return torch.from_numpy"):
        meshplan.plan(CallsNumpy(), devices=2, example_inputs=(torch.randn(4, 8),))


@pytest.mark.parametrize("timeout,message", [
    (-1, "timeout=-1 is not allowed; give a positive number of seconds or a datetime.timedelta"),
    ("soon", "timeout='soon' is not allowed"),
    (float("inf"), "timeout=inf is not allowed"),
])
def test_timeout_must_be_positive(timeout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_timeout(timeout)
    model, x, _ = build("mlp")
    with pytest.raises(ValueError, match=re.escape(message)):  # before any process group is needed
        meshplan.auto_parallelize(model, example_inputs=(x,), timeout=timeout)


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHPLAN_TIMEOUT", "2.5")
    assert resolve_timeout().total_seconds() == 2.5
    assert resolve_timeout(7).total_seconds() == 7  # the argument wins
    monkeypatch.setenv("MESHPLAN_TIMEOUT", "ten")
    with pytest.raises(ValueError, match=re.escape("MESHPLAN_TIMEOUT='ten' is not a number; give the collective timeout in seconds")):
        resolve_timeout()
    monkeypatch.delenv("MESHPLAN_TIMEOUT")
    assert resolve_timeout().total_seconds() == 600


def _foreign_files(rank, world, plan_path, ckpt_path):
    """World of 1: a plan file made for 2 devices, then a checkpoint of one MLP loaded into another."""
    messages = []
    model, x, _ = build("mlp")
    with open(plan_path) as f:
        plan = meshplan.Plan.from_json(f.read())
    try:
        meshplan.auto_parallelize(model, example_inputs=(x,), plan=plan)
    except ValueError as e:
        messages.append(str(e))
    pmodel = meshplan.auto_parallelize(model, example_inputs=(x,), mesh_shape=(1,))
    opt = torch.optim.Adam(pmodel.parameters())
    meshplan.save_checkpoint(ckpt_path, pmodel, opt, step=1)
    other = meshplan.models.MLP(d_in=32, hidden=32)
    pother = meshplan.auto_parallelize(other, example_inputs=(x,), mesh_shape=(1,))
    for target, optimizer in [(pother, None), (pmodel, torch.optim.SGD(pmodel.parameters(), lr=0.1))]:
        try:
            meshplan.load_checkpoint(ckpt_path, target, optimizer)
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.multiprocess
def test_plan_file_for_another_world_and_checkpoint_of_another_model(tmp_path):
    model, x, _ = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        meshplan.plan(model, devices=2, example_inputs=(x,)).save(str(tmp_path / "plan.json"))
    (messages,) = run_local(1, _foreign_files, str(tmp_path / "plan.json"), str(tmp_path / "ckpt"), timeout=300)
    assert len(messages) == 3, messages
    assert messages[0] == "the plan's mesh dp=2 has 2 devices but the process group has 1 ranks"
    assert messages[1] == (f"checkpoint {tmp_path / 'ckpt'} was saved from a different model: 5 parameters differ in name or "
                           "shape (layers.0.bias: [64] in the checkpoint, [32] here; layers.0.weight: [64, 32] in the checkpoint, "
                           "[32, 32] here; layers.1.bias: [64] in the checkpoint, [32] here; ...)")
    assert messages[2] == f"checkpoint {tmp_path / 'ckpt'} holds Adam state but the optimizer is SGD"


def test_model_on_another_device_than_the_ranks_is_refused():
    """auto_parallelize checks this before planning: a CUDA model (a fake one here) on a gloo (CPU) rank."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshplan.runtime.parallel_module import check_model_device

    with FakeTensorMode():
        tensors = {"fc.weight": torch.empty(4, 4, device="cuda"), "fc.bias": torch.empty(4, device="cuda")}
    with pytest.raises(ValueError, match=r"weight is on cuda:0 but this rank runs on cpu .*move the model to the CPU first"):
        check_model_device(tensors, torch.device("cpu"))
    with torch.device("meta"):
        check_model_device(dict(torch.nn.Linear(4, 4).named_parameters()), torch.device("cpu"))  # meta: materialised per rank
