"""Determinism: planning twice gives the same plan, in one process and across processes whose
Python hash seeds differ (set and dict iteration orders must not leak into the plan). Ranks
compare plan hashes before running: tests/test_errors.py::test_ranks_with_different_plans_fail_before_any_step."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from _parity import build, megatron_layouts

import meshplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(name: str, devices: int, **kw):
    model, x, _ = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=devices, example_inputs=(x,), **kw)


@pytest.mark.parametrize("name,devices,kw", [
    ("mlp", 4, {}),  # searches mesh (4,) and (2, 2)
    ("gpt", 2, {}),
    ("mlp", 4, {"mesh_shape": (2, 2), "param_layouts": megatron_layouts("mlp", 2)[0]}),
], ids=["mlp-mesh-search", "gpt-w2", "mlp-2x2-forced"])
def test_planning_twice_gives_the_same_plan(name, devices, kw):
    first, second = _plan(name, devices, **kw), _plan(name, devices, **kw)
    assert first.hash() == second.hash()
    assert first.to_json() == second.to_json(), "the saved plan file is byte-identical (solve time is not in it)"
    assert first == meshplan.Plan.from_json(first.to_json())


_PRINT_HASH = """
import sys, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
from _parity import build
import meshplan
model, x, _ = build("gpt")
print(meshplan.plan(model, devices=4, example_inputs=(x,), mesh_shape=(4,)).hash())
"""


def test_plan_does_not_depend_on_the_hash_seed():
    """This process runs under a random hash seed (pytest does not fix it); the child under seed 1."""
    code = _PRINT_HASH.format(tests=os.path.join(ROOT, "tests"))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": "1", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    here = _plan("gpt", 4, mesh_shape=(4,)).hash()
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == here
