"""The HTML report renders in headless Chromium without console errors (Debian's `chromium` package).

Chromium is required, not optional: .ci/run installs it (`apt-get install -y chromium`); without it
this test fails with that instruction instead of skipping.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import warnings

import pytest
import torch

import meshplan
from meshplan.inspect.summary import grouped_units
from meshplan.models import MLP

# Runs before the report's own script: records uncaught errors and console.error/warn into the DOM,
# which `--dump-dom` then shows (chromium's own stderr logging of console lines is checked too).
HOOK = """<script>
window.__problems = [];
window.addEventListener('error', function (e) { window.__problems.push('error: ' + (e.message || e.type)); }, true);
['error', 'warn'].forEach(function (k) { var f = console[k]; console[k] = function () {
  window.__problems.push(k + ': ' + Array.prototype.join.call(arguments, ' ')); f.apply(console, arguments); }; });
window.addEventListener('load', function () {
  document.documentElement.setAttribute('data-problems', JSON.stringify(window.__problems)); });
</script>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is required for the report test: apt-get install -y chromium (.ci/run does this)")


def run_chromium(*args: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan = meshplan.plan(model, (2, 2), (torch.randn(8, 32),))
    d = tmp_path_factory.mktemp("report")
    return plan, plan.report(str(d / "plan.html"))


def test_report_is_self_contained(report):
    plan, path = report
    text = open(path, encoding="utf-8").read()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "the report must fetch nothing"
    assert "@import" not in text and "url(" not in text
    for section in ("Layers, coloured by placement", "Memory per device", "Pipeline schedule", "Communication volume per mesh axis"):
        assert section in text
    assert "No pipeline stages" in text and "pipeline-timeline" not in text  # this plan has none
    assert text.count('class="layer-row"') == len(grouped_units(plan))
    assert text.count("device ") >= plan.mesh.size  # one memory bar per device


def test_report_renders_in_headless_chromium_without_console_errors(report, tmp_path):
    plan, path = report
    checked = tmp_path / "checked.html"
    checked.write_text(open(path, encoding="utf-8").read().replace("<head>", "<head>" + HOOK, 1), encoding="utf-8")
    dom = run_chromium("--dump-dom", checked.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-rendered="ok"' in dom.stdout, "the report's script did not run to the end"
    problems = re.search(r"data-problems=\"([^\"]*)\"", dom.stdout)
    assert problems is not None, "the load hook did not run"
    assert json.loads(problems.group(1).replace("&quot;", '"')) == []
    assert [line for line in dom.stderr.splitlines() if ":CONSOLE" in line] == []

    shot = tmp_path / "plan.png"
    res = run_chromium("--window-size=1280,1600", f"--screenshot={shot}", "file://" + path)
    assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000  # a blank page compresses to a few KB
    assert [line for line in res.stderr.splitlines() if ":CONSOLE" in line] == []


def test_hook_catches_a_broken_page(tmp_path):
    """The console check can fail: a page with a script error is reported."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><head></head><body><script>console.error('boom'); undefinedCall();</script></body></html>")
    checked = tmp_path / "bad_checked.html"
    checked.write_text(bad.read_text().replace("<head>", "<head>" + HOOK, 1))
    dom = run_chromium("--dump-dom", checked.as_uri())
    problems = json.loads(re.search(r"data-problems=\"([^\"]*)\"", dom.stdout).group(1).replace("&quot;", '"'))
    assert problems[0] == "error: boom" and "undefinedCall" in problems[1]


@pytest.fixture(scope="module")
def pipelined(report, tmp_path_factory):
    """The same plan with a two-stage pipeline section (as `plan(..., pipeline=)` attaches one)."""
    from meshplan.cost_model.memory import MemoryBreakdown
    from meshplan.plans.pipeline import PipelinePlan, PipelineStage

    plan, _ = report
    stages = tuple(
        PipelineStage(index=k, device=k, units=units, modules=(units[0],), time_s=1e-3 * (k + 1), recompute=k == 0,
                      memory=MemoryBreakdown(params=1000 * (k + 1), grads=1000, optimizer=2000, activations=5000 * (2 - k)))
        for k, units in enumerate((("pre", "layers.0"), ("layers.1", "post")))
    )
    # priced as the planner does: each rank at its own stage's 1 or 2 ms per microbatch, 1F1B with p=2, m=4: a 9 ms
    # schedule (the slower rank's 8 ms of work and 1 ms waiting for the first forward); the step adds 2 ms of gradient
    # all-reduce after it
    pipe = PipelinePlan(degree=2, schedule="1f1b", microbatches=4, chunks=1, stages=stages, step_s=0.011, bubble_s=0.001,
                        bubble_fraction=1 / 11, p2p_s=2e-5)
    plan = dataclasses.replace(plan, pipeline=pipe)
    return plan, plan.report(str(tmp_path_factory.mktemp("pipelined") / "plan.html"))


def test_report_of_a_pipelined_plan_shows_its_stages_bubble_and_per_stage_memory(pipelined, tmp_path):
    plan, path = pipelined
    text = open(path, encoding="utf-8").read()
    assert "No pipeline stages" not in text
    assert "2 pipeline ranks x 4 devices each, schedule 1f1b, 4 microbatches" in text
    assert "bubble 9.1% (1.000 ms of a 11.000 ms step)" in text
    assert "bubble 1.000 ms" in text and "working 10.000 ms" in text  # the step bar: the schedule's step, not one microbatch
    assert "stage 0 (pipeline rank 0)" in text and "stage 1 (pipeline rank 1)" in text  # one memory bar per stage
    assert "Peak 13.7 KiB per device" in text  # the fullest rank: stage 0 alone (1000 + 1000 + 2000 + 10000 bytes)
    assert text.count("<td>1f1b</td>") == 0 and text.count("</td><td>yes</td>") == 1
    _renders_cleanly(text, tmp_path)


def _renders_cleanly(text: str, tmp_path) -> None:
    """The report renders in headless Chromium with no console error."""
    checked = tmp_path / "checked.html"
    checked.write_text(text.replace("<head>", "<head>" + HOOK, 1), encoding="utf-8")
    dom = run_chromium("--dump-dom", checked.as_uri())
    assert dom.returncode == 0 and 'data-rendered="ok"' in dom.stdout, dom.stderr[-2000:]
    problems = re.search(r"data-problems=\"([^\"]*)\"", dom.stdout)
    assert problems is not None and json.loads(problems.group(1).replace("&quot;", '"')) == []


def _timeline_rows(text: str) -> dict[int, list[tuple[str, str]]]:
    """Per pipeline rank drawn: the (kind, microbatch label) of its blocks, in order."""
    svg = re.search(r'<svg[^>]*id="pipeline-timeline".*?</svg>', text).group(0)
    rows = {}
    for rank, body in re.findall(r'<g class="timeline-rank" data-rank="(\d+)">(.*?)</g>', svg):
        rows[int(rank)] = re.findall(r'data-kind="(\w+)"><title>rank \d+: (?:\w+ of microbatch (\d+)|idle)', body)
    return rows


def test_report_draws_the_pipeline_schedule_as_a_timeline(pipelined):
    """One row per pipeline rank with the blocks of the schedule that prices the plan (PipelinePlan.timeline()), an
    axis in ms, a legend and the bubble fraction; 1F1B, p=2, m=4 under the fixture's 1 and 2 ms per microbatch."""
    plan, path = pipelined
    text = open(path, encoding="utf-8").read()
    rows = _timeline_rows(text)
    assert sorted(rows) == [0, 1]
    kinds = [[k for k, _ in rows[r] if k not in ("send", "bubble")] for r in (0, 1)]
    assert kinds[0] == ["forward"] * 2 + ["backward", "forward"] * 2 + ["backward"] * 2  # p - r = 2 warm-up forwards
    assert kinds[1] == ["forward", "backward"] * 4
    assert [mb for k, mb in rows[1] if k == "forward"] == ["0", "1", "2", "3"]
    assert sum(k == "send" for r in (0, 1) for k, _ in rows[r]) == 8  # rank 0's four activations, rank 1's four gradients
    assert rows[1][0] == ("bubble", "")  # rank 1 waits for the first forward
    tl = plan.pipeline.timeline()
    assert tl.makespan_s == pytest.approx(0.009) and tl.bubble_s == pytest.approx(plan.pipeline.bubble_s)
    assert "ranks run 1.000 / 2.000 ms per microbatch (their stages' own); schedule 9.000 ms, the busiest rank idle 1.000 ms: bubble 11.1%" in text
    assert "adds 2.000 ms after it (gradient all-reduces)" in text
    assert re.search(r'<text x="[0-9.]+" y="[0-9.]+" text-anchor="middle">8</text>', text)  # the axis: every 2 ms to 8
    for name in ("forward", "backward", "send to the neighbouring rank", "bubble (idle)"):
        assert f"</svg> {name}</span>" in text
    assert "backward for weights" not in text  # 1F1B runs the whole backward at once


def test_report_timeline_of_a_zero_bubble_plan(report, tmp_path):
    """ZB-V on 2 ranks (4 stages in a V): weight-backward blocks, lighter second chunks, the priced step; renders in Chromium."""
    from meshplan.cost_model.memory import MemoryBreakdown
    from meshplan.cost_model.schedules import schedule_time
    from meshplan.plans.pipeline import PipelinePlan, PipelineStage

    plan, _ = report
    mem = MemoryBreakdown(params=1000, grads=1000, optimizer=2000, activations=5000)
    stages = tuple(PipelineStage(index=k, device=(0, 1, 1, 0)[k], units=(f"layers.{k}",), modules=(f"layers.{k}",), time_s=1e-3,
                                 recompute=False, memory=mem) for k in range(4))
    cost = schedule_time("zbv", 2, 4, 2e-3 / 3)
    pipe = PipelinePlan(degree=2, schedule="zbv", microbatches=4, chunks=2, stages=stages, step_s=cost.step_s, bubble_s=cost.bubble_s,
                        bubble_fraction=cost.bubble_fraction, p2p_s=2e-5)
    path = dataclasses.replace(plan, pipeline=pipe).report(str(tmp_path / "zbv.html"))
    text = open(path, encoding="utf-8").read()
    rows = _timeline_rows(text)
    for r in (0, 1):
        kinds = [k for k, _ in rows[r]]
        assert kinds.count("forward") == kinds.count("backward") == kinds.count("weight") == 2 * 4  # 2 chunks x 4 microbatches
    assert 'fill-opacity="0.55"' in text  # the second chunk of the V
    assert f"bubble {cost.bubble_fraction:.1%}" in text and "adds" not in text  # no all-reduce after this schedule
    assert "Peak 17.6 KiB per device" in text  # each rank runs two stages of 9000 bytes: the rank's sum, not one stage
    for name in ("backward for inputs", "backward for weights"):
        assert f"</svg> {name}</span>" in text
    _renders_cleanly(text, tmp_path)
