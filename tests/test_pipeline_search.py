"""Pipeline search: the DP over unit ranges, the schedule formulas in the plan, pins, recompute, JSON."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshplan.cost_model.presets import get_cluster
from meshplan.cost_model.schedules import bubble_fraction, rank_shares, schedule_time
from meshplan.models import GPT, GPTConfig
from meshplan.planner.pipeline import PipelineOptions, evaluate, partition, plan_pipeline
from meshplan.planner.stage_profile import Unit
from meshplan.plans.plan import Plan

MiB = 2**20


def units(n_layers: int, *, layer_s=1.0, act=10 * MiB, static=4 * MiB, edge_s=0.5) -> list[Unit]:
    def u(name, t, a, st):
        return Unit(name=name, modules=(name,), time_s=t, forward_s=t / 3, sync_s=0.0, static_bytes=st, param_bytes=st // 4,
                    grad_bytes=st // 4, act_bytes=a, out_bytes=MiB, in_bytes=MiB, shared={})
    return [u("pre", edge_s, act // 10, static), *[u(f"layers.{k}", layer_s, act, static) for k in range(n_layers)], u("post", edge_s, act // 10, static)]


def test_partition_balances_identical_layers():
    parts = partition(units(8), 4, 8, "1f1b", budget=1e12, p2p_s=0.0)
    assert [j - i for i, j, *_ in parts] == [3, 2, 2, 3]  # pre + 2 layers, 2, 2, 2 layers + post
    assert max(s for *_, s, _ in parts) == pytest.approx(2.5)


def test_stage_memory_follows_schedule_formula():
    us = units(8)
    for sched in ("gpipe", "1f1b"):
        pipe = evaluate(us, p=4, d=1, t=1, m=8, schedule=sched, cluster=get_cluster("h100"), budget=1e12, dp_in_profile=True)
        # each rank at its own stage's seconds (2.5, 2, 2, 2.5): the schedule of those, below the equal ranks' 3 / 11
        secs = [st.time_s for st in pipe.stages]
        assert pipe.bubble_fraction == pytest.approx(schedule_time(sched, 4, 8, max(secs) / 3, shares=rank_shares(secs)).bubble_fraction)
        assert pipe.bubble_fraction < bubble_fraction(sched, 4, 8) == pytest.approx(3 / 11)
        for st in pipe.stages:
            acts = sum(u.act_bytes for u in us if u.name in st.units)
            held = 8 if sched == "gpipe" else 4 - st.device  # GPipe: every microbatch; 1F1B: p - s on stage s
            # and the receive buffers of all 8 microbatches: the input from before the cut, the gradient of the output
            received = (MiB if st.index > 0 else 0) + (MiB if st.index < 3 else 0)
            assert st.memory.activations == held * acts + 8 * received
    pipe = evaluate(us, p=4, d=1, t=1, m=8, schedule="interleaved_1f1b", cluster=get_cluster("h100"), budget=1e12, dp_in_profile=True)
    assert pipe.chunks == 2 and len(pipe.stages) == 8
    # a rank's two chunks: their stages summed, the math libraries' workspace (one process's) once
    workspace = get_cluster("h100").device.library_workspace_bytes
    assert workspace > 0 and all(st.memory.workspace == workspace for st in pipe.stages)
    for r, held in enumerate(pipe.rank_memory()):
        assert held.workspace == workspace
        assert held.total == sum(st.memory.total for st in pipe.stages if st.device == r) - workspace
    per_rank = [sum(st.time_s for st in pipe.stages if st.device == r) for r in range(4)]  # each rank's two chunks
    priced = schedule_time("interleaved_1f1b", 4, 8, max(per_rank) / 3, shares=rank_shares(per_rank))
    assert pipe.bubble_fraction == pytest.approx(priced.bubble_fraction) and pipe.bubble_fraction < 3 / (2 * 8 + 3)


def test_measured_action_cost_prices_every_stage_action_and_the_cut_bytes_only():
    """With a profile's per-action seconds a, each stage costs (actions per microbatch) x a more per microbatch, and
    a cut's sends lose the fit's latency (the measured action includes its handshake)."""
    from meshplan.cost_model.profile import Profile

    us = units(8)
    base = get_cluster("h100")
    a = 1e-3
    measured = base.with_profile(Profile(device="x", torch_version="0", cluster="h100", pipeline_action_s={"1f1b": {8: a}, "interleaved_zb": {8: a}}))
    link = base.link_for_axis((2, 2, 2), 0)
    latency = 2 * (link.call_overhead_s + link.latency_s + 1 / link.bandwidth)  # a cut's two sends, less their bytes
    for sched, actions in (("1f1b", 2), ("interleaved_zb", 3)):
        plain = evaluate(us, p=2, d=2, t=2, m=8, schedule=sched, cluster=base, budget=1e12, dp_in_profile=True)
        priced = evaluate(us, p=2, d=2, t=2, m=8, schedule=sched, cluster=measured, budget=1e12, dp_in_profile=True)
        assert [s.units for s in priced.stages] == [s.units for s in plain.stages]
        for s0, s1 in zip(plain.stages, priced.stages):
            cuts = (s0.units[0] != "pre") + (s0.units[-1] != "post")
            assert s1.time_s == pytest.approx(s0.time_s + actions * a - cuts * latency)
        assert priced.step_s > plain.step_s


def test_measured_step_cost_is_paid_once_per_step():
    """The runtime's work outside the schedule's actions (measured per step) adds to the step once, whatever the
    microbatch count, and leaves the stages' own prices as they were."""
    from meshplan.cost_model.profile import Profile

    us = units(8)
    base = get_cluster("h100")
    c = 2e-3
    measured = base.with_profile(Profile(device="x", torch_version="0", cluster="h100", pipeline_step_s={"1f1b": {8: c}}))
    for m in (2, 8):
        plain = evaluate(us, p=2, d=2, t=2, m=m, schedule="1f1b", cluster=base, budget=1e12, dp_in_profile=True)
        priced = evaluate(us, p=2, d=2, t=2, m=m, schedule="1f1b", cluster=measured, budget=1e12, dp_in_profile=True)
        assert [s.time_s for s in priced.stages] == [s.time_s for s in plain.stages]
        assert priced.step_s == pytest.approx(plain.step_s + c)


def test_recompute_when_memory_needs_it():
    us = units(8)
    roomy = evaluate(us, p=2, d=1, t=1, m=8, schedule="gpipe", cluster=get_cluster("h100"), budget=1e12, dp_in_profile=True)
    assert not any(s.recompute for s in roomy.stages)
    # 8 microbatches x 4 layers x 10 MiB do not fit in 200 MiB; 8 x 4 layer inputs x 1 MiB do
    tight = evaluate(us, p=2, d=1, t=1, m=8, schedule="gpipe", cluster=get_cluster("h100"), budget=200 * MiB, dp_in_profile=True)
    assert all(s.recompute for s in tight.stages) and tight.step_s > roomy.step_s
    assert all(s.memory.total <= 200 * MiB for s in tight.stages)
    assert evaluate(us, p=2, d=1, t=1, m=8, schedule="gpipe", cluster=get_cluster("h100"), budget=20 * MiB, dp_in_profile=True) is None


def test_a_recomputing_stage_makes_one_of_its_own_layers_again():
    """At its peak a recomputing stage holds each microbatch's stage input and one of its own layers made again: a
    larger layer on another stage (a wide head's logits, say) is not its cost."""
    us = units(4)
    us[3] = Unit(**{**{f: getattr(us[3], f) for f in Unit.__dataclass_fields__}, "act_bytes": 100 * MiB})  # layers.2
    parts = partition(us, 2, 4, "gpipe", budget=1e12, p2p_s=0.0, recompute=True)
    assert [(i, j) for i, j, *_ in parts] == [(0, 3), (3, 6)]  # pre + layers.0-1, layers.2-3 + post
    for (i, j, rc, _, mem), own in zip(parts, (10 * MiB, 100 * MiB)):
        kept = sum(u.in_bytes if u.name not in ("pre", "post") else u.act_bytes for u in us[i:j])
        assert rc and mem.activations == 4 * kept + own + 4 * MiB  # and the receive buffers of 4 microbatches


def test_a_mixed_precision_stage_holds_its_working_copies_gradients_at_the_end_of_each_backward():
    """The walk's `casting_back` in the search: a weight-heavy stage's peak is the microbatches in flight but one, every
    layer's working-copy gradient and, from the second microbatch on, the largest one's fp32 gradient."""
    us = [Unit(**{**{f: getattr(u, f) for f in Unit.__dataclass_fields__}, "act_bytes": MiB, "copy_grad_bytes": 3 * MiB,
                  "cast_accumulate_bytes": 2 * MiB}) for u in units(4)]
    for m, temp in ((4, 2 * MiB), (1, 0)):
        parts = partition(us, 2, m, "gpipe", budget=1e12, p2p_s=0.0)
        for i, j, rc, _, mem in parts:
            assert not rc and mem.activations == (m - 1) * MiB * (j - i) + 3 * MiB * (j - i) + temp + m * MiB


def test_pins_are_honoured():
    us = units(8)
    pins = {1: 0, 2: 1}  # layers.0 on stage 0, layers.1 on stage 1
    parts = partition(us, 2, 4, "1f1b", budget=1e12, p2p_s=0.0, pins=pins)
    assert parts[0][:2] == (0, 2)  # stage 0 = pre + layers.0 only


@pytest.fixture(scope="module")
def gpt_plan():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, vocab_size=64))
    model.layers[2].pipeline_stage = 1  # semi-auto: attribute pin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_pipeline(model, 4, (torch.randint(0, 64, (8, 16)),), cluster=get_cluster("cpu"),
                             options=PipelineOptions(degrees=(2,), tensor_degrees=(2,), microbatch_sizes=(2,), 
                                                     schedules=("gpipe", "1f1b"), stage_config={"layers.0": 0}))


def test_searched_plan_prints_bubble_and_stage_memory(gpt_plan):
    plan = gpt_plan.plan
    pipe = plan.pipeline
    assert (gpt_plan.best.tensor, gpt_plan.best.pipeline, gpt_plan.best.data) == (2, 2, 1)
    assert pipe.microbatches == 4 and pipe.degree == 2
    secs = [st.time_s for st in pipe.stages]  # one stage per rank, each at its own seconds
    assert pipe.bubble_fraction == pytest.approx(schedule_time(pipe.schedule, 2, 4, max(secs) / 3, shares=rank_shares(secs)).bubble_fraction)
    assert pipe.stage_of("layers.0") == 0 and pipe.stage_of("layers.2") == 1
    text = str(plan)
    assert f"bubble {pipe.bubble_fraction:.1%}" in text
    for st in pipe.stages:
        assert f"stage {st.index} (pipeline rank {st.device})" in text
    assert plan.step_time_s == pipe.step_s > 0


def test_pipeline_plan_json_round_trip(gpt_plan):
    plan = gpt_plan.plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.pipeline.stages[1].memory == plan.pipeline.stages[1].memory


def test_bad_stage_config_names_the_units():
    model = GPT(GPTConfig(layers=2, hidden=32, vocab_size=64))
    with pytest.raises(ValueError, match="stage_config names 'layers.9'.*units: pre, layers.0, layers.1, post"):
        plan_pipeline(model, 2, (torch.randint(0, 64, (4, 16)),), cluster=get_cluster("cpu"),
                      options=PipelineOptions(degrees=(2,), tensor_degrees=(1,), microbatch_sizes=(2,), stage_config={"layers.9": 1}))


def test_search_is_exact_over_its_space():
    """Every (t, p, d) priced alone (as the Megatron table prices the paper's) is no cheaper than the free search."""
    from meshplan.ir.trace import trace
    from meshplan.planner.pipeline import search

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, vocab_size=64))
    x = torch.randint(0, 64, (8, 16))
    opts = PipelineOptions(tensor_degrees=(1, 2), context_degrees=(1,), microbatch_sizes=(1, 2), stage_plan=False)  # the (t, p, d) space
    cache: dict = {}
    graph_at = lambda n: trace(model, (x[:n],))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = search(graph_at, 8, 8, get_cluster("a100"), opts, cache=cache)
        solves = free.solves
        triples = [(t, p, 8 // (t * p)) for t in (1, 2) for p in (1, 2, 4) if 8 % (t * p) == 0]
        fixed = [search(graph_at, 8, 8, get_cluster("a100"), opts, fixed=tp, cache=cache) for tp in triples]
    assert free.plan is None and solves == 4  # one intra-op solve per (t, b), shared with the fixed searches
    assert all(f.solves == 0 for f in fixed)
    assert min(f.step_s for f in (r.best for r in fixed)) == free.best.step_s
    assert all(f.best.step_s >= free.best.step_s for f in fixed)


def test_profiles_of_the_cut_model_price_like_the_whole_model():
    """plan_pipeline solves stage profiles on the model cut to three blocks and stretches them: the search
    picks the configuration and predicts the step that profiles of the whole model give."""
    from meshplan.ir.trace import trace
    from meshplan.planner.pipeline import search

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, hidden=64, heads=4, vocab_size=128, seq_len=32))
    x = torch.randint(0, 128, (16, 32))
    opts = PipelineOptions(tensor_degrees=(1, 2, 4), microbatch_sizes=(1, 2), stage_plan=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cut = plan_pipeline(model, 16, (x,), cluster=get_cluster("h100"), options=opts)
        whole = search(lambda n: trace(model, (x[:n],)), 16, 16, get_cluster("h100"), opts)
    assert (cut.best.tensor, cut.best.pipeline, cut.best.data, cut.best.micro) == (
        whole.best.tensor, whole.best.pipeline, whole.best.data, whole.best.micro)
    assert cut.best.pipe.schedule == whole.best.pipe.schedule
    assert cut.best.step_s == pytest.approx(whole.best.step_s, rel=1e-3)


def test_default_call_searches_pipelines_only_across_nodes():
    from meshplan import plan
    from meshplan.api import multi_node_pipeline

    h100 = get_cluster("h100")
    assert multi_node_pipeline(16, None, "auto", False, h100) == "auto"
    assert multi_node_pipeline(8, None, "auto", False, h100) is None  # one node
    assert multi_node_pipeline((2, 8), None, "auto", False, h100) is None  # a mesh given
    assert multi_node_pipeline(16, (2, 8), "auto", False, h100) is None
    assert multi_node_pipeline(16, None, "semi_auto", True, h100) is None
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, vocab_size=64))
    x = torch.randint(0, 64, (16, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert plan(model, 16, (x,), cluster="h100").pipeline is not None
        assert plan(model, 16, (x,), cluster="h100", pipeline=None).pipeline is None
        assert plan(model, 8, (x,), cluster="h100").pipeline is None
        with pytest.raises(ValueError, match=r"cluster 'h100' \(80 GiB per device\).*cluster="):
            plan(model, 16, (x,), cluster="h100", memory_budget="64KiB")


@pytest.mark.parametrize("schedule, p, recompute", [("1f1b", 2, False), ("gpipe", 2, True), ("interleaved_1f1b", 2, False), ("1f1b", 1, False)])
def test_stage_plans_of_the_cut_model_stretch_to_the_whole_models(schedule, p, recompute, monkeypatch):
    """Ranking prices a configuration by its stage plan on the model cut to three blocks: its stages' walked peaks and
    its step, stretched to the whole stack, are those of the whole model's stage plan (stages of 4 and 8 blocks
    stretch from 2 and 3, interleaved ones of 2 blocks are walked as they are). A stage holds every gradient bucket one
    of its parameters is in, and the cut model's buckets are not the whole model's: here each parameter has its own."""
    monkeypatch.setattr("meshplan.planner.planner.GRAD_BUCKET_BYTES", 1)
    from dataclasses import replace

    from meshplan.ir.mesh import MeshSpec
    from meshplan.ir.repeat import repeated_stacks, truncated
    from meshplan.ir.trace import trace
    from meshplan.planner.pipeline import reprice
    from meshplan.planner.planner import UNBOUNDED, PlanOptions, make_plan, with_walked_memory
    from meshplan.planner.recompute import with_stage_recompute
    from meshplan.planner.stage_profile import profile_units, repeat_layers, stretched_stage_memory

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, hidden=64, heads=4, vocab_size=128, seq_len=32))
    x = torch.randint(0, 128, (4, 32))
    with truncated(model, repeated_stacks(model)):
        cut = trace(model, (x,), copy_repeated=False)
    whole = trace(model, (x,))
    cluster = get_cluster("h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        short, full = (make_plan(g, MeshSpec((2,)), cluster, PlanOptions(memory_budget=UNBOUNDED, alternatives=False)) for g in (cut, whole))
    pipe = evaluate(profile_units(whole, full), p=p, d=1, t=2, m=4, schedule=schedule, cluster=cluster, budget=1e12, dp_in_profile=True,
                    recompute=recompute)
    assert max(len(s.units) for s in pipe.stages) > 4 or schedule.startswith("interleaved")
    walked = with_walked_memory(with_stage_recompute(replace(full, pipeline=pipe), whole), whole, "adam")
    assert [(s.memory, s.idle) for s in stretched_stage_memory(cut, short, pipe)] == [(s.memory, s.idle) for s in walked.pipeline.stages]
    assert all((s.idle is not None) == (pipe.chunks > 1) for s in walked.pipeline.stages)
    stretched = reprice(repeat_layers(profile_units(cut, short), 8), pipe, d=1, t=2, cluster=cluster, dp_in_profile=True)
    assert stretched.step_s == pytest.approx(reprice(profile_units(whole, full), pipe, d=1, t=2, cluster=cluster, dp_in_profile=True).step_s,
                                             rel=1e-3)


def test_stage_plans_keep_each_ops_priced_tensor_parallel_layout():
    """The stage plan on (d, t) starts from the configuration's profile on (t,): every op of the repeated layers keeps
    its profile's layout on the tensor-parallel axis, so the solver places only the data-parallel one there (a smaller
    problem); a preferred layout no candidate of a node has leaves that node free. The tensor-parallel axis is solved
    next, with the data-parallel layouts found."""
    from meshplan.ir.mesh import MeshSpec
    from meshplan.ir.placement import Shard
    from meshplan.ir.trace import trace
    from meshplan.planner.constraints import Constraint
    from meshplan.planner.planner import UNBOUNDED, PlanOptions, make_plan
    from meshplan.planner.stage_layouts import arranged_layouts, carried_layouts

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, heads=2, vocab_size=64, seq_len=16))
    x = torch.randint(0, 64, (8, 16))
    profiled, graph = trace(model, (x[:2],)), trace(model, (x[:4],))  # b = 2, d = 2
    cluster = get_cluster("h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = make_plan(profiled, MeshSpec((2,)), cluster, PlanOptions(memory_budget=UNBOUNDED, alternatives=False))
        params, inputs = arranged_layouts(graph, profile, data=2)
        ops = carried_layouts(graph, profiled, profile, axes=(None, 0), why="priced", layers_only=True)
        mesh = MeshSpec((2, 2), ("dp", "tp"))

        def solved(preferred):
            return make_plan(graph, mesh, cluster, PlanOptions(memory_budget=UNBOUNDED, alternatives=False, param_layouts=params,
                                                               input_layouts=inputs, preferred=preferred))

        kept, free = solved(ops), solved(())
        node = next(n for n in graph.nodes if n.kind == "op" and len(n.out.shape) == 3)
        impossible = solved((Constraint(node.name, "out", 0, (None, Shard(5)), "its output", "a test"),))
    assert {c.node for c in ops} == {n.name for n in graph.nodes if n.kind == "op" and n.layer}  # pre and post are left free
    chosen = {n.name: n.strategy for n in kept.nodes}
    assert all((chosen[c.node].inputs if c.slot == "in" else chosen[c.node].outputs)[c.index][1] == c.layout[1] for c in ops)
    assert kept.solver.variables < free.solver.variables
    assert impossible.step_time_s == free.step_time_s
    # then the tensor-parallel axis, each op keeping the data-parallel layouts found: never slower
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = solved(carried_layouts(graph, graph, kept, axes=(0, None), why="solved first"))
    assert again.step_time_s <= kept.step_time_s
    assert all([p[0] for p in n.strategy.inputs + n.strategy.outputs if p] == [p[0] for p in chosen[n.name].inputs + chosen[n.name].outputs if p]
               for n in again.nodes)


def test_a_stage_plan_weighs_its_once_per_step_costs_by_its_microbatches():
    """A pipeline stage runs one microbatch's plan m times per step, its gradient sync and optimizer step once. Solved
    with `microbatches=m` (as the pipeline search solves stage plans), the plan minimises that step; solved as if the
    per-step costs came with every microbatch, it spares the gradient sync at the price of every microbatch (here by
    more than 5 %)."""
    from meshplan.ir.mesh import MeshSpec
    from meshplan.ir.trace import trace
    from meshplan.planner.planner import UNBOUNDED, PlanOptions, make_plan

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=4096, seq_len=256, hidden=1024, heads=8, layers=2))
    graph = trace(model, (torch.zeros(16, 256, dtype=torch.long, device="meta"),))
    m, mesh, cluster = 64, MeshSpec((8, 8), ("dp", "tp")), get_cluster("h100")

    def pipeline_step(plan) -> float:
        once = plan.optimizer_s + sum(b.time_s for b in plan.buckets)
        return m * (plan.step_time_s - once) + once

    weighed = make_plan(graph, mesh, cluster, PlanOptions(memory_budget=UNBOUNDED, alternatives=False, microbatches=m))
    unweighed = make_plan(graph, mesh, cluster, PlanOptions(memory_budget=UNBOUNDED, alternatives=False))
    assert pipeline_step(weighed) < 0.95 * pipeline_step(unweighed)


def test_stages_computing_side_by_side_share_the_cores():
    """On ranks that share a CPU's cores (measured contention > 1) stages priced at their own sub-mesh's contention
    slow to that of the ranks computing at once, p (1 - bubble fraction) stages of them on average: one microbatch
    through two stages runs one stage at a time (unchanged); four microbatches keep 1.6 stages (3.2 ranks) busy.
    The search's profiles, priced on the tensor-parallel width, take the data-parallel ranks' contention as well."""
    import dataclasses

    from meshplan.cost_model.profile import Profile, torch_version

    shared = Profile(device="test", torch_version=torch_version(), cluster="cpu", contention={2: 1.0, 4: 2.0})
    alone = dataclasses.replace(shared, contention={})
    for m, factor in ((1, 1.0), (4, 1.6)):
        shared_pipe, alone_pipe = (evaluate(units(4), p=2, d=2, t=1, m=m, schedule="gpipe", cluster=get_cluster("cpu").with_profile(prof),
                                            budget=1e12, dp_in_profile=True) for prof in (shared, alone))
        assert alone_pipe.bubble_fraction == shared_pipe.bubble_fraction == pytest.approx(1 / (m + 1))
        # nothing outside the schedule here (no syncs, ties or measured per-step work): the step is the schedule's
        assert shared_pipe.step_s == pytest.approx(factor * alone_pipe.step_s)
        assert shared_pipe.bubble_s == pytest.approx(factor * alone_pipe.bubble_s)
    # the search's units are priced on the tensor-parallel width alone (t = 1 here: contention 1): its price of a
    # stage on a data-parallel pair takes the pair's contention too, as the returned stage plan's does
    shared = dataclasses.replace(shared, contention={2: 1.5, 4: 3.0})
    for in_profile, factor in ((False, 1.5), (True, 1.0)):  # the schedule's part (its bubble) scales; the dp sync does not
        shared_pipe, alone_pipe = (evaluate(units(4), p=2, d=2, t=1, m=1, schedule="gpipe", cluster=get_cluster("cpu").with_profile(prof),
                                            budget=1e12, dp_in_profile=in_profile) for prof in (shared, alone))
        assert shared_pipe.bubble_s == pytest.approx(factor * alone_pipe.bubble_s)
