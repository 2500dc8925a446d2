"""`meshplan validate --quick` / benchmarks/fidelity.py --quick run end to end: calibration with both
profilers, two plans measured on 2 gloo processes, the table and the target lines printed.

The fidelity figures themselves live in the benchmark's output (docs/cost_model.md), not here."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshplan.profiling.fidelity import peak_during, peak_of, spearman

ROOT = Path(__file__).resolve().parents[1]


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="spearman needs"):
        spearman([1], [1])


@pytest.mark.multiprocess
def test_layouts_key_names_the_plan_not_its_prices():
    import meshplan
    from meshplan.cost_model.presets import get_cluster
    from meshplan.cost_model.profile import Profile, torch_version
    from meshplan.profiling.fidelity import FSDP, QUICK_BATCH, SIZES, build, layouts_key

    model, tokens = build(SIZES["tiny"], QUICK_BATCH)
    slower = get_cluster("cpu").with_profile(Profile(device="test-device", torch_version=torch_version(), cluster="cpu",
                                                     op_overhead_s=1e-3, contention={2: 3.0}))
    fsdp, fsdp_slower = (meshplan.plan(model, 2, (tokens,), cluster=c, **FSDP) for c in ("cpu", slower))  # layouts given
    assert fsdp_slower.step_time_s > 2 * fsdp.step_time_s  # priced apart, one plan
    # the same mode solved under the two prices: two plans (the presets keep the activations whole, the slow ops split)
    dp, dp_slower = (meshplan.plan(model, 2, (tokens,), mode="data_parallel", cluster=c) for c in ("cpu", slower))
    assert layouts_key(fsdp) == layouts_key(fsdp_slower) != layouts_key(dp) != layouts_key(dp_slower)
    # what MFU counts is a statement about the plan, not part of what runs
    assert layouts_key(dataclasses.replace(fsdp, model_flops=2 * fsdp.model_flops)) == layouts_key(fsdp)


def test_peak_counts_a_buffer_freed_unrecorded_as_freed_when_its_address_is_reused():
    """gloo lets a finished work's tensors go on its own thread, where the profiler records no free:
    counted as held to the end, one step of a dp x tp plan measured up to 0.56 MiB above another."""
    kib = 1024
    # A at 0x10 (64 KiB), freed on a thread the profiler does not see; B reuses 0x10; C at 0x20 freed
    events = [(1, 0x10, 64 * kib), (2, 0x10, 64 * kib), (3, 0x20, 8 * kib), (4, 0x20, -8 * kib), (5, 0x30, -16 * kib)]
    assert peak_of(events) == 72 * kib  # B and C, not A as well
    assert peak_of([(1, 0x10, 64 * kib), (2, 0x20, 64 * kib)]) == 128 * kib  # no reuse: both held


def test_peak_during_follows_the_steps_allocations():
    def step():
        a = torch.ones(1 << 14)
        b = torch.ones(1 << 14)
        del a, b
        torch.ones(1 << 12)

    assert peak_during(step) == 2 * 4 * (1 << 14)


def test_peak_during_several_runs_keeps_the_lowest():
    calls = []

    def step():  # the first run holds three buffers at once, the later ones two
        held = [torch.ones(1 << 14) for _ in range(3 if not calls else 2)]
        calls.append(len(held))

    assert peak_during(step, runs=3) == 2 * 4 * (1 << 14)
    assert calls == [3, 2, 2]
    with pytest.raises(ValueError, match="runs must be at least 1; got 0"):
        peak_during(step, runs=0)


def test_fidelity_quick_runs(tmp_path):
    prof = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--quick", "--steps", "3", "--save-profile", str(prof)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    assert out.startswith("in sample (calibration)"), out
    rows = re.findall(r"^\| (DP|TP) \| tiny \| 2 \| 2 \| ([0-9.]+) \(([0-9.]+) \+ ([0-9.]+) \+ ([0-9.]+)\) \| ([0-9.]+) \|", out, re.M)
    assert [r[0] for r in rows] == ["DP", "TP"], out
    for _, total, *rest in rows:
        parts = [float(x) for x in rest[:3]]
        assert float(total) == pytest.approx(sum(parts), abs=0.16) and float(rest[3]) > 0
    assert re.search(r"2 plans. Spearman rank correlation of step times: -?[0-9.]+; absolute error: time median", out)
    assert "measuring collectives and contention on 2 local processes again, next to the timed steps" in proc.stderr
    assert len(re.findall(r"\(target [<>]= [0-9.]+\): (met|NOT met)", out)) == 3
    # the calibration wrote a profile with both op timings and collective fits, and it plans
    from meshplan.cost_model.profile import load_profile

    p = load_profile(prof)
    assert p.ops and {f.kind for f in p.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert 2 in p.contention and p.optimizer_steps["adam"][0] > 0
    assert 0 < p.dtensor_view_s < 1e-3, p.dtensor_view_s  # reading a DTensor parameter: tens of us here, not ms
    cli = subprocess.run([sys.executable, "-m", "meshplan", "profile", "show", str(prof)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "collective fits (gloo)" in cli.stdout, cli.stderr


@pytest.mark.multiprocess
def test_fidelity_out_of_sample_plans_from_a_profile_saved_by_another_process(tmp_path):
    prof = tmp_path / "p.json"
    save = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--quick", "--out-of-sample", "--save-profile", str(prof)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert save.returncode == 0 and prof.exists(), save.stderr[-4000:]
    assert "| DP |" not in save.stdout  # saving measures the machine and plans nothing
    png, saved = tmp_path / "fidelity.png", tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--quick", "--out-of-sample", "--profile", str(prof), "--steps", "3",
                           "--plot", str(png), "--save-rows", str(saved)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    assert out.startswith("out of sample: planned from a saved profile, no re-measurement, no rescaling"), out
    rows = re.findall(r"^\| (DP|PP|auto) \| tiny \| 2 \| ([0-9x]+(?: pp 2)?) \| ([0-9.]+) ", out, re.M)
    assert [r[0] for r in rows] == ["DP", "PP", "auto"] and rows[1][1] == "1 pp 2", out
    assert "again" not in proc.stderr and "contention" not in proc.stderr  # nothing measured before planning
    assert re.search(r"3 plans. Spearman rank correlation of step times: -?[0-9.]+; absolute error: time median [0-9.]+%, max", out)
    assert len(re.findall(r"\(target [<>]= [0-9.]+\): (met|NOT met)", out)) == 5  # Spearman, time median and max, memory median and max
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each plan keeps the contention its launches probed, and the load-adjusted diagnostic reads it
    assert all(r["contention"] >= 1.0 for r in json.loads(saved.read_text())), saved.read_text()
    diagnostic = re.findall(r"^diagnostic, not a target: 3 plans' predictions scaled by the contention their launches probed "
                            r"over the calibration's \(2 ranks [0-9.]+ at calibration, [0-9.]+ probed\): Spearman .*$", out, re.M)
    assert len(diagnostic) == 1, out
    # the same measurements priced again from the profile: the same predictions, nothing measured
    again = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--reprice", str(saved), "--profile", str(prof)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.startswith(f"re-priced from {prof}"), again.stdout
    assert _table_rows(again.stdout) == _table_rows(out) and "measuring" not in again.stderr, again.stdout
    assert diagnostic[0] in again.stdout.splitlines(), again.stdout


def _table_rows(text: str) -> list[str]:
    return re.findall(r"^\| (?:DP|PP|auto) \|.*$", text, re.M)
