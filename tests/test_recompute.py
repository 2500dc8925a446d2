"""Activation recomputation: a choice of the solve, priced exactly, and run by the runtime with parity.

What a recomputed layer costs and saves is checked against hand-computed figures from the plan
without recomputation; the solver must pick it exactly when the budget needs it and it beats the
alternatives; on gloo ranks, a recomputed plan trains like one process and runs each recomputed
layer's forward collectives once more in backward (the plan lists them under `recompute:`).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _parity import build, check_parity, plan_kwargs, rank_worker
from torch import nn

import meshplan
from meshplan.planner.planner import MemoryBudgetError
from meshplan.plans.plan import Plan
from meshplan.runtime.launch import run_local


def _plan(name: str, kind: str, mesh_shape, **kw):
    model, x, _ = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=math.prod(mesh_shape), example_inputs=(x,), **plan_kwargs(name, kind, mesh_shape), **kw)


@pytest.mark.parametrize("kind", ["data_parallel", "megatron", "fsdp"])
def test_recompute_trades_forward_time_for_activation_memory(kind):
    keep = _plan("gpt", kind, (2,), recompute="never")
    again = _plan("gpt", kind, (2,), recompute="always")
    assert keep.recompute == () and again.recompute == ("layers.0", "layers.1")
    # a recomputed op costs its forward once more (backward = BACKWARD_FACTOR x forward); compared
    # where both plans chose the same strategy (recomputation may shift a few layouts)
    from meshplan.cost_model.compute import BACKWARD_FACTOR

    before = {n.name: n for n in keep.nodes}
    same = [n for n in again.nodes if n.strategy == before[n.name].strategy and n.time_s > 0]
    assert len(same) > 0.8 * sum(n.time_s > 0 for n in again.nodes)
    for n in same:
        factor = (2 + BACKWARD_FACTOR) / (1 + BACKWARD_FACTOR) if n.module_path.startswith("layers.") else 1.0
        assert n.time_s == pytest.approx(before[n.name].time_s * factor, rel=1e-9), n.name
    assert again.step_time_s > keep.step_time_s
    # each recomputed layer's forward moves run again: their time is in the transfer
    for t in again.transfers:
        assert t.recompute == again.nodes[[n.name for n in again.nodes].index(t.consumer)].module_path.startswith("layers.") if t.consumer != "output" else not t.recompute
    assert again.memory.total < keep.memory.total  # the walked peak
    assert again.solver.memory_bound < keep.solver.memory_bound
    assert (again.memory.params, again.memory.optimizer) == (keep.memory.params, keep.memory.optimizer)
    forward = {k.split(":")[1]: v for k, v in again.collectives().items() if k.startswith("forward:")}
    rerun = {k.split(":")[1]: v for k, v in again.collectives().items() if k.startswith("recompute:")}
    assert all(rerun[k] <= forward[k] for k in rerun)


def test_the_solver_recomputes_only_when_the_budget_needs_it():
    free = _plan("gpt", "data_parallel", (2,))
    assert free.recompute == ()  # recomputation only costs time: never chosen without memory pressure
    never = _plan("gpt", "data_parallel", (2,), recompute="never")
    always = _plan("gpt", "data_parallel", (2,), recompute="always")
    # at the recomputed plan's walked peak, only recomputation (with the forced data-parallel layouts) fits: the walk
    # frees much of what the per-node sum keeps, so the peaks without recomputation come within 2 % of it
    budget = always.memory.total
    assert budget < never.memory.total
    squeezed = _plan("gpt", "data_parallel", (2,), memory_budget=budget)
    assert squeezed.recompute == ("layers.0", "layers.1")
    assert squeezed.memory.total <= budget
    assert squeezed.step_time_s == pytest.approx(always.step_time_s, rel=1e-9)
    with pytest.raises(MemoryBudgetError):
        _plan("gpt", "data_parallel", (2,), memory_budget=budget, recompute="never")


def test_recompute_is_saved_and_loaded(tmp_path):
    plan = _plan("gpt", "megatron", (2,), recompute="always")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.from_json(path.read_text())
    assert loaded == plan and loaded.recompute == plan.recompute
    assert loaded.collectives() == plan.collectives()


def test_bad_recompute_value_is_a_value_error():
    with pytest.raises(ValueError, match="recompute='sometimes' is not supported; allowed: auto, never, always"):
        _plan("gpt", "data_parallel", (2,), recompute="sometimes")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,kind", [("gpt", "megatron"), ("llama", "fsdp")])
def test_parity_with_recomputed_layers(name, kind):
    plan = _plan(name, kind, (2,), recompute="always")
    assert plan.collectives()["recompute:all_gather"] + plan.collectives()["recompute:all_reduce"] > 0
    results = run_local(2, rank_worker, name, plan, timeout=600)
    check_parity(name, plan, results)  # losses, parameters, and executed == planned collectives


def test_long_sequences_solve_with_their_bytes_scaled():
    """At 65,536 tokens a Hugging Face Llama-3-8B shape with its loss inside holds terms of 1e10-1e11 bytes (its fp32
    logits) beside terms of 1e-9 seconds: with the rows in bytes, GLOP's relaxation and HiGHS both called forced
    recomputation under a 10 TB budget infeasible, and the default call at 65,536 tokens on 8 H100s (32 layers) raised
    a MemoryBudgetError at 117.6 GiB. In units scaled to the problem's bytes (`solver.memory_unit`) both plan."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=65536, tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    tokens = torch.zeros(1, 65536, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = meshplan.plan(model, devices=8, example_inputs=(tokens,), example_kwargs={"labels": tokens}, cluster="h100",
                             mesh_shape=(8,), axis_names=("dp",), recompute="always", memory_budget=1e13)
    assert plan.recompute and plan.memory.total < 80 * 2**30


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _TwoStacks(nn.Module):
    """Two recompute groups that save different bytes per second of forward: which to recompute depends on the budget."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(_Block(64, 256) for _ in range(3))
        self.b = nn.ModuleList(_Block(64, 1024) for _ in range(3))

    def forward(self, x):
        for layer in [*self.a, *self.b]:
            x = layer(x)
        return x.square().mean()


def test_each_choice_of_recomputed_groups_solved_fixed_matches_the_joint_solve(monkeypatch):
    """Under a budget that needs recomputation, the planner solves each choice of recomputed groups with it fixed
    (`planner.ENUMERATED_GROUPS`); the fastest equals the one solve that also decides the recomputation, at budgets
    where the best choice is none, either group alone, and both."""
    import meshplan.planner.planner as planner

    torch.manual_seed(0)
    model, x = _TwoStacks(), torch.randn(512, 64)

    def plan(**kw) -> Plan:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return meshplan.plan(model, devices=2, example_inputs=(x,), **kw)

    always = plan(recompute="always").memory.total
    chosen = set()
    for budget in (None, always, 0.75 * always, 0.7 * always):
        fixed = plan(memory_budget=budget)
        monkeypatch.setattr(planner, "ENUMERATED_GROUPS", 0)  # the joint solve
        joint = plan(memory_budget=budget)
        monkeypatch.undo()
        assert fixed.step_time_s == pytest.approx(joint.step_time_s, rel=1e-9)
        assert budget is None or fixed.memory.total <= budget
        chosen.add(tuple(sorted({layer.split(".")[0] for layer in fixed.recompute})))
    assert chosen == {(), ("a",), ("b",), ("a", "b")}
