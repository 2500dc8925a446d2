"""Pipeline schedule models: bubble and activation memory against the published formulas and
against the action lists torch's own schedule classes generate."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as S

from meshplan.cost_model.schedule_kinds import SCHEDULES
from meshplan.cost_model.schedules import bubble_fraction, in_flight, schedule_time

CASES = [(p, m) for p in (1, 2, 4, 8) for m in (1, 4, 8, 32) if m >= p or p == 1] + [(4, 2)]


@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_1f1b_bubble_is_narayanan(p, m):
    for sched in ("gpipe", "1f1b"):
        assert bubble_fraction(sched, p, m) == pytest.approx((p - 1) / (m + p - 1))
        c = schedule_time(sched, p, m, 1.0, 2.0, 3.0)
        assert c.step_s == pytest.approx((m + p - 1) * 6.0)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if m >= p])  # m < p: torch's one short round, simulated (test_timeline.py)
@pytest.mark.parametrize("v", (2, 3, 4))
def test_interleaved_bubble_is_narayanan(p, m, v):
    assert bubble_fraction("interleaved_1f1b", p, m, virtual=v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert bubble_fraction("interleaved_1f1b", p, m, virtual=v) <= bubble_fraction("1f1b", p, m)


def test_zero_bubble_formulas():
    # ZB-H1 interleaved: (p-1)(t_f + t_b - t_w)/v. ZB-V: the paper's (p-1)(t_f + t_b - 2 t_w)/2 is zero when all are
    # equal, but the last rank waits (p-1) t_f/2 for the first forward under torch's order (any order: test_timeline.py)
    c = schedule_time("interleaved_zb", 4, 8, 1.0, 1.0, 1.0, virtual=2)
    assert c.bubble_s == pytest.approx(3 * 1.0 / 2)
    assert schedule_time("zbv", 4, 8, 1.0).bubble_s == pytest.approx(3 * 1.0 / 2)
    assert schedule_time("zbv", 4, 8, 1.0, 2.0, 1.0).bubble_s == pytest.approx(3.0)  # unequal times: the simulated timeline
    for sched in SCHEDULES:
        assert schedule_time(sched, 1, 5, 1.0).bubble_s == 0.0  # one stage never waits


def test_memory_formulas():
    p, m = 4, 16
    assert [in_flight("gpipe", p, m, s) for s in range(p)] == [m] * p
    assert [in_flight("1f1b", p, m, s) for s in range(p)] == [4, 3, 2, 1]
    assert in_flight("1f1b", p, 2, 0) == 2  # never more than there are microbatches
    for v in (2, 4):  # Korthikanti et al. 2022: the first device holds p (1 + (p-1)/(p v))
        assert in_flight("interleaved_1f1b", p, m, 0, virtual=v) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_bad_schedule_names_what_is_allowed():
    with pytest.raises(ValueError, match="allowed: gpipe, 1f1b"):
        bubble_fraction("pipedream", 2, 4)
    with pytest.raises(ValueError, match="stage 4 is out of range"):
        in_flight("1f1b", 4, 8, 4)


def _torch_order(cls, p: int, m: int, v: int) -> dict:
    """The per-rank action list torch computes (the schedule object needs no stages for this)."""
    o = object.__new__(cls)
    o.pp_group_size, o._n_microbatches, o.n_local_stages, o.num_stages = p, m, v, p * v
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    out = {}
    for r in range(p):
        o.rank = r
        out[r] = o._calculate_single_rank_operations(r)
    return out


def _peak(ops, v: int, frees: str) -> float:
    """Most chunk-microbatches whose activations are alive at once (forward done, `frees` not yet)."""
    live = best = 0
    for a in ops:
        if a is None:
            continue
        kind = a.computation_type.value
        live += kind == "F"
        live -= kind == frees
        best = max(best, live)
    return best / v


@pytest.mark.parametrize(
    "cls,name,v,frees",
    [
        (S.ScheduleInterleaved1F1B, "interleaved_1f1b", 2, "B"),
        (S.ScheduleInterleaved1F1B, "interleaved_1f1b", 3, "B"),
        (S.ScheduleInterleavedZeroBubble, "interleaved_zb", 2, "W"),
        (S.ScheduleZBVZeroBubble, "zbv", 2, "W"),
    ],
)
def test_memory_matches_torch_action_lists(cls, name, v, frees):
    for p in (2, 4):
        for m in (p, 2 * p, 3 * p):
            order = _torch_order(cls, p, m, v)
            for r in range(p):
                measured, model = _peak(order[r], v, frees), in_flight(name, p, m, r, virtual=v)
                if name == "zbv" and m < 2 * p - 1:
                    assert measured <= model, (p, m, r)  # an upper bound below torch's 2p - 1 microbatches
                else:
                    assert measured == pytest.approx(model), (name, p, m, r)
