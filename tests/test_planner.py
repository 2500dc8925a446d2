"""Planner pieces in one process: redistribution steps, candidate strategies, the solver, the Plan."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from _parity import build

import meshplan
from meshplan.cost_model.redistribution import InfeasibleRedistribution, backward_steps, redistribution_steps
from meshplan.ir import MeshSpec, TensorMeta, trace
from meshplan.ir.placement import fmt, parse
from meshplan.planner.solver import Edge, Problem, Switch, evaluate, merge_followers, solve
from meshplan.planner.strategies import generate
from meshplan.plans.plan import SCHEMA_VERSION, Plan

META = TensorMeta((8, 16), "float32")


def steps(src: str, dst: str, mesh=(2, 2)):
    fwd = redistribution_steps(META, parse(src), parse(dst), mesh)
    return [str(s) for s in fwd], [str(s) for s in backward_steps(fwd)]


@pytest.mark.parametrize(
    "src,dst,fwd,bwd",
    [
        ("S(0)R", "RR", ["all_gather(ax0,d0)"], ["reduce_scatter(ax0,d0)"]),
        ("PR", "RR", ["all_reduce(ax0)"], ["all_reduce(ax0)"]),
        ("RP", "RS(1)", ["reduce_scatter(ax1,d1)"], ["all_gather(ax1,d1)"]),
        ("S(0)R", "S(1)R", ["all_to_all(ax0,d0->1)"], ["all_to_all(ax0,d1->0)"]),
        ("RR", "S(0)S(0)", ["chunk(ax0,d0)", "chunk(ax1,d0)"], ["pad(ax1,d0)", "pad(ax0,d0)"]),
        # the inner axis is gathered first, so nested shards keep DTensor's block order
        ("S(0)S(0)", "RR", ["all_gather(ax1,d0)", "all_gather(ax0,d0)"], ["reduce_scatter(ax0,d0)", "reduce_scatter(ax1,d0)"]),
        ("RR", "PR", ["to_partial(ax0)"], ["to_partial(ax0)"]),
    ],
)
def test_redistribution_steps_and_their_duals(src, dst, fwd, bwd):
    assert steps(src, dst) == (fwd, bwd)


def test_partial_cannot_change_kind():
    with pytest.raises(InfeasibleRedistribution):
        redistribution_steps(META, parse("P(avg)"), parse("P"), (2,))


def test_an_axis_of_one_device_moves_nothing():
    # every layout on a 1-device axis is the same local tensor: no collective, no copy (the runtime
    # used to run all-gathers and all-to-alls over 1-rank groups for such plans)
    assert steps("S(0)S(1)", "RS(1)", mesh=(1, 2)) == ([], [])
    assert steps("PR", "RR", mesh=(1, 2)) == ([], [])
    assert steps("P(avg)R", "PR", mesh=(1, 2)) == ([], [])
    assert steps("RS(0)", "RR", mesh=(1, 2)) == (["all_gather(ax1,d0)"], ["reduce_scatter(ax1,d0)"])


def test_placements_round_trip_their_compact_form():
    for text in ["S(0)R", "RP", "P(avg)S(2)", "RRR"]:
        assert fmt(parse(text)) == text
    with pytest.raises(ValueError, match="cannot parse placements"):
        parse("X")


def test_linear_has_the_megatron_strategies():
    model, x, _ = build("mlp")
    g = trace(model, (x,))
    cands = generate(g, MeshSpec((2,)))
    addmm = next(n for n in g.nodes if n.target == "aten.addmm.default")
    names = {str(s) for s in cands.by_node[addmm.name]}
    assert "R,R,S(1)->S(1)" not in names  # bias must follow the sharded output
    assert "S(0),R,S(1)->S(1)" in names  # column parallel (weight.t() sharded on dim 1)
    assert "P,S(1),S(0)->P" in names  # row parallel: contraction dim sharded, partial output
    assert "S(0),R->S(0)" not in names and "R,S(0),R->S(0)" in names  # data parallel


def test_attention_shards_batch_or_heads():
    model, x, _ = build("gpt")
    g = trace(model, (x,))
    cands = generate(g, MeshSpec((4,)))
    sdpa = next(n for n in g.nodes if n.target == "aten.scaled_dot_product_attention.default")
    assert {str(s) for s in cands.by_node[sdpa.name]} == {"R,R,R->R", "S(0),S(0),S(0)->S(0)", "S(1),S(1),S(1)->S(1)"}
    assert {s.source for s in cands.by_node[sdpa.name]} == {"meshplan"}


def test_solver_trades_node_cost_against_edge_cost():
    # a -> b; a prefers layout "x" (cost 0 vs 1) but the edge x->y costs 5 and b only takes "y" cheaply
    p = Problem(
        {"a": [0.0, 1.0], "b": [3.0, 0.0]},
        [Edge("a", "b", ["x", "y"], ["x", "y"], {("x", "x"): 0.0, ("y", "y"): 0.0, ("x", "y"): 5.0, ("y", "x"): 5.0})],
    )
    sol = solve(p, merge=False)
    assert sol.choice == {"a": 1, "b": 1} and sol.objective == pytest.approx(1.0) and sol.status == "optimal"


def test_follower_merging_keeps_the_optimum():
    edge = {("x", "x"): 0.0, ("y", "y"): 0.0, ("x", "y"): 2.0, ("y", "x"): 2.0}
    p = Problem(
        {"a": [0.0, 0.5], "v": [0.25, 0.0], "b": [3.0, 0.0]},
        [Edge("a", "v", ["x", "y"], ["x", "y"], edge), Edge("v", "b", ["x", "y"], ["x", "y"], edge)],
    )
    reduced, merged = merge_followers(p)
    # v and then b take a's layout without resharding: the chain folds into a
    assert set(reduced.node_costs) == {"a"} and merged == {"v": ("a", [0, 1]), "b": ("a", [0, 1])}
    assert reduced.node_costs["a"] == [3.25, 0.5]
    assert solve(p).choice == solve(p, merge=False).choice == {"a": 1, "v": 1, "b": 1}


def test_follower_merging_keeps_a_smaller_option_a_budget_needs():
    # v takes layout x two ways: fast and big (option 0) or slow and small (option 2)
    edge = {("x", "x"): 0.0, ("y", "y"): 0.0}
    p = Problem(
        {"a": [0.0, 0.5], "v": [0.0, 0.0, 1.0]},
        [Edge("a", "v", ["x", "y"], ["x", "y", "x"], edge)],
        node_memory={"a": [0.0, 100.0], "v": [100.0, 100.0, 10.0]},
        memory_budget=50.0,
    )
    reduced, merged = merge_followers(p)
    assert merged == {}, "no option of v dominates for layout x: folding would lose the small one"
    sol = solve(p)
    assert sol.choice == {"a": 0, "v": 2} and sol.memory == pytest.approx(10.0)
    assert sol.choice == solve(p, merge=False).choice


def test_a_switch_is_paid_once_whichever_nodes_turn_it_on():
    # p and q each save 1.0 by sharding (strategy 1), but any sharding costs 1.5 once: sharding one alone
    # loses, sharding both wins; a follower v of p that can only take p's layout carries p's choice
    edge = {("r", "r"): 0.0, ("s", "s"): 0.0}
    def problem(saving: float) -> Problem:
        return Problem({"p": [1.0, 1.0 - saving], "q": [1.0, 1.0 - saving], "v": [0.0, 0.0]},
                       [Edge("p", "v", ["r", "s"], ["r", "s"], edge)],
                       switches=[Switch("sharded", 1.5, {"p": frozenset({1}), "q": frozenset({1}), "v": frozenset({1})})])
    for merge in (True, False):
        both = solve(problem(1.0), merge=merge)
        assert both.choice == {"p": 1, "q": 1, "v": 1} and both.objective == pytest.approx(1.5)
        neither = solve(problem(0.6), merge=merge)  # 2 x 0.6 < 1.5: the switch is not worth it
        assert neither.choice == {"p": 0, "q": 0, "v": 0} and neither.objective == pytest.approx(2.0)
    assert evaluate(problem(1.0), {"p": 1, "q": 0, "v": 1})[0] == pytest.approx(0.0 + 1.0 + 1.5)
    reduced, _ = merge_followers(problem(1.0))
    assert reduced.switches[0].members == {"p": frozenset({1}), "q": frozenset({1})}


def test_every_parameter_pays_dtensor_dispatch_once_one_is_sharded():
    # the runtime keeps a data-parallel plan's parameters plain and makes all of them DTensors as soon as
    # one is sharded: the plan's optimizer step carries the measured dispatch for every trainable parameter
    import math

    from meshplan.cost_model.presets import get_cluster
    from meshplan.cost_model.profile import Profile, torch_version

    prof = Profile(device="test-device", torch_version=torch_version(), cluster="cpu", optimizer_steps={"adam": (1e-5, 1e-9)},
                   dtensor_optimizer_s={"adam": 1e-3})
    cluster = get_cluster("cpu").with_profile(prof)
    model, x, _ = build("gpt")
    dp = meshplan.plan(model, 2, (x,), mode="data_parallel", mesh_shape=(2,), cluster=cluster)
    one = meshplan.plan(model, 2, (x,), mode="semi_auto", parameter_plan={"wpe.weight": "S(0)"},
                        input_layouts={"tokens": "S(0)"}, mesh_shape=(2,), cluster=cluster)
    trainable = [p for p in dp.params if not p.is_buffer]
    plain = {p.node: p.optimizer_s for p in dp.params}
    assert dp.plain_params and not one.plain_params
    assert all(p.optimizer_s == pytest.approx(1e-5 + 1e-9 * math.prod(p.shape)) for p in trainable)
    for p in one.params:  # every trainable parameter, the replicated ones too, pays 1 ms more than plain
        if not p.is_buffer and p.layout == dp.params[[q.node for q in dp.params].index(p.node)].layout:
            assert p.optimizer_s == pytest.approx(plain[p.node] + 1e-3)
    assert one.optimizer_s == pytest.approx(sum(p.optimizer_s for p in one.params))
    assert one.optimizer_s > dp.optimizer_s + (len(trainable) - 1) * 1e-3


def test_dtensor_parameters_are_read_at_the_measured_cost_every_forward_and_backward():
    # the per-rank program reads each trainable DTensor parameter through runtime.local_view: the profile's
    # `dtensor_view_s` per trainable parameter, times contention, is compute of every plan whose parameters are DTensors
    from meshplan.cost_model.presets import get_cluster
    from meshplan.cost_model.profile import Profile, torch_version

    base = dict(device="test-device", torch_version=torch_version(), cluster="cpu", optimizer_steps={"adam": (1e-5, 1e-9)},
                contention={2: 1.5})
    clusters = [get_cluster("cpu").with_profile(Profile(**base, dtensor_view_s=v)) for v in (None, 2e-4)]
    model, x, _ = build("gpt")
    plain, viewed = [meshplan.plan(model, 2, (x,), mode="semi_auto", parameter_plan={"wpe.weight": "S(0)"},
                                   input_layouts={"tokens": "S(0)"}, mesh_shape=(2,), cluster=c) for c in clusters]
    trainable = [p for p in viewed.params if not p.is_buffer]
    assert not viewed.plain_params and [p.layout for p in plain.params] == [p.layout for p in viewed.params]
    assert all(p.view_s == pytest.approx(2e-4 * 1.5) for p in trainable) and all(p.view_s == 0 for p in plain.params)
    assert viewed.compute_s == pytest.approx(plain.compute_s + len(trainable) * 2e-4 * 1.5)
    assert meshplan.Plan.from_json(viewed.to_json()) == viewed
    dp = meshplan.plan(model, 2, (x,), mode="data_parallel", mesh_shape=(2,), cluster=clusters[1])
    assert dp.plain_params and all(p.view_s == 0 for p in dp.params)  # plain parameters are read as they are


@pytest.fixture(scope="module")
def gpt_plan():
    model, x, _ = build("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=4, example_inputs=(x,), mesh_shape=(2, 2))


def test_plan_json_round_trip(gpt_plan):
    again = Plan.from_json(gpt_plan.to_json())
    assert again == gpt_plan and again.hash() == gpt_plan.hash()


def test_plan_rejects_bad_files(gpt_plan):
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.from_json(gpt_plan.to_json()[:100])
    d = json.loads(gpt_plan.to_json())
    d["version"] = 99
    with pytest.raises(ValueError, match="schema version 99 is not supported"):
        Plan.from_json(json.dumps(d))
    del d["params"]
    d["version"] = SCHEMA_VERSION
    with pytest.raises(ValueError, match="malformed"):
        Plan.from_json(json.dumps(d))


def test_plan_prints_mesh_layouts_collectives_time_and_memory(gpt_plan):
    text = str(gpt_plan)
    assert re.search(r"on mesh \w+=2 x \w+=2 \(4 devices", text)  # axes named by what the plan does on them
    assert "predicted: step" in text and "memory per device at the peak: params" in text
    assert "wte.weight = lm_head.weight" in text
    for kind in gpt_plan.collectives():
        assert kind in text


def test_planning_needs_no_devices_or_memory():
    """A 64-device plan from a model on the meta device: nothing is allocated or run."""
    with torch.device("meta"):
        model = meshplan.models.GPT(meshplan.models.GPTConfig(hidden=256, heads=8, layers=2))
    tokens = torch.zeros((64, 16), dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan = meshplan.plan(model, devices=64, example_inputs=(tokens,), mesh_shape=(64,))
    assert plan.mesh.size == 64 and plan.solver.status == "optimal"


def test_the_optimizer_step_is_priced_on_each_local_shard():
    import math

    from meshplan.cost_model.presets import get_cluster

    model, x, _ = build("gpt")
    dp = meshplan.plan(model, 2, (x,), mode="data_parallel", mesh_shape=(2,))
    fsdp = meshplan.plan(model, 2, (x,), mode="manual", parameter_plan={"*": "S(0)"}, input_layouts={"tokens": "S(0)"}, mesh_shape=(2,))
    # without a profile, Adam's step is memory traffic: it reads parameter, gradient and two moments and
    # writes three of them back, 28 bytes per fp32 element, at the device's bandwidth
    adam_s = 28 / get_cluster("cpu").device.memory_bandwidth
    trainable = [p for p in dp.params if not p.is_buffer]
    whole = sum(math.prod(p.shape) for p in trainable)
    halves = sum(math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) for p in trainable)  # S(0) over 2 ranks
    assert dp.optimizer_s == pytest.approx(whole * adam_s, rel=1e-9) and fsdp.optimizer_s == pytest.approx(halves * adam_s, rel=1e-9)
    assert 0 < fsdp.optimizer_s < 0.6 * dp.optimizer_s  # each rank steps half of every parameter
    assert dp.step_time_s == pytest.approx(dp.compute_s + dp.comm_s + dp.optimizer_s, rel=1e-12)
    assert Plan.from_json(dp.to_json()).optimizer_s == dp.optimizer_s


def test_the_dtensor_cost_swap_is_undone_when_two_threads_plan_at_once():
    """Candidate generation swaps DTensor's redistribute_cost for zeros while it asks DTensor's rules. Two planning
    threads must not restore each other's zeros as the original: B enters while A holds the swap, A leaves first."""
    import threading

    from torch.distributed.tensor._ops import utils as dt_utils

    from meshplan.planner.strategies import _without_dtensor_costs

    original = dt_utils.redistribute_cost
    a_in, a_out, b_in, b_out = (threading.Event() for _ in range(4))

    def a():
        with _without_dtensor_costs():
            a_in.set()
            a_out.wait(10)

    def b():
        a_in.wait(10)
        with _without_dtensor_costs():
            b_in.set()
            b_out.wait(10)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    a_in.wait(10)
    b_in.wait(0.5)  # without the lock B is inside by now; with it, B waits for A
    a_out.set()
    threads[0].join(10)
    b_out.set()
    threads[1].join(10)
    assert dt_utils.redistribute_cost is original
