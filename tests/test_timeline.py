"""Pipeline timelines (cost_model/timeline.py): torch's own action order, run with the priced durations, is the
schedule `schedule_time` prices: same makespan, every rank idle for the bubble, dependencies kept."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as S
from test_schedules import _torch_order

from meshplan.cost_model.presets import get_cluster
from meshplan.cost_model.schedule_kinds import SCHEDULES
from meshplan.cost_model.schedules import schedule_time
from meshplan.cost_model.timeline import KINDS, makespan, rank_orders, stage_rank, timeline
from meshplan.planner.pipeline import evaluate
from meshplan.planner.stage_profile import Unit

MiB = 2**20


def microbatch_counts(schedule: str, p: int) -> tuple[int, ...]:
    """Counts torch runs the schedule with: below and at the pipeline depth and whole rounds above it."""
    if schedule == "zbv":
        return (1, p, 2 * p - 1, 2 * p, 3 * p)
    return (1, 2, p, 2 * p, 3 * p) if schedule.startswith("interleaved") else (1, 2, p, p + 1, 2 * p, 3 * p)


GRID = [(s, p, m) for s in SCHEDULES for p in (2, 4) for m in sorted(set(microbatch_counts(s, p)))]
TIMES = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 3.0)]
EPS = 1e-9


@pytest.mark.parametrize(
    "cls,name,v",
    [(S.ScheduleInterleaved1F1B, "interleaved_1f1b", 2), (S.ScheduleInterleaved1F1B, "interleaved_1f1b", 3),
     (S.ScheduleInterleavedZeroBubble, "interleaved_zb", 2), (S.ScheduleInterleavedZeroBubble, "interleaved_zb", 3),
     (S.ScheduleZBVZeroBubble, "zbv", 2)],
)
def test_orders_are_torchs_action_lists(cls, name, v):
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 2):
            if name != "zbv" and m % max(1, m // p):
                continue  # torch refuses counts that are not whole rounds
            theirs = _torch_order(cls, p, m, v)
            if name == "interleaved_zb":  # the class pads its lists with no-ops where an input is late; order unchanged
                o = object.__new__(cls)
                o.pp_group_size, o.pipeline_order = p, theirs
                theirs = o._add_bubbles_to_actions(p * v)
            ours = rank_orders(name, p, m, v)
            for r in range(p):
                assert ours[r] == [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in theirs[r] if a is not None], (p, m, r)


@pytest.mark.parametrize("cls,name", [(S.ScheduleGPipe, "gpipe"), (S.Schedule1F1B, "1f1b")])
def test_single_stage_orders_are_torchs(cls, name):
    """GPipe and 1F1B run their `_step_microbatches` loops; their `_get_pipeline_order` lists the same order, except that
    torch's 1F1B list numbers the last rank's forwards from 1 (its counter is incremented before its first use)."""
    for p, m in ((2, 4), (3, 7), (4, 4), (4, 8)):
        o = object.__new__(cls)
        o._num_stages, o._n_microbatches = p, m
        theirs = o._get_pipeline_order()
        ours = rank_orders(name, p, m, 1)
        for r in range(p if name == "gpipe" else p - 1):
            assert ours[r] == [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in theirs[r]
                               if a is not None and a.computation_type.value in ("F", "B")], (p, m, r)


@pytest.mark.parametrize("schedule,p,m", GRID)
def test_timeline_makespan_is_the_priced_step_and_idle_the_bubble(schedule, p, m):
    for times in TIMES:
        tl = timeline(schedule, p, m, *times, send_s=0.05)
        priced = schedule_time(schedule, p, m, *times)
        assert tl.makespan_s == pytest.approx(priced.step_s, rel=1e-12), times
        for r in range(p):
            assert tl.idle_s(r) == pytest.approx(priced.bubble_s, rel=1e-9, abs=1e-12), (times, r)
        assert tl.bubble_fraction == pytest.approx(priced.bubble_fraction, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("schedule,p,m", GRID)
def test_blocks_are_a_schedule_that_keeps_every_dependency(schedule, p, m):
    zero_bubble = schedule in ("interleaved_zb", "zbv")
    for times in TIMES[:2]:
        tl = timeline(schedule, p, m, *times, send_s=0.05)
        v = tl.chunks
        assert {b.kind for b in tl.blocks} <= set(KINDS)
        done: dict[tuple[str, int, int], tuple[float, float]] = {}  # (kind, stage, microbatch) -> start, end incl. its send
        for r in range(p):
            blocks = tl.rank(r)
            assert blocks[0].start == 0.0 and blocks[-1].end == pytest.approx(tl.makespan_s)
            for a, b in zip(blocks, blocks[1:]):  # no overlap, no gap: work, sends and bubbles tile the step
                assert b.start == pytest.approx(a.end, abs=EPS) and b.end > b.start
            prev = None
            for b in blocks:
                if b.kind == "send":  # a send ends the forward or backward it belongs to, towards another rank
                    assert prev.kind in ("forward", "backward") and (prev.stage, prev.microbatch) == (b.stage, b.microbatch)
                    assert stage_rank(b.stage + 1 if prev.kind == "forward" else b.stage - 1, p, schedule) != r
                    done[prev.kind, b.stage, b.microbatch] = (done[prev.kind, b.stage, b.microbatch][0], b.end)
                elif b.kind != "bubble":
                    assert stage_rank(b.stage, p, schedule) == r and (b.kind, b.stage, b.microbatch) not in done
                    assert b.chunk == (b.stage // p if schedule != "zbv" else int(b.stage >= p))
                    done[b.kind, b.stage, b.microbatch] = (b.start, b.end)
                prev = b
        kinds = ("forward", "backward", "weight") if zero_bubble else ("forward", "backward")
        assert sorted(done) == sorted((k, s, i) for k in kinds for s in range(p * v) for i in range(m))
        for s in range(p * v):
            for i in range(m):
                f, b = done["forward", s, i], done["backward", s, i]
                assert f[1] <= b[0] + EPS  # a microbatch's forward precedes its backward on the stage
                if s > 0:  # the next stage's forward starts after this one's forward and its send
                    assert done["forward", s - 1, i][1] <= f[0] + EPS
                if s < p * v - 1:  # and a backward after the next stage's backward and its send
                    assert done["backward", s + 1, i][1] <= b[0] + EPS
                if zero_bubble:
                    assert b[1] <= done["weight", s, i][0] + EPS


def test_closed_forms_are_the_simulated_makespan_where_schedule_time_uses_them():
    """With t_f = t_b = t_w, `schedule_time`'s formulas equal the simulated timeline (`makespan` always simulates):
    every m under GPipe / 1F1B, whole rounds of m >= p interleaved, m >= 2p - 1 under ZB-V."""
    for p in (2, 3, 4, 6, 8):
        for m in range(1, 4 * p + 1):
            for schedule in SCHEDULES:
                for v in (2, 3) if schedule.startswith("interleaved") else (2,):
                    if schedule.startswith("interleaved") and (m < p or m % (m // p)):
                        continue
                    if schedule == "zbv" and m < 2 * p - 1:
                        continue
                    assert schedule_time(schedule, p, m, 0.25, virtual=v).step_s == pytest.approx(
                        makespan(schedule, p, m, 0.25, 0.25, 0.25, virtual=v), rel=1e-12), (schedule, p, m, v)


def test_zbv_bubble_is_the_last_ranks_wait_for_the_first_forward():
    """ZB-V's last rank runs stages p - 1 and p: it cannot start before microbatch 0's forward has passed the p - 1
    chunks above it, (p - 1) t_f / 2 (the paper's zero bubble at t_f = t_b = t_w leaves this out); torch's order
    leaves no more idle than that on any rank."""
    for p in (2, 4, 8):
        tl = timeline("zbv", p, 2 * p, 1.0)
        first = next(b for b in tl.rank(p - 1) if b.kind != "bubble")
        assert first.start == pytest.approx((p - 1) * 0.5)
        assert tl.bubble_s == pytest.approx((p - 1) * 0.5) == schedule_time("zbv", p, 2 * p, 1.0).bubble_s
    assert schedule_time("zbv", 4, 4, 1.0).bubble_s == pytest.approx(3.0)  # fewer than 2p - 1: simulated, more idle


def test_interleaved_with_fewer_microbatches_than_ranks_is_simulated():
    """Narayanan's (p - 1) t / v needs m >= p; torch runs m < p as one short round and the priced step is its timeline."""
    c = schedule_time("interleaved_1f1b", 4, 2, 1.0)
    assert c.bubble_s > 3 * 3.0 / 2
    assert c.step_s == pytest.approx(timeline("interleaved_1f1b", 4, 2, 1.0).makespan_s)
    with pytest.raises(ValueError, match="multiple of its rounds"):
        schedule_time("interleaved_1f1b", 4, 9, 1.0)  # torch refuses 9 microbatches in rounds of 2


def _units(n_layers: int) -> list[Unit]:
    def u(name, t, a):
        return Unit(name=name, modules=(name,), time_s=t, forward_s=t / 3, sync_s=0.0, static_bytes=4 * MiB, param_bytes=MiB,
                    grad_bytes=MiB, act_bytes=a, out_bytes=MiB, in_bytes=MiB, shared={})
    return [u("pre", 0.5e-3, MiB), *[u(f"layers.{k}", 1e-3, 10 * MiB) for k in range(n_layers)], u("post", 0.5e-3, MiB)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_planned_pipelines_timeline_is_its_priced_schedule(schedule):
    """`PipelinePlan.timeline()` rebuilds the planner's schedule from the plan: its makespan is the plan's step (no
    data parallelism here, so nothing is added after the schedule) and its idle time the plan's bubble."""
    p, m = 4, 8
    pipe = evaluate(_units(16), p=p, d=1, t=1, m=m, schedule=schedule, cluster=get_cluster("h100"), budget=1e12, dp_in_profile=True)
    tl = pipe.timeline()
    assert (tl.schedule, tl.stages, tl.microbatches, tl.chunks) == (schedule, p, m, pipe.chunks)
    assert tl.makespan_s == pytest.approx(pipe.step_s, rel=1e-12)
    assert tl.bubble_s == pytest.approx(pipe.bubble_s, rel=1e-9)
    assert tl.send_s == pipe.p2p_s / 2 > 0 and any(b.kind == "send" for b in tl.blocks)


def test_ranks_of_unequal_speed_fill_and_drain_at_their_own_times():
    """A pipeline's first and last stages carry the embedding and the head: each rank runs its own seconds (`shares`).
    One microbatch through GPipe is the ranks' sum, not p times the slowest; the timeline is the priced schedule;
    beyond `SIMULATED_ACTIONS` the closed form (Alpa's sum of stages + (m - 1) x the slowest) is the simulation
    for GPipe and at most 1 % of the step above it for 1F1B."""
    from meshplan.cost_model.schedules import SIMULATED_ACTIONS, rank_shares

    assert rank_shares([1.0, 2.0]) == (0.5, 1.0) and rank_shares([2.0, 2.0]) is None
    one = schedule_time("gpipe", 2, 1, 1.0, shares=(0.5, 1.0))  # the slower rank's 3 s, the other's 1.5
    assert one.step_s == pytest.approx(4.5) and one.bubble_s == pytest.approx(1.5) and one.busy_s == pytest.approx(4.5)
    small = schedule_time("1f1b", 3, 4, 1.0, shares=(1.0, 0.5, 0.8))
    assert small.step_s == pytest.approx(timeline("1f1b", 3, 4, 1.0, shares=(1.0, 0.5, 0.8)).makespan_s)
    shares = (0.6, 1.0, 0.7, 0.9, 0.5, 0.8, 0.75, 0.65)
    m = SIMULATED_ACTIONS // (2 * len(shares)) + 8  # beyond the simulated size
    for schedule, room in (("gpipe", 0.0), ("1f1b", 0.01)):
        closed = schedule_time(schedule, len(shares), m, 1.0, shares=shares)
        simulated = makespan(schedule, len(shares), m, 1.0, 1.0, 1.0, shares=shares)
        assert closed.step_s == pytest.approx(m * 3.0 + (sum(shares) - 1.0) * 3.0)
        assert simulated - 1e-9 <= closed.step_s <= simulated * (1 + room) + 1e-9
    with pytest.raises(ValueError, match="shares must give each of the 2 devices"):
        schedule_time("gpipe", 2, 1, 1.0, shares=(0.5,))
