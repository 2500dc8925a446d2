"""Reading plans truthfully (issue 31): one set of figures everywhere, pipelined or not; what a plan wastes; mesh axes
named by use; explain in words; what the solver proved; `--json` for show, diff and explain."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from _parity import build, plan_kwargs

import meshplan
from meshplan.cli.commands import main
from meshplan.cost_model.memory import format_bytes
from meshplan.inspect.summary import LEGEND
from meshplan.plans.axes import ReplicatedWorkWarning, axis_view
from meshplan.models import MLP, gpt_small
from meshplan.planner.pipeline import PipelineOptions
from meshplan.ir.placement import fmt, parse
from meshplan.plans.plan import Plan, Transfer


def quiet_plan(model, devices, inputs, **kw) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(model, devices, inputs, **kw)


@pytest.fixture(scope="module")
def gpt_plans():
    """The small GPT on 4 devices: 2 pipeline stages x dp 2 with 4 microbatches of 2 sequences, and flat on (4,)."""
    model, tokens = gpt_small()
    pipelined = quiet_plan(model, 4, tokens, pipeline=PipelineOptions(degrees=(2,), microbatch_sizes=(1,), tensor_degrees=(1,)))
    flat = quiet_plan(model, 4, tokens, mesh_shape=(4,), pipeline=None)
    assert pipelined.pipeline.microbatches == 4 and pipelined.inputs[0].shape == (2, 16)
    return pipelined, flat


def mlp_plan(mesh, **kw) -> Plan:
    torch.manual_seed(0)
    return quiet_plan(MLP(), mesh, (torch.randn(8, 32),), **kw)


def run_cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------- one set of figures


def test_every_reading_prints_the_same_step_peak_and_mfu(gpt_plans, tmp_path, capsys):
    pipelined, flat = gpt_plans
    assert pipelined.peak_memory.total == pipelined.pipeline.peak_memory  # the fullest pipeline rank, not a single stage
    diff = str(flat.diff(pipelined))
    for plan in gpt_plans:
        step, peak, mfu = f"{plan.step_time_s * 1e3:.3f} ms", format_bytes(plan.peak_memory.total), f"MFU {plan.mfu:.1%}"
        path = tmp_path / f"{plan.hash()}.json"
        plan.save(str(path))
        report = open(plan.report(str(tmp_path / f"{plan.hash()}.html")), encoding="utf-8").read()
        for where, text in (("summary", plan.summary()), ("explain", str(plan.explain("layers.0.mlp.fc1"))),
                            ("explain pipeline", str(plan.explain("pipeline")) if plan.pipeline else step + peak + mfu),
                            ("report", report)):
            assert step in text and peak in text and mfu in text, where
        assert step in diff and peak in diff and f"{plan.mfu:.1%}" in diff
        stored = json.loads(path.read_text())
        assert (stored["step_time_s"], stored["peak_bytes"]) == (plan.step_time_s, plan.peak_memory.total)
        shown = json.loads(run_cli(capsys, "show", str(path), "--json"))
        explained = json.loads(run_cli(capsys, "explain", str(path), "layers.0.mlp.fc1", "--json"))
        for figures in (shown, explained["plan"]):
            assert (figures["step_time_s"], figures["peak_bytes"], figures["mfu"], figures["devices"]) == (
                plan.step_time_s, plan.peak_memory.total, plan.mfu, 4)


def test_diff_compares_a_pipelined_plan_with_a_flat_one_by_step_and_peak(gpt_plans, tmp_path, capsys):
    pipelined, flat = gpt_plans
    assert pipelined.graph_fingerprint != flat.graph_fingerprint  # the pipelined plan's graph is one microbatch
    d = flat.diff(pipelined)
    assert d.graphs == "microbatch" and d.same_graph and not d.collectives  # a microbatch's collectives are not a step's
    assert d.step_time_s == (flat.step_time_s, pipelined.step_time_s)
    assert d.peak_bytes == (flat.memory.total, pipelined.pipeline.peak_memory) and d.delta_memory == d.peak_bytes[1] - d.peak_bytes[0]
    text = str(d)
    assert "different graphs" not in text and "one microbatch of the same model" in text
    assert "devices: 4 devices = dp 4 -> 4 devices = 2 pipeline stages x (dp 2)" in text
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("  ") and " -> " in line][:2] == ["  working", "  bubble"]
    assert "  compute:" not in text and "  communication:" not in text  # one microbatch's, never set against a whole step
    section = text.split("pipeline:\n", 1)[1]
    for line in ("  stages: 1 (no pipeline) -> 2", "  schedule: - -> ", "  microbatches: 1 -> 4 (tokens[2, 16] each)",
                 "  devices per stage: 4 (dp 4) -> 2 (dp 2)", "  stage cuts: - -> pre..layers.0; layers.1..post"):
        assert line in section
    a, b = tmp_path / "flat.json", tmp_path / "pipelined.json"
    flat.save(str(a)), pipelined.save(str(b))
    as_json = json.loads(run_cli(capsys, "diff", str(a), str(b), "--json"))
    assert as_json["graphs"] == "microbatch" and as_json["step_time_s"] == list(d.step_time_s)
    assert as_json["peak_bytes"] == list(d.peak_bytes) and as_json["pipeline"][0] == ["stages", "1 (no pipeline)", "2"]


def test_plan_files_without_the_stored_figures_still_load_and_edited_figures_fail(gpt_plans):
    for plan in gpt_plans:
        d = json.loads(plan.to_json())
        older = {k: v for k, v in d.items() if k not in ("step_time_s", "peak_bytes")}
        assert Plan.from_json(json.dumps(older)) == plan
        for key in ("step_time_s", "peak_bytes"):
            with pytest.raises(ValueError, match=f"plan file is malformed: {key} .* does not match the plan's own figure"):
                Plan.from_json(json.dumps({**d, key: d[key] * 2}))
    # the peak sums each pipeline rank's stages: a stage on a rank the pipeline lacks is named, not an IndexError
    d = json.loads(gpt_plans[0].to_json())
    d["pipeline"]["stages"][1]["device"] = 2
    with pytest.raises(ValueError, match=r"pipeline.stages\[1\].device is 2; the pipeline has ranks 0..1"):
        Plan.from_json(json.dumps(d))


def test_the_report_step_bar_is_the_whole_step(gpt_plans, tmp_path):
    """The bar adds the optimizer step (and offloaded state's host time) to compute and communication, as the summary."""
    flat = gpt_plans[1]
    assert flat.optimizer_s > 0
    text = open(flat.report(str(tmp_path / "flat.html")), encoding="utf-8").read()
    bar = re.search(r"<h2>Predicted step time</h2>.*?</svg>", text, re.S).group(0)
    assert bar.endswith(f">{flat.step_time_s * 1e3:.3f} ms</text></svg>")  # the bar's printed total
    assert f"optimizer step {flat.optimizer_s * 1e3:.3f} ms" in text


# ---------------------------------------------------------------- what a pipelined plan is


def test_a_pipelined_summary_states_its_devices_stages_and_microbatch(gpt_plans):
    pipelined, _ = gpt_plans
    text = pipelined.summary()
    assert text.startswith("meshplan plan for GPT on 4 devices = 2 pipeline stages x (dp 2) (cluster cpu)")
    assert "stage 0 (pipeline rank 0)" in text and "stage 1 (pipeline rank 1)" in text
    assert "inputs of one microbatch (4 per step, the step's batch tokens[8, 16] split along dim 0): tokens[2, 16] S(0)" in text


# ---------------------------------------------------------------- what is wasted


def test_devices_that_split_nothing_are_announced_with_the_counts_that_would():
    model, tokens = gpt_small()
    with pytest.warns(ReplicatedWorkWarning, match=re.escape(
            "mesh axis rep (stored as dp) splits nothing: its 3 devices compute the same and the gradient all-reduce over it "
            "sums identical copies: the batch of 8 does not split over 3; it splits evenly over 2, 4 or 8 devices")):
        plan = meshplan.plan(model, 3, tokens)
    text = plan.summary()
    assert "on mesh rep=3 (3 devices" in text and "wasted: mesh axis rep (stored as dp) splits nothing" in text
    # a batch that divides, but a model too small to split: the same plan on fewer devices would do as well
    model, x, _ = build("mlp")
    with pytest.warns(ReplicatedWorkWarning, match="splitting over it was priced slower than repeating the work, so 1 device"):
        meshplan.plan(model, 2, (x,))


def test_mesh_axes_are_named_by_use():
    """A (2, 2) mesh is stored as dp x tp whatever it carries; it reads as what it carries: data parallelism on both
    axes, or the batch on one and Megatron's split weights on the other. A plan that splits work on every axis warns
    nothing."""
    model, tokens, _ = build("gpt")
    for kind, names in (("data_parallel", ("dp0", "dp1")), ("megatron", ("dp", "tp"))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplicatedWorkWarning)
            warnings.simplefilter("ignore", FutureWarning)
            plan = meshplan.plan(model, 4, (tokens,), **plan_kwargs("gpt", kind, (2, 2)))
        assert plan.mesh.axis_names == ("dp", "tp") and axis_view(plan).names == names
        text = plan.summary()
        assert f"on mesh {names[0]}=2 x {names[1]}=2 (4 devices" in text and "wasted" not in text
        renamed = "mesh axes named by use (the plan file and the runtime's DeviceMesh call them dp, tp)" in text
        assert renamed == (names != ("dp", "tp"))


def test_weights_stored_in_shards_but_gathered_for_use_are_not_tensor_parallelism(gpt_plans):
    """ZeRO / FSDP: a parameter stored split on an axis and all-gathered there before every use leaves the axis dp; used
    split (no gather on that axis), it makes the axis tp."""
    flat = gpt_plans[1]
    p = next(q for q in flat.params if q.fqns == ("layers.0.mlp.fc1.weight",))
    consumer = next(n for n in flat.nodes if n.module_path == "layers.0.mlp.fc1" and n.target.startswith("aten.permute"))
    stored = dataclasses.replace(p, layout=parse("S(0)"))
    gather = Transfer(p.node, consumer.name, 0, parse("S(0)"), parse("R"), (), (), 0.0)
    params = tuple(stored if q is p else q for q in flat.params)
    assert axis_view(dataclasses.replace(flat, params=params, transfers=flat.transfers + (gather,))).names == ("dp",)
    assert axis_view(dataclasses.replace(flat, params=params)).names == ("tp",)


def test_axes_of_one_device_are_hidden():
    plan = mlp_plan((1, 4), input_layouts={"x": "RS(0)"}, param_layouts={"layers.0.weight": "RS(0)"})
    text = plan.summary(ops=True)
    assert "on mesh tp=4 (4 devices" in text and "inputs: x[8, 32] S(0)" in text and "weight S(0)" in text
    assert "RS(0)" not in text and "dp=1" not in text


def test_diff_compares_layouts_by_what_they_do(gpt_plans):
    """Data parallelism on a (4,) mesh (`R`, the batch `S(0)`) and on a (2, 2) one (`RR`, `S(0)S(0)`) replicate every
    parameter, sum every gradient over all copies and split the batch 4 ways: no change to list."""
    flat = gpt_plans[1]
    model, tokens, _ = build("gpt")
    dp = quiet_plan(model, 4, (tokens,), **plan_kwargs("gpt", "data_parallel", (2, 2)))
    assert {fmt(p.layout) for p in flat.params} == {"R"} and {fmt(p.layout) for p in dp.params} == {"RR"}
    d = flat.diff(dp)
    assert d.params == () and "parameters planned differently" not in str(d)
    assert "devices: 4 devices = dp 4 -> 4 devices = dp0 2 x dp1 2" in str(d)
    half = quiet_plan(model, 4, (tokens,), **plan_kwargs("gpt", "megatron", (2, 2)))
    assert flat.diff(half).params  # tensor parallelism is a change


def test_show_ops_names_axes_as_the_summary_does():
    plan = mlp_plan((2, 2), input_layouts={"x": "S(0)S(0)"})
    text = plan.summary(ops=True)
    names = axis_view(plan).names
    assert not re.search(r"\bax\d", text)
    assert f"all_gather({names[1]},d0) all_gather({names[0]},d0)" in text  # the ops table, with the per-layer table's names


def test_the_terminal_prints_a_placement_legend(gpt_plans):
    for plan in gpt_plans:
        assert LEGEND in plan.summary() and "R replicated, S(d) split along tensor dim d, P partial sums" in LEGEND


# ---------------------------------------------------------------- explain and the solver in words


def test_explain_says_in_words_what_each_alternative_would_add():
    model, x, _ = build("mlp")
    plan = quiet_plan(model, 4, (x,), **plan_kwargs("mlp", "megatron", (2, 2)))
    e = plan.explain("layers.2")
    names = axis_view(plan).names
    weight = next(k for k, a in enumerate(e.entries) if a.what == "layers.2.weight")
    assert len(e.why[weight]) == len(e.entries[weight].alternatives)
    text = str(e)
    for a, why in zip(e.entries[weight].alternatives, e.why[weight]):
        assert f"{a.delta_s * 1e3:+.4f} ms: {why}" in text
    by_layout = {a.strategy.outputs[0]: why for a, why in zip(e.entries[weight].alternatives, e.why[weight])}
    sharded = by_layout[parse("S(0)S(0)")]  # stored in shards, but its matmul reads it whole
    assert f"all-gather of layers.2.weight on {names[0]},{names[1]}" in sharded and f"no gradient all-reduce over {names[0]},{names[1]}" in sharded
    assert "1/4 of the parameter, its gradient and optimizer state per device" in sharded
    op = next(k for k, a in enumerate(e.entries) if a.kind == "op")
    assert any("compute per device" in why for why in e.why[op])
    assert json.loads(json.dumps(e.to_dict()))["entries"][weight]["alternatives"][0]["why"] == e.why[weight][0]


@pytest.mark.parametrize("status,gap,backend,says", [
    ("optimal", 0.0, "HIGHS", "solver: optimal (proven, by HIGHS)"),
    ("optimal", 0.0, "GLOP", "solver: optimal (proven, by GLOP's LP relaxation, whose optimum was integral)"),
    ("feasible", 0.0123, "HIGHS", "solver: best found by HIGHS in the time limit, gap 1.23% to the best bound (not proven optimal)"),
    ("local", 0.0, "GLOP", "solver: local optimum of a search one mesh axis at a time, each axis solved exactly with the others held "
                           "(the last by GLOP's LP relaxation, whose optimum was integral); not proven optimal for the whole mesh"),
    ("heuristic", 0.5, "propagation", "solver: greedy propagation of layouts, no solver: gap 50.00% to a simple lower bound"),
])
def test_the_solver_line_says_what_is_proven(gpt_plans, status, gap, backend, says):
    plan = gpt_plans[1]
    plan = dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, status=status, gap=gap, backend=backend, seconds=None))
    text = plan.summary()
    assert says in text and "(gap 0.00%, not proven optimal)" not in text
