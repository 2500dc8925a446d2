"""The plan loader on hostile input: random bytes, random JSON, valid plans with fields deleted or
of the wrong type. It returns a Plan that works or raises ValueError, never anything else."""

from __future__ import annotations

import copy
import functools
import json
import re
import warnings

import pytest
from _parity import build, megatron_layouts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshplan
from meshplan.plans.plan import SCHEMA_VERSION, Plan

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@functools.cache
def valid_plan() -> Plan:
    model, x, _ = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        params, inputs = megatron_layouts("mlp", 2)  # forced tensor parallelism: the plan has transfers
        return meshplan.plan(model, devices=4, example_inputs=(x,), mesh_shape=(2, 2), param_layouts=params, input_layouts=inputs)


def _paths(obj, prefix=()):
    """Every (path) into the JSON tree of a plan, containers included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _load(text):
    """The property: a working Plan or a ValueError."""
    try:
        plan = Plan.from_json(text)
    except ValueError as e:
        assert str(e), "the error must say what is wrong"
        return None
    plan.hash()  # a plan that loads must be usable
    str(plan)
    return plan


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data):
    _load(data)


@FUZZ
@given(json_values)
def test_random_json(value):
    assert _load(json.dumps(value)) is None


@FUZZ
@given(st.data())
def test_valid_plan_with_a_field_deleted_or_replaced(data):
    d = valid_plan().to_dict()
    paths = [p for p in _paths(d) if p]
    path = data.draw(st.sampled_from(paths), label="path")
    parent = functools.reduce(lambda o, k: o[k], path[:-1], d)
    if data.draw(st.booleans(), label="delete"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values, label="value")
    _load(json.dumps(d))


@FUZZ
@given(st.data())
def test_valid_plan_text_truncated_or_flipped(data):
    text = valid_plan().to_json()
    cut = data.draw(st.integers(0, len(text) - 1), label="cut")
    if data.draw(st.booleans(), label="truncate"):
        assert _load(text[:cut]) is None
    else:
        _load(text[:cut] + data.draw(st.characters(), label="char") + text[cut + 1 :])


def test_the_valid_plan_round_trips():
    plan = valid_plan()
    assert plan.transfers and plan.nodes and plan.params
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json().encode()) == plan


def _first_step(d: dict) -> dict:
    """The first communication step of the first transfer that has one."""
    return next(t for t in d["transfers"] if t["forward"])["forward"][0]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.pop("mesh"), "plan file is malformed: missing field 'mesh'"),
        (lambda d: d["nodes"][1].update(time_s="fast"), "plan file is malformed: nodes[1].time_s is 'fast'; expected a number"),
        (lambda d: d["params"][0].update(fqns="layers.0.weight"), "plan file is malformed: TypeError: expected a list, got 'layers.0.weight'"),
        (lambda d: d["inputs"][0].update(layout="S(0)"), "plan file is malformed: inputs[0].layout has 1 placements for a 2-axis mesh"),
        (lambda d: d["inputs"][0].update(layout="S(5)R"), "plan file is malformed: inputs[0].layout shards tensor dim 5 of a 2-dim tensor"),
        (lambda d: d["params"][0].update(layout="S(0)R"), "plan file is malformed: params[0] (layers.0.weight) device_matrix [2, 2] / tensor_map"),
        (lambda d: _first_step(d).update(axis=7), "].forward[0].axis names mesh axis 7; the mesh has axes 0..1"),
        (lambda d: _first_step(d).update(kind="broadcast"), "].forward[0].kind is 'broadcast'; allowed: all_gather"),
        (lambda d: d["mesh"].update(shape=[2, "2"]), "plan file is malformed: ValueError: mesh shape"),
        (lambda d: d.update(version=999), f"plan schema version 999 is not supported; this meshplan reads version {SCHEMA_VERSION}"),
    ],
    ids=["deleted-key", "wrong-type", "string-for-list", "layout-rank", "shard-dim", "tensor-map", "mesh-axis", "step-kind", "mesh-shape", "schema"],
)
def test_corrupted_plan_names_the_field(mutate, message):
    d = copy.deepcopy(valid_plan().to_dict())
    mutate(d)
    with pytest.raises(ValueError, match=re.escape(message)):
        Plan.from_json(json.dumps(d))


def test_truncated_plan_is_not_json():
    with pytest.raises(ValueError, match="plan file is not valid JSON: JSONDecodeError"):
        Plan.from_json(valid_plan().to_json()[:100])
    with pytest.raises(ValueError, match="a plan is read from JSON text; got dict"):
        Plan.from_json(valid_plan().to_dict())
