"""Memory rows (issue 27, item 1): a pipeline's stage plan is solved under one memory row per pipeline rank, tightened
by each rank's walk, so a configuration whose fastest stage plan is over the budget gets a slower one that fits
instead of being dropped."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import meshplan
from meshplan.cost_model.memory import MemoryBreakdown
from meshplan.cost_model.presets import get_cluster
from meshplan.ir import MeshSpec, trace
from meshplan.models import GPT, GPTConfig
from meshplan.planner.pipeline import PipelineOptions
from meshplan.planner.planner import PlanOptions, make_plan
from meshplan.planner.problem import RowWeights, build_tables
from meshplan.planner.solver import Edge, MemoryRow, Problem, merge_followers, row_held, rows_kept, solve
from meshplan.planner.stage_rows import rank_weights, row_value
from meshplan.planner.strategies import generate
from meshplan.plans.pipeline import PipelinePlan, PipelineStage


def test_each_row_bounds_its_own_part_of_the_problem():
    # a and b each: fast and big (0) or slow and small (1); one row per "rank" holding one of them, the edge's copy in
    # b's row twice (two microbatches in flight)
    # (solved unmerged: b is a follower of a, and folding assumes b keeps a's layout)
    edge = {("x", "x"): 0.0, ("y", "y"): 0.0, ("x", "y"): 0.25, ("y", "x"): 0.25}
    memory = {("x", "y"): 5.0, ("y", "x"): 5.0}
    problem = Problem({"a": [0.0, 1.0], "b": [0.0, 1.0]}, [Edge("a", "b", ["x", "y"], ["x", "y"], edge, memory, name="e0")],
                      node_memory={"a": [100.0, 10.0], "b": [100.0, 10.0]})
    assert solve(problem, merge=False).choice == {"a": 0, "b": 0}
    problem.rows = [MemoryRow("rank 0", 50.0, {"a": [100.0, 10.0]}, {}), MemoryRow("rank 1", 150.0, {"b": [100.0, 10.0]}, {"e0": 2.0})]
    sol = solve(problem, merge=False)
    assert sol.choice == {"a": 1, "b": 0}, "rank 0's row makes a small; rank 1's has room for b's fast strategy"
    assert row_held(problem, problem.rows[1], {"a": 1, "b": 0}) == pytest.approx(100.0 + 2 * 5.0)  # b reads a's copy
    problem.rows[1].bound = 105.0  # now b's copy of a's output (2 x 5) breaks it: b takes a's layout or its small one
    sol = solve(problem, merge=False)
    assert sol.choice == {"a": 1, "b": 1} and rows_kept(problem, sol.choice)
    assert solve(problem, merge=False, minimize="memory").memory == pytest.approx(20.0)  # minimising memory ignores the rows


def test_folding_keeps_an_option_a_row_needs():
    # v's options for layout x: 0 and 2 tie in the problem's own memory, but a row counts 2 smaller
    edge = {("x", "x"): 0.0, ("y", "y"): 0.0}
    problem = Problem({"a": [0.0, 0.5], "v": [0.0, 0.0, 1.0]}, [Edge("a", "v", ["x", "y"], ["x", "y", "x"], edge)],
                      node_memory={"v": [10.0, 10.0, 10.0]},
                      rows=[MemoryRow("rank 0", 50.0, {"v": [100.0, 100.0, 10.0]}, {})])
    _, merged = merge_followers(problem)
    assert merged == {}, "no option of v dominates in the row: folding would lose the small one"
    assert solve(problem).choice == {"a": 0, "v": 2}


def test_a_row_weighing_every_node_once_is_the_solvers_own_row():
    """`RowWeights` of one copy of everything build the problem's own memory row, and `stage_rows.row_value` of a
    plan is that row at the plan's choice: the rows and the tightening read the same bytes the solver bounds."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab_size=64, seq_len=8))
    tokens = torch.randint(0, 64, (8, 8))
    graph = trace(model, (tokens,))
    mesh = MeshSpec((2, 2))
    ones = {n.name: 1.0 for n in graph.nodes}
    row = RowWeights("all", 1e18, ones, ones)
    cands = generate(graph, mesh)
    tables = build_tables(graph, mesh, get_cluster("cpu"), cands.by_node, optimizer="adam", memory_budget=None, rows=[row])
    problem = tables.problem
    for pick in (0, -1):  # two consistent choices: every class's first candidate, and the solver's
        choice = {v: 0 for v in problem.node_costs} if pick == 0 else solve(problem).choice
        try:
            own = sum(problem.node_memory[v][k] for v, k in choice.items())
            own += sum(e.memory.get((e.src_layouts[choice[e.src]], e.dst_layouts[choice[e.dst]]), 0.0) for e in problem.edges)
        except KeyError:
            continue
        assert row_held(problem, problem.rows[0], choice) == pytest.approx(own, rel=1e-12)
    plan = make_plan(graph, mesh, get_cluster("cpu"), PlanOptions(recompute="never", alternatives=False))
    assert row_value(graph, plan, ones, ones, "adam") == pytest.approx(plan.solver.memory_bound, rel=1e-12)


def test_rank_weights_count_each_ranks_stages_and_microbatches_in_flight():
    """Under 1F1B with 4 microbatches on 2 ranks, rank 0 keeps 2 microbatches' activations of its own ops and rank 1
    one; each holds its own parameters once, the tied embedding on both; a stage of the model cut to 2 blocks that
    stands for 3 blocks holds 3/2 of each cut block."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab_size=64, seq_len=8))
    graph = trace(model, (torch.randint(0, 64, (2, 8)),))
    none = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0)

    def pipe(stages):
        return PipelinePlan(degree=2, schedule="1f1b", microbatches=4, chunks=1, step_s=1.0, bubble_s=0.0, bubble_fraction=0.0,
                            p2p_s=0.0, stages=tuple(PipelineStage(index=i, device=i, units=tuple(u), modules=(), time_s=0.0, recompute=False, memory=none)
                                                    for i, u in enumerate(stages)))

    (res0, act0), (res1, act1) = rank_weights(graph, pipe([("pre", "layers.0"), ("layers.1", "post")]))
    first = next(n.name for n in graph.nodes if n.kind == "op" and n.layer == "layers.0")
    last = next(n.name for n in graph.nodes if n.kind == "op" and n.layer == "layers.1")
    assert act0[first] == 2.0 and first not in act1 and act1[last] == 1.0 and last not in act0
    own0 = {n.inputs[0].node for n in graph.nodes if n.kind == "op" and n.layer == "layers.0"} & {p.name for p in graph.nodes if p.kind == "param"}
    assert own0 and all(res0[p] == 1.0 and p not in res1 for p in own0)
    embedding = next(n.name for n in graph.nodes if n.kind == "param" and "tok" in n.name or n.kind == "param" and "wte" in n.name)
    assert res0[embedding] == res1[embedding] == 1.0, "the tied embedding is read at both ends"
    (res0, act0), _ = rank_weights(graph, pipe([("pre", "layers.0", "layers.1", "layers.2"), ("layers.3", "post")]))
    assert res0[first] == res0[last] == 1.5 and act0[first] == 3.0


def test_a_configuration_over_the_budget_is_solved_again_under_rows_not_dropped(caplog):
    """Under a budget 5 % below the fastest plan's peak, a configuration whose unbounded stage plan a rank's walk puts
    over the budget is solved again under a row per rank (logged), and the plan returned keeps the budget."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, heads=2, vocab_size=64, seq_len=8))
    tokens = torch.randint(0, 64, (16, 8))
    options = PipelineOptions(degrees=(2,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = meshplan.plan(model, 4, (tokens,), cluster="cpu", pipeline=options)
        budget = int(free.memory.total * 0.95)
        with caplog.at_level(logging.INFO, logger="meshplan.planner.stage_rows"):
            plan = meshplan.plan(model, 4, (tokens,), cluster="cpu", pipeline=options, memory_budget=budget)
    assert any("solving again with a row per rank" in r.getMessage() for r in caplog.records)
    assert free.memory.total > budget >= plan.memory.total == plan.pipeline.peak_memory
    assert plan.step_time_s >= free.step_time_s
