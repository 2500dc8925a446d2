"""Pipeline schedules: how long a step takes and how many microbatches' activations a stage holds.

One model per schedule that `torch.distributed.pipelining` runs. Times are in units of the slowest
stage's per-microbatch work, split as in the zero-bubble papers into forward `t_f`, backward for
inputs `t_b` and backward for weights `t_w` (meshplan's cost model has backward = 2 x forward, so
`t_b = t_w = t_f` unless the caller says otherwise).

Published formulas these follow (p stages, m microbatches, v model chunks per device):

- GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush; Narayanan et al. 2021, sec. 2.2.1):
  step = (m + p - 1) * t, bubble fraction (p - 1) / (m + p - 1). GPipe keeps the activations of all
  m microbatches; 1F1B at most p - s on stage s (p on the first).
- Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2): step = m * t + (p - 1) * t / v, bubble
  fraction (p - 1) / (v * m + p - 1). The first device holds p + (p - 1) / v microbatches' worth
  (Korthikanti et al. 2022, eq. 5: p * (1 + (p - 1) / (p * v))); in general it holds
  `torch`'s warm-up count + 1 chunk-microbatches of 1/v of its layers each.
- Interleaved zero bubble, ZB1P (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1
  interleaved): the weight backward fills the bubble: bubble = (p - 1) * (t_f + t_b - t_w) / v,
  every device holds p microbatches' worth (the paper's p * M_B for ZB-H1).
- ZB-V (same paper, sec. 6; two chunks per device in a V): every device holds p microbatches' worth
  (m >= 2p - 1). The paper's bubble, (p - 1) * max(0, t_f + t_b - 2 t_w) / 2, is zero when t_f = t_b =
  t_w, but the last device cannot start before the first microbatch's forward has passed the p - 1
  chunks above it: torch's order leaves every device idle (p - 1) * t_f / 2, the least any order can.

The step is the makespan of the timeline torch's own action order gives (`meshplan/cost_model/timeline.py`
simulates it); the formulas above are that makespan where they hold: with t_f = t_b = t_w, for every m
under GPipe and 1F1B, for m >= p under the interleaved schedules and m >= 2p - 1 under ZB-V
(`tests/test_timeline.py` checks the equality on a grid). Elsewhere (unequal times, fewer microbatches)
`schedule_time` simulates the timeline.

`tests/test_schedules.py` checks the memory counts against the action lists torch's schedule
classes generate, so the model follows the runtime, not only the papers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.cost_model.schedule_kinds import check_microbatches, check_schedule, chunks_per_device
from meshplan.cost_model.timeline import makespan

SIMULATED_ACTIONS = 4096
"""Devices of unequal speed: schedules of up to this many actions are simulated (about 2 us an action here)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleCost:
    """Predicted step of one pipeline schedule."""

    schedule: str
    stages: int
    """p: devices along the pipeline (each may run several chunks)."""
    microbatches: int
    """m."""
    chunks: int
    """v: model chunks per device."""
    step_s: float
    """Seconds from the first forward to the last backward (no optimizer, no gradient all-reduce)."""
    bubble_s: float
    """Idle seconds of the slowest device within `step_s`."""
    busy_s: float
    """Seconds the devices compute within `step_s`, summed over them (p m t when every device is the slowest)."""

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0


def rank_shares(rank_s: Sequence[float]) -> tuple[float, ...] | None:
    """Each device's seconds per microbatch as a share of the slowest's; None when they are all the slowest's."""
    slowest = max(rank_s, default=0.0)
    if slowest <= 0 or all(x == slowest for x in rank_s):
        return None
    return tuple(x / slowest for x in rank_s)


def schedule_time(schedule: str, stages: int, microbatches: int, t_f: float, t_b: float | None = None, t_w: float | None = None,
                  *, virtual: int = 2, shares: Sequence[float] | None = None) -> ScheduleCost:
    """Step and bubble seconds of `schedule` with `stages` devices and `microbatches` microbatches,
    where the slowest device spends `t_f` + `t_b` + `t_w` seconds per microbatch (all its chunks) and device r
    `shares[r]` times that (`rank_shares`; None: every device the slowest's): the makespan of
    `meshplan.cost_model.timeline.timeline` with the same arguments. With unequal devices the schedule is simulated
    up to `SIMULATED_ACTIONS` actions; beyond, the fill and drain of the equal-device step are scaled to the other
    devices' own times (Alpa's sum of stages + (m - 1) x the slowest: exact for GPipe; for the others at most 1 %
    of the step above the simulation there, on random shares in [0.3, 1] of 4 to 16 devices)."""
    check_schedule(schedule)
    p, m = stages, microbatches
    if not (isinstance(p, int) and p >= 1 and isinstance(m, int) and m >= 1):
        raise ValueError(f"pipeline stages and microbatches must be positive ints; got stages={p!r}, microbatches={m!r}")
    if shares is not None and (len(shares) != p or not all(0 < x <= 1 for x in shares)):
        raise ValueError(f"shares must give each of the {p} devices a share in (0, 1] of the slowest's seconds; got {shares!r}")
    shares = None if shares is None or all(x == 1 for x in shares) else tuple(shares)
    t_b = t_f if t_b is None else t_b
    t_w = t_f if t_w is None else t_w
    t = t_f + t_b + t_w
    v = chunks_per_device(schedule, virtual)
    check_microbatches(schedule, p, m, v)
    busy = m * t * (sum(shares) if shares else p)
    closed = t_f == t_b == t_w and m >= {"interleaved_1f1b": p, "interleaved_zb": p, "zbv": 2 * p - 1}.get(schedule, 1)
    if p == 1:
        bubble = 0.0
    elif shares and (not closed or 2 * p * m * v <= SIMULATED_ACTIONS):
        bubble = max(0.0, makespan(schedule, p, m, t_f, t_b, t_w, virtual=virtual, shares=shares) - m * t)
    elif closed:
        # the timeline's makespan in closed form (equal times; enough microbatches to fill the rounds / the V)
        if schedule in ("gpipe", "1f1b"):
            bubble = (p - 1) * t
        elif schedule == "interleaved_1f1b":
            bubble = (p - 1) * t / v
        elif schedule == "interleaved_zb":
            bubble = (p - 1) * (t_f + t_b - t_w) / v
        else:  # zbv: the last rank waits for microbatch 0 to come down p - 1 chunks
            bubble = (p - 1) * t_f / 2
        if shares:  # too many actions to simulate: the fill and drain at the other devices' own times
            bubble *= (sum(shares) - 1.0) / (p - 1)
    else:
        bubble = max(0.0, makespan(schedule, p, m, t_f, t_b, t_w, virtual=virtual) - m * t)
    return ScheduleCost(schedule=schedule, stages=p, microbatches=m, chunks=v, step_s=m * t + bubble, bubble_s=bubble, busy_s=busy)


def bubble_fraction(schedule: str, stages: int, microbatches: int, *, virtual: int = 2) -> float:
    """Bubble share of the step with t_f = t_b = t_w: (p-1)/(m+p-1) for GPipe and 1F1B,
    (p-1)/(v*m+p-1) for interleaved 1F1B."""
    return schedule_time(schedule, stages, microbatches, 1.0, virtual=virtual).bubble_fraction


def in_flight(schedule: str, stages: int, microbatches: int, stage: int, *, virtual: int = 2) -> float:
    """Microbatches' worth of activations (of all the device's layers) device `stage` holds at its
    peak; multiply by one microbatch's activation bytes for the device's layers."""
    check_schedule(schedule)
    p, m, s = stages, microbatches, stage
    if not 0 <= s < p:
        raise ValueError(f"stage {s!r} is out of range for {p} pipeline stages; allowed 0..{p - 1}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - s))
    if schedule in ("interleaved_zb", "zbv"):
        # the weight backward runs late, so every device keeps p microbatches' worth (ZB paper: p M_B);
        # ZB-V with m < 2p - 1 holds less, and this stays an upper bound there
        return float(min(m, p))
    v = chunks_per_device(schedule, virtual)
    # torch's _get_warmup_ops: forwards before the first backward on this device, +1 for the steady state
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - s), m * v)
    return min(warmup + 1, m * v) / v
