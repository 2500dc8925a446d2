"""Reading plans: summary, explain, diff, the strategy file (save / load_plan), plan_code, tensor maps."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import meshplan
from meshplan.plans.axes import axis_view
from meshplan.inspect.summary import grouped_units, layer_units
from meshplan.ir.placement import Partial, Replicate, Shard, fmt, parse
from meshplan.ir.tensor_map import from_tensor_map, to_tensor_map
from meshplan.models import MLP
from meshplan.plans.plan import Plan


def make(model, x, devices, **kw) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices, (x,), **kw)


def mlp(**kw):
    torch.manual_seed(0)
    return MLP(**kw), torch.randn(8, kw.get("d_in", 32))


@pytest.fixture(scope="module")
def mlp_plans():
    model, x = mlp()
    # the batch arrives split over both axes, so the plan gathers the output over dp and tp
    return model, x, make(model, x, (2, 2), input_layouts={"x": "S(0)S(0)"}), make(model, x, (2,))


# ---------------------------------------------------------------- tensor maps (MindSpore)


@pytest.mark.parametrize(
    "layout,mesh,ndim,tmap",
    [
        ("S(0)R", (2, 4), 2, (1, -1)),
        ("RS(1)", (2, 4), 2, (-1, 0)),
        ("S(1)S(0)", (2, 4), 2, (0, 1)),
        ("S(0)S(0)", (2, 2), 2, ((1, 0), -1)),
        ("RR", (2, 2), 1, (-1,)),
        ("S(2)", (8,), 3, (-1, -1, 0)),
        ("RS(0)S(0)", (2, 2, 2), 1, ((1, 0),)),
    ],
)
def test_tensor_map_both_ways(layout, mesh, ndim, tmap):
    assert to_tensor_map(parse(layout), mesh, ndim) == (mesh, tmap)
    assert from_tensor_map(mesh, tmap) == parse(layout)


@given(st.lists(st.integers(-1, 2), min_size=1, max_size=3))
def test_tensor_map_round_trips_any_outer_major_layout(codes):
    layout = tuple(Replicate() if c < 0 else Shard(c) for c in codes)
    mesh = tuple(2 + i for i in range(len(codes)))
    dm, tmap = to_tensor_map(layout, mesh, 3)
    assert from_tensor_map(dm, tmap) == layout


def test_tensor_map_rejects_what_it_cannot_express():
    with pytest.raises(ValueError, match="no tensor-map form"):
        to_tensor_map((Partial(), Replicate()), (2, 2), 2)
    with pytest.raises(ValueError, match="out of range"):
        to_tensor_map((Shard(2),), (2,), 2)
    with pytest.raises(ValueError, match="inner first"):
        from_tensor_map((2, 2), ((0, 1), -1))
    with pytest.raises(ValueError, match="more than one tensor dim"):
        from_tensor_map((2, 2), (0, 0))
    with pytest.raises(ValueError, match="invalid"):
        from_tensor_map((2, 2), (2, -1))


# ---------------------------------------------------------------- summary


def test_summary_has_mesh_layers_collectives_time_and_memory(mlp_plans):
    _, _, plan, _ = mlp_plans
    text = str(plan)
    assert text == plan.summary()
    view = axis_view(plan)
    assert f"mesh {view.mesh} (4 devices; cluster cpu)" in text
    assert re.search(r"compute [\d.]+ ms \+ communication [\d.]+ ms \+ optimizer step [\d.]+ ms \+ bubble 0\.000 ms", text)
    assert re.search(r"params .* grads .* optimizer .* activations .*=", text)
    for p in plan.params:  # MLP parameters live in layers.N: one row per layer, names relative to it
        layer, name = p.fqns[0].rsplit(".", 1)
        row = next(line for line in text.splitlines() if f"│ {layer} " in line or f"│ {layer}-" in line)
        assert row and f"{name} {fmt(p.layout)}" in text
    names = view.names
    for t in plan.transfers:  # every collective appears in its layer's row with its mesh axis
        for phase, steps in (("fwd", t.forward), ("bwd", t.backward)):
            for step in steps:
                if step.communicates:
                    assert f"{phase} {step.kind}({names[step.axis]})" in text
    for b in plan.buckets:
        assert f"grad sync({','.join(names[a] for a in b.axes)})" in text


def test_repeated_layers_with_equal_plans_print_once():
    model, x = mlp(depth=5)
    plan = make(model, x, 2)
    units = [u for u in layer_units(plan) if u.name.startswith("layers.")]
    groups = [(label, count) for label, count, u in grouped_units(plan) if u.name.startswith("layers.")]
    # the groups are exactly the maximal runs of layers whose plans (signatures) are equal
    runs: list[list] = []
    for u in units:
        if runs and runs[-1][-1].signature == u.signature:
            runs[-1].append(u)
        else:
            runs.append([u])
    assert [count for _, count in groups] == [len(r) for r in runs]
    assert any(count > 1 for _, count in groups), "hidden layers of equal shape should plan identically"
    text = str(plan)
    for (label, count), run in zip(groups, runs):
        assert label == (run[0].name if count == 1 else f"{run[0].name}-{run[-1].name.rsplit('.', 1)[1]}")
        if count > 1:
            assert f"{label} (x{count})" in text


# ---------------------------------------------------------------- explain


def test_explain_alternatives_bound_the_cost_of_forcing_them(mlp_plans):
    model, x, plan, _ = mlp_plans
    e = plan.explain("layers.1")
    by_kind = {a.kind for a in e.entries}
    assert {"param", "op"} <= by_kind
    weight = next(a for a in e.entries if a.what == "layers.1.weight")
    chosen = next(p.layout for p in plan.params if p.fqns == ("layers.1.weight",))
    assert weight.chosen.outputs[0] == chosen
    deltas = [a.delta_s for a in weight.alternatives]
    assert deltas == sorted(deltas) and all(d >= -1e-12 for d in deltas)  # optimal solve: no cheaper local move
    # forcing an alternative raises the solver's objective by at least 0 (the plan is optimal) and
    # at most its local delta (the planner can keep every other node as it was)
    alt = weight.alternatives[0]
    forced = make(model, x, (2, 2), input_layouts={"x": "S(0)S(0)"}, param_layouts={"layers.1.weight": alt.strategy.outputs[0]})
    assert -1e-12 <= forced.solver.objective_s - plan.solver.objective_s <= alt.delta_s + 1e-12
    text = str(e)
    assert "layers.1.weight" in text and "alternatives" in text and "addmm" in text


def test_explain_names_divisibility_and_annotation():
    model, x = mlp(d_out=6)
    plan = make(model, x, 4, mesh_shape=(4,), param_layouts={"layers.0.weight": "R"})
    e = plan.explain("layers.2.weight")
    reasons = {r.strategy.outputs[0]: r.reason for r in e.entries[0].ruled_out}
    assert reasons[(Shard(0),)] == "divisibility: output dim 0 of size 6 does not split evenly over 4 devices"
    forced = plan.explain("layers.0.weight").entries[0]
    assert forced.candidates == 1 and not forced.alternatives
    assert {r.reason for r in forced.ruled_out} == {"annotation: param_layouts['layers.0.weight']='R'"}
    assert {r.strategy.outputs[0] for r in forced.ruled_out} == {(Shard(0),), (Shard(1),)}
    op = next(a for a in plan.explain("layers.2").entries if a.kind == "op")
    assert any(r.reason.startswith("divisibility: ") for r in op.ruled_out)
    styled = make(model, x, 4, mesh_shape=(4,), parallelize_plan={"layers.0": "colwise"})
    bias = styled.explain("layers.0.bias").entries[0]
    assert bias.chosen.outputs[0] == (Shard(0),)
    assert {r.reason for r in bias.ruled_out} == {"annotation: parallelize_plan['layers.0']='colwise'"}


def test_explain_names_memory_when_a_budget_is_set():
    model, x = mlp()
    # 48 KiB fits layers.1.weight (64x64 fp32 + grad + Adam state) sharded 2 or 4 ways, not replicated (64 KiB); the
    # smallest walked peak of the whole plan is 40.7 KiB
    plan = make(model, x, (2, 2), memory_budget=48 * 1024)
    entry = plan.explain("layers.1.weight").entries[0]
    mem = {r.strategy.outputs[0]: r.reason for r in entry.ruled_out if r.reason.startswith("memory")}
    assert mem[(Replicate(), Replicate())] == "memory: needs 64.0 KiB per device on its own, over the budget of 48.0 KiB"
    assert all(a.strategy.outputs[0] != (Replicate(), Replicate()) for a in entry.alternatives)


def test_explain_rejects_unknown_names(mlp_plans):
    plan = mlp_plans[2]
    with pytest.raises(ValueError, match=r"'layers\.9' names no module.*close matches: layers\."):
        plan.explain("layers.9")
    with pytest.raises(ValueError, match="module path"):
        plan.explain("")


# ---------------------------------------------------------------- diff


def test_diff_reports_changes_and_costs(mlp_plans):
    model, x, a, b = mlp_plans
    assert a.diff(a).identical and str(a.diff(a)) == "the plans are identical"
    split = {"layers.0.weight": "RS(0)", "layers.0.bias": "RS(0)", "layers.1.weight": "RS(1)"}
    tp = make(model, x, (2, 2), param_layouts=split)
    d = tp.diff(b)
    assert not d.identical and d.same_graph
    assert ("devices", f"4 devices = {axis_view(tp).grid}", f"2 devices = {axis_view(b).grid}") in d.settings
    assert d.delta_step_time_s == pytest.approx(b.step_time_s - tp.step_time_s)
    assert d.delta_memory == b.memory.total - tp.memory.total
    # the split weights changed; a parameter replicated in both plans means the same on either mesh
    changed = {c.name for c in d.params}
    assert set(split) <= changed and all(p.fqns[0] in split or fmt(p.layout) != "RR" for p in tp.params if p.fqns[0] in changed)
    text = str(d)
    assert "devices: 4 devices = " in text and "predicted step:" in text and "peak memory per device:" in text


# ---------------------------------------------------------------- strategy file


def test_plan_file_is_deterministic_and_reloads(mlp_plans, tmp_path):
    model, x, plan, _ = mlp_plans
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = make(model, x, (2, 2), input_layouts={"x": "S(0)S(0)"})
    again.save(str(tmp_path / "again.json"))
    assert path.read_bytes() == (tmp_path / "again.json").read_bytes()
    d = json.loads(path.read_text())
    assert d["version"] == 3 and "seconds" not in d["solver"]
    w = next(p for p in d["params"] if p["fqns"] == ["layers.0.weight"])
    assert w["device_matrix"] == [2, 2] and from_tensor_map((2, 2), tuple(tuple(e) if isinstance(e, list) else e for e in w["tensor_map"])) == parse(w["layout"])
    loaded = meshplan.load_plan(str(path), model, (x,), devices=4)
    assert loaded == plan and loaded.hash() == plan.hash() and loaded.solver.seconds is None
    assert str(loaded.explain("layers.1")) == str(plan.explain("layers.1"))


def test_version_2_files_load_unless_a_kernel_lacks_its_collectives(mlp_plans):
    """Version 3 lists the vocabulary-parallel log-softmax's all-reduces on its node; a version-2 file means
    the same unless it has such a kernel, whose collectives it did not list."""
    _, _, plan, _ = mlp_plans
    d = json.loads(plan.to_json())
    d["version"] = 2
    assert Plan.from_json(json.dumps(d)) == plan
    node = d["nodes"][0]
    node["strategy"]["kernel"] = "log_softmax(dim=1)"
    with pytest.raises(ValueError, match=rf"schema version 2 is not supported \(it runs {node['name']} without listing their collectives"):
        Plan.from_json(json.dumps(d))


def test_load_plan_errors(mlp_plans, tmp_path):
    model, x, plan, _ = mlp_plans
    path = tmp_path / "plan.json"
    plan.save(str(path))
    other, ox = mlp(hidden=32)
    with pytest.raises(ValueError, match="made for another model"):
        meshplan.load_plan(str(path), other, (ox,))
    with pytest.raises(ValueError, match="is for 4 devices .* got devices=8"):
        meshplan.load_plan(str(path), model, (x,), devices=8)
    with pytest.raises(ValueError, match=r"is for mesh shape \(2, 2\)"):
        meshplan.load_plan(str(path), model, (x,), devices=(4,))
    d = json.loads(path.read_text())
    d["version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="schema version 1 is not supported; this meshplan reads version 3"):
        meshplan.load_plan(str(tmp_path / "old.json"), model, (x,))
    d["version"] = 2
    d["params"][0]["tensor_map"] = [0, -1] if d["params"][0]["tensor_map"] == [-1, -1] else [-1, -1]
    (tmp_path / "edited.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"params\[0\] .* do not match layout"):
        meshplan.load_plan(str(tmp_path / "edited.json"), model, (x,))
    with pytest.raises(ValueError, match="cannot read plan file"):
        meshplan.load_plan(str(tmp_path / "missing.json"), model, (x,))


# ---------------------------------------------------------------- per-rank code


def test_code_shows_every_planned_collective(mlp_plans):
    model, x, _, _ = mlp_plans
    plan = make(model, x, (2, 2), param_layouts={"layers.0.weight": "RS(0)", "layers.0.bias": "RS(0)", "layers.1.weight": "RS(1)"})
    code = plan.code(3, model=model, example_inputs=(x,))
    assert "rank 3 of mesh dp=2 x tp=2 at (dp=1, tp=1)" in code
    moves = [line for line in code.splitlines() if "self.move_" in line]
    assert moves and len(moves) == sum(1 for t in plan.transfers if t.forward)
    planned = sorted(re.sub(r"ax(\d)", lambda m: plan.mesh.axis_names[int(m.group(1))], str(s)) for t in plan.transfers for s in t.forward)
    shown = sorted(s for line in moves for s in re.findall(r"\w+\((?:dp|tp)[^)]*\)", line.split("#", 1)[1].split("(backward")[0]))
    assert shown == planned
    assert meshplan.plan_code(plan, model, (x,), rank=0) != code  # header names the rank's coordinate


def test_code_errors(mlp_plans):
    model, x, plan, _ = mlp_plans
    with pytest.raises(ValueError, match="needs the model"):
        plan.code(0)
    with pytest.raises(ValueError, match=r"rank=4 is not a rank .* allowed: 0\.\.3"):
        plan.code(4, model=model, example_inputs=(x,))
    other, ox = mlp(hidden=32)
    with pytest.raises(ValueError, match="plan was made for graph"):
        plan.code(0, model=other, example_inputs=(ox,))
