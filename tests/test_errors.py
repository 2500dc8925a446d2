"""Invariant 4: bad input gets a clear error (or an announced fallback) naming what was given."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from _parity import build, rank_worker

import meshplan
from meshplan.planner.strategies import UnsupportedOpWarning
from meshplan.runtime.launch import run_local


@torch.library.custom_op("meshplan_test::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    """An op no sharding rule knows."""
    return x * 2


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


class WithUnknownOp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return scaled(self.fc(x))


def test_mesh_shape_must_multiply_to_devices():
    model, x, _ = build("mlp")
    with pytest.raises(ValueError, match=r"mesh_shape \(3,\) has 3 devices but devices=4"):
        meshplan.plan(model, devices=4, example_inputs=(x,), mesh_shape=(3,))


@pytest.mark.parametrize("devices", [0, -2, "4", 2.5])
def test_devices_must_be_valid(devices):
    model, x, _ = build("mlp")
    with pytest.raises(ValueError, match="devices must be"):
        meshplan.plan(model, devices=devices, example_inputs=(x,))


def test_unknown_mode_and_inputs_are_rejected():
    model, x, _ = build("mlp")
    with pytest.raises(ValueError, match="mode='magic' is not supported; allowed: auto, data_parallel"):
        meshplan.plan(model, devices=2, example_inputs=(x,), mode="magic")
    with pytest.raises(ValueError, match="inputs='everywhere' is not supported"):
        meshplan.plan(model, devices=2, example_inputs=(x,), inputs="everywhere")


def test_forced_layout_must_divide():
    model, x, _ = build("mlp")  # layers.2.weight is [16, 64]
    with pytest.raises(ValueError, match=r"layout S\(0\) for layers.2.weight of shape \[16, 64\] is not an even sharding"):
        meshplan.plan(model, devices=32, example_inputs=(x,), mesh_shape=(32,), param_layouts={"layers.2.weight": "S(0)"})
    with pytest.raises(ValueError, match="matches no parameter"):
        meshplan.plan(model, devices=2, example_inputs=(x,), param_layouts={"nope.*": "S(0)"})


def test_op_without_rule_falls_back_with_a_named_warning():
    x = torch.randn(4, 8)
    with pytest.warns(UnsupportedOpWarning, match=r"no sharding rule for meshplan_test.scaled.default \(scaled\) at <top>"):
        plan = meshplan.plan(WithUnknownOp(), devices=2, example_inputs=(x,))
    assert plan.fallbacks == ("meshplan_test.scaled.default (scaled) at <top>",)
    assert "replicated for lack of a rule" in str(plan)
    node = next(n for n in plan.nodes if n.name == "scaled")
    assert node.strategy.source == "fallback" and str(node.strategy) == "R->R"


def test_op_without_rule_is_an_error_when_strict():
    with pytest.raises(ValueError, match=r"no sharding rule for meshplan_test.scaled.default \(scaled\).*strict=True"):
        meshplan.plan(WithUnknownOp(), devices=2, example_inputs=(torch.randn(4, 8),), strict=True)


@pytest.mark.parametrize("table", ["op_single_dim_strategy_funcs", "op_strategy_funcs"])
def test_a_dtensor_rule_that_raises_is_reported_not_swallowed(monkeypatch, table):
    """A supported op whose DTensor rule raises (a torch upgrade that breaks it) names the op and the error in the
    fallback warning, and strict=True makes it an error, instead of a silent replicate fallback."""
    from torch.distributed.tensor import DTensor

    from meshplan.planner import strategies

    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.gelu.default if table == "op_single_dim_strategy_funcs" else torch.ops.aten.permute.default
    funcs = getattr(prop, table)
    assert op in funcs and op not in (prop.op_single_dim_strategy_funcs if table == "op_strategy_funcs" else {})

    def broken(*_args, **_kwargs):
        raise RuntimeError("rule broken by an upgrade")

    monkeypatch.setitem(funcs, op, types.SimpleNamespace(func=broken) if table == "op_single_dim_strategy_funcs" else broken)
    monkeypatch.setattr(strategies, "_CACHE", {})
    model, x, _ = build("mlp")
    with pytest.warns(UnsupportedOpWarning, match=rf"DTensor's sharding rule for {op} \(.*\) at .* raised RuntimeError: rule broken by an upgrade"):
        plan = meshplan.plan(model, devices=2, example_inputs=(x,))
    assert any(f.startswith(str(op)) for f in plan.fallbacks)
    with pytest.raises(ValueError, match=rf"DTensor's sharding rule for {op} .* raised RuntimeError.*strict=True"):
        meshplan.plan(model, devices=2, example_inputs=(x,), strict=True)


def test_auto_parallelize_needs_a_process_group():
    model, x, _ = build("mlp")
    with pytest.raises(ValueError, match="needs a torch.distributed process group"):
        meshplan.auto_parallelize(model, devices=2, example_inputs=(x,))


def _wrong_devices(rank, world):
    model, x, _ = build("mlp")
    try:
        meshplan.auto_parallelize(model, devices=4, example_inputs=(x,))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_devices_must_equal_world_size():
    messages = run_local(2, _wrong_devices, timeout=300)
    assert messages == ["devices=4 but the process group has 2 ranks; they must be equal"] * 2


def _different_plans(rank, world, plans):
    try:
        rank_worker(rank, world, "mlp", plans[rank])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_ranks_with_different_plans_fail_before_any_step():
    model, x, _ = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plans = [meshplan.plan(model, devices=2, example_inputs=(x,), mode=m) for m in ("auto", "data_parallel")]
    assert plans[0].hash() != plans[1].hash()
    messages = run_local(2, _different_plans, plans, timeout=300)
    for rank, msg in enumerate(messages):
        assert msg is not None and "ranks computed different plans" in msg and plans[rank].hash() in msg


def test_plan_for_another_model_is_refused():
    mlp, x, _ = build("mlp")
    other = meshplan.models.MLP(d_in=32, hidden=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan = meshplan.plan(other, devices=2, example_inputs=(x,))
        from meshplan.ir.trace import trace
        from meshplan.runtime.parallel_module import ParallelModule

        with pytest.raises(ValueError, match="plan was made for a different graph"):
            ParallelModule(mlp, trace(mlp, (x,)), plan)


def _plan_for_another_group(rank, world, plan4):
    """World 2: a plan for 4 devices given straight to ParallelModule."""
    from meshplan.ir.trace import trace
    from meshplan.runtime.parallel_module import ParallelModule

    model, x, _ = build("mlp")
    try:
        ParallelModule(model, trace(model, (x,)), plan4)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_group_of_another_size_is_a_value_error():
    model, x, _ = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan4 = meshplan.plan(model, devices=4, example_inputs=(x,), mesh_shape=(4,), mode="data_parallel")
    assert run_local(2, _plan_for_another_group, plan4, timeout=300) == [
        "the plan's mesh dp=4 has 4 devices but the process group has 2 ranks; pass a group of 4 ranks or plan for 2 devices"] * 2


def _budget_too_small(rank, world):
    model, x, _ = build("mlp")
    try:
        meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), mesh_shape=(world,), memory_budget="1KiB")
    except ValueError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.multiprocess
def test_a_planning_error_on_the_first_rank_is_a_value_error_on_every_rank():
    """Only the first rank plans: the others wait for its plan, and get its error, of the same kind."""
    (kind0, message0), (kind1, message1) = run_local(2, _budget_too_small, timeout=300)
    assert kind0 == "MemoryBudgetError" and "memory budget 1.0 KiB per device is infeasible" in message0
    assert kind1 == "ValueError" and message1.startswith("rank 0 could not plan, so this rank has no plan either: MemoryBudgetError: memory budget")
