"""The `meshplan` command line, run as `python -m meshplan` in subprocesses (plus fast in-process error cases)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.cli.commands import main, parse_mesh, parse_size
from meshplan.plans.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    # the subprocess must import this checkout's meshplan, whatever is installed
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshplan", *args], cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=600)
    return p.returncode, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of the small MLP (1-D and 2x2 mesh), planned concurrently by the CLI."""
    d = tmp_path_factory.mktemp("cli")
    a = start("plan", "meshplan.models:mlp_small", "--devices", "2", "--out", "a.json", "--verbose", cwd=d)
    b = start(
        "plan", "meshplan.models:mlp_small", "--devices", "4", "--mesh", "2x2", "--cluster", "h100", "--mode", "data_parallel",
        "-o", "b.json", cwd=d,
    )
    return d, finish(a), finish(b)


def test_plan_writes_a_plan_and_prints_it(plans):
    d, (rc, out, err), (rc_b, out_b, _) = plans
    assert rc == 0 and rc_b == 0, err
    a, b = Plan.from_json((d / "a.json").read_text()), Plan.from_json((d / "b.json").read_text())
    assert a.mesh.shape == (2,) and b.mesh.shape == (2, 2) and b.cluster == "h100" and b.mode == "data_parallel"
    assert out.startswith("meshplan plan for MLP on mesh rep=2 (2 devices") and f"plan saved to a.json (hash {a.hash()})" in out
    # --verbose logs each phase with its duration through logging
    for phase in ("meshplan.progress INFO: tracing MLP", "candidate strategies on mesh dp=2", "ilp search on mesh dp=2"):
        assert phase in err


def test_show_explain_diff_report_read_the_plan_file(plans):
    d, *_ = plans
    procs = {
        "show": start("show", "b.json", "--ops", cwd=d),
        "explain": start("explain", "b.json", "layers.1", cwd=d),
        "diff": start("diff", "a.json", "b.json", cwd=d),
        "report": start("report", "b.json", "-o", "b.html", cwd=d),
    }
    res = {k: finish(p) for k, p in procs.items()}
    for k, (rc, _, err) in res.items():
        assert rc == 0, f"{k}: {err}"
    b = Plan.from_json((d / "b.json").read_text())
    assert res["show"][1].rstrip("\n") == b.summary(ops=True)
    assert res["explain"][1].rstrip("\n") == str(b.explain("layers.1"))
    a = Plan.from_json((d / "a.json").read_text())
    assert res["diff"][1].rstrip("\n") == str(a.diff(b)) and "devices: 2 devices = rep 2 -> 4 devices = " in res["diff"][1]
    html = (d / "b.html").read_text()
    assert res["report"][1].strip() == "report written to b.html" and html.startswith("<!DOCTYPE html>") and b.hash() in html


def test_code_prints_the_rank_program(plans):
    d, *_ = plans
    rc, out, err = finish(start("code", "b.json", "meshplan.models:mlp_small", "--rank", "2", cwd=d))
    assert rc == 0, err
    # data parallel with whole outputs for the user: the output is all-gathered over both axes
    assert "rank 2 of mesh dp=2 x tp=2 at (dp=1, tp=0)" in out and "self.move_0(" in out
    assert "all_gather(tp,d0) -> all_gather(dp,d0)" in out


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{}")
    cases = [
        (["show", str(tmp_path / "missing.json")], "cannot read plan file"),
        (["show", str(tmp_path / "bad.json")], "schema version None is not supported"),
        (["plan", "meshplan.models", "--devices", "2", "-o", "x.json"], "expected MODULE:FACTORY"),
        (["plan", "meshplan.models:nope", "--devices", "2", "-o", "x.json"], "has no callable 'nope'"),
        (["plan", "no_such_module_xyz:f", "--devices", "2", "-o", "x.json"], "cannot import module 'no_such_module_xyz'"),
        (["plan", "meshplan.models:MLP", "--devices", "2", "-o", "x.json"], "without an example_inputs() method"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"meshplan {argv[0]}: error: ") and message in err and err.count("\n") == 1, err


def test_memory_budget_reaches_the_planner(tmp_path, capsys):
    argv = ["plan", "meshplan.models:mlp_small", "--devices", "2", "-o", str(tmp_path / "m.json"), "--no-progress"]
    assert main(argv + ["--memory", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan plan: error: memory budget 1.0 KiB per device is infeasible") and err.count("\n") == 1
    assert main(argv + ["--memory", "1GiB"]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["mesh"]["shape"] == [2]


def test_argument_parsers():
    assert parse_mesh("8x8") == (8, 8) and parse_mesh("4") == (4,)
    assert parse_size("80GB") == 80 * 10**9 and parse_size("80GiB") == 80 * 2**30 and parse_size("1.5 kib") == 1536
    for bad in ("8x", "0x2", "ax2"):
        with pytest.raises(Exception, match="not a shape"):
            parse_mesh(bad)
    with pytest.raises(Exception, match="is not understood"):
        parse_size("80 parsecs")
    with pytest.raises(SystemExit):
        main(["plan", "meshplan.models:mlp_small", "--devices", "2", "--mesh", "3y3", "-o", "x.json"])
