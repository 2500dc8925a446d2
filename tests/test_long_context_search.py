"""benchmarks/long_context.py --longest: the length search and the plan without sequence sharding."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

import meshplan
import meshplan.planner.planner as planner
from meshplan.cost_model.presets import get_cluster
from meshplan.ir.trace import trace

_spec = importlib.util.spec_from_file_location("long_context", Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py")
long_context = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_context)


def test_longest_fitting_doubles_then_bisects_to_the_granule():
    limits = {"a": 5000, "b": 1100, "c": 100, "d": 10**9}  # c fits nowhere, d everywhere up to the limit
    asked: list[dict[str, int]] = []

    def fits(todo: dict[str, int]) -> dict[str, bool]:
        asked.append(dict(todo))
        return {k: n <= limits[k] for k, n in todo.items()}

    found = long_context.longest_fitting(fits, tuple(limits), start=1024, granule=256, limit=16384)
    assert found == {"a": (4864, 5120), "b": (1024, 1280), "c": (0, 256), "d": (16384, None)}
    assert all(n % 256 == 0 and n <= 16384 for todo in asked for n in todo.values())
    assert asked[0] == {k: 1024 for k in limits}  # every kind in one round
    assert len({(k, n) for todo in asked for k, n in todo.items()}) == sum(map(len, asked))  # nothing asked twice


def test_longest_fitting_rejects_a_start_off_the_granule():
    with pytest.raises(ValueError, match="multiple of granule"):
        long_context.longest_fitting(lambda todo: {}, ("a",), start=1000, granule=256, limit=4096)


def test_the_plan_without_sequence_sharding_splits_no_sequence_dim():
    seq, cluster = 256, get_cluster("cpu")  # at 256 tokens the default call splits the sequence (dp=2 x tp=2)
    model, tokens = long_context.build(seq)
    graph = trace(model, (tokens,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = meshplan.plan(model, 4, (tokens,), cluster=cluster)
        plain = long_context.plan_longest("no sequence sharding", seq, 4, cluster)
    assert long_context.sequence_splits(default, graph, seq)  # so the restriction has something to remove
    assert long_context.sequence_splits(plain, graph, seq) == []
    assert plain.mesh.size == 4 and "cp" not in plain.mesh.axis_names
    assert planner.generate.__module__ == "meshplan.planner.strategies"  # the restriction ends with the call
