"""Pipeline timelines: when each pipeline rank runs each microbatch's forward, backward and weight backward.

The per-rank action order is the one `torch.distributed.pipelining` runs (`rank_orders`, checked
against torch's own action lists in `tests/test_timeline.py`): GPipe and 1F1B as their
`_step_microbatches` loops run them, the interleaved and zero-bubble schedules as their
`_calculate_single_rank_operations` list them. Each rank runs its list in order; an action starts
when the rank is free and its inputs are there (a forward after the previous stage's forward of the
same microbatch, a backward after the next stage's backward, a weight backward after its own input
backward). Every chunk action takes its share of its rank's per-microbatch seconds, t_f / v, t_b / v or
t_w / v (a full backward t_b + t_w) of the slowest rank, times the rank's own share of the slowest's (`shares`: a
pipeline's first and last stages carry the embedding and the head), as in `schedule_time`, so the timeline is the
schedule `schedule_time` prices: its makespan is `schedule_time(...).step_s`, and with equal ranks every rank
idles `bubble_s`. `schedule_time` takes the step from `makespan` where its closed forms do not hold.

A block's seconds include the stage's point-to-point sends (the planner adds them to the stage's
time); `send_s` only draws the tail of a forward or backward whose output goes to another rank as a
separate `send` block, and moves nothing.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

from meshplan.cost_model.schedule_kinds import check_microbatches, chunks_per_device

KINDS = ("forward", "backward", "weight", "send", "bubble")
"""Block kinds: a chunk's forward, its backward (for inputs, and for weights too outside the zero-bubble
schedules), its weight backward (zero-bubble schedules), the send at the end of a forward or backward,
and a rank's idle time."""

_KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}

Op = tuple[int, str, int]
"""(virtual stage, action, microbatch) with action F (forward), B (full backward), I (backward for inputs), W (for weights)."""


@dataclass(frozen=True, slots=True)
class Block:
    rank: int
    kind: str
    """One of `KINDS`."""
    microbatch: int | None
    """None for a bubble."""
    chunk: int | None
    """The rank's model chunk (0 .. v-1); None for a bubble."""
    stage: int | None
    """Virtual stage index (chunk c of rank r: c * p + r, or under ZB-V's V 2p - 1 - r for c = 1); None for a bubble."""
    start: float
    end: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    schedule: str
    stages: int
    """p: pipeline ranks."""
    microbatches: int
    chunks: int
    """v: model chunks per rank."""
    t_f: float
    t_b: float
    t_w: float
    shares: tuple[float, ...] | None
    """Each rank's seconds as a share of the slowest rank's `t_f`, `t_b`, `t_w` (None: every rank the slowest's)."""
    send_s: float
    rows: tuple[tuple[Block, ...], ...]
    """Per rank, its blocks in time order, bubbles included: together they cover 0 .. `makespan_s`."""
    makespan_s: float
    """First forward to last backward: `schedule_time(...).step_s`."""

    @property
    def bubble_s(self) -> float:
        """Idle seconds of the busiest rank: what the schedule spends beyond the slowest rank's work, as
        `ScheduleCost.bubble_s` (every rank idles the same when all run the slowest rank's times)."""
        return min(self.idle_s(r) for r in range(self.stages))

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def blocks(self) -> tuple[Block, ...]:
        return tuple(b for row in self.rows for b in row)

    def rank(self, r: int) -> tuple[Block, ...]:
        return self.rows[r]

    def idle_s(self, r: int) -> float:
        return sum(b.end - b.start for b in self.rows[r] if b.kind == "bubble")


def stage_rank(stage: int, p: int, schedule: str) -> int:
    """Pipeline rank that runs virtual stage `stage`: round robin, or down and back up the V under ZB-V."""
    if schedule == "zbv":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def rank_orders(schedule: str, p: int, m: int, v: int) -> list[list[Op]]:
    """Each rank's actions in the order torch's schedule class runs them."""
    if schedule == "gpipe":  # ScheduleGPipe._step_microbatches: every forward, then every backward
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    if schedule == "1f1b":  # Schedule1F1B._step_microbatches: p - r forwards, then 1B1F, then the last backwards
        out = []
        for r in range(p):
            warm = min(m, p - r)
            ops: list[Op] = [(r, "F", i) for i in range(warm)]
            ops += [x for i in range(m - warm) for x in ((r, "B", i), (r, "F", warm + i))]
            out.append(ops + [(r, "B", i) for i in range(m - warm, m)])
        return out
    if schedule == "zbv":
        return [_zbv_order(r, p, m) for r in range(p)]
    return [_interleaved_order(r, p, m, v, zero_bubble=schedule == "interleaved_zb") for r in range(p)]


def _interleaved_order(r: int, p: int, m: int, v: int, *, zero_bubble: bool) -> list[Op]:
    """torch's ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (`_get_1f1b_rank_ops`), without its padding."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)  # torch's _get_warmup_ops
    back = "I" if zero_bubble else "B"
    count: dict[tuple[int, str], int] = defaultdict(int)

    def take(stage: int, op: str) -> Op:
        i = count[stage, op]
        count[stage, op] += 1
        return (stage, op, i)

    ops: list[Op] = []
    backward_steps: list[int] = []
    weights = 0
    for step in range(m * v + warm):
        if step < m * v:
            ops.append(take(((step // per_round) % v) * p + r, "F"))
        if step >= warm:
            ops.append(take((v - 1 - ((step - warm) // per_round) % v) * p + r, back))
            backward_steps.append(step)
            if zero_bubble and step - warm >= r:  # the first r backwards keep their weight part for later
                ops.append(take((v - 1 - ((backward_steps[weights] - warm) // per_round) % v) * p + r, "W"))
                weights += 1
    for step in backward_steps[weights:] if zero_bubble else ():
        ops.append(take((v - 1 - ((step - warm) // per_round) % v) * p + r, "W"))
    return ops


def _zbv_order(r: int, p: int, m: int) -> list[Op]:
    """torch's ScheduleZBVZeroBubble._calculate_single_rank_operations: the V's two chunks of rank r are stages r and
    2p - 1 - r; torch plans at least 2p - 1 microbatches and drops the ones beyond m."""
    n = max(2 * p - 1, m)
    s0, s1 = r, 2 * p - 1 - r
    f0 = f1 = b0 = b1 = 0
    ops: list[Op] = []
    for _ in range(2 * (p - r) - 1):
        ops.append((s0, "F", f0))
        f0 += 1
    for _ in range(r):
        ops += [(s1, "F", f1), (s0, "F", f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(p - r):
        ops += [(s1, "F", f1), (s1, "I", b1), (s1, "W", b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append((s0, "F", f0))
            f0 += 1
        ops += [(s0, "I", b0), (s0, "W", b0), (s1, "F", f1), (s1, "I", b1), (s1, "W", b1)]
        b0, b1, f1 = b0 + 1, b1 + 1, f1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops += [(s0, "I", b0), (s1, "I", b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - r):
        ops += [(s0, "I", b0), (s0, "W", w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [(s1, "W", i) for i in range(w1, b1)] + [(s0, "W", i) for i in range(w0, b0)]
    return [op for op in ops if op[2] < m]


def _simulate(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float,
              shares: tuple[float, ...] | None = None) -> tuple[list[list[Op]], dict[Op, tuple[float, float]]]:
    """Start and end of every action: each rank runs its order, an action as soon as the rank and its inputs are ready.
    `shares`: each rank's seconds as a share of the slowest rank's (None: every rank the slowest's)."""
    orders = rank_orders(schedule, p, m, v)
    n_stages = p * v
    back = "I" if schedule in ("interleaved_zb", "zbv") else "B"
    secs = {"F": t_f / v, "B": (t_b + t_w) / v, "I": t_b / v, "W": t_w / v}
    when: dict[Op, tuple[float, float]] = {}
    pos, free = [0] * p, [0.0] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = 0
        for r in range(p):
            ops, k, t = orders[r], pos[r], free[r]
            while k < len(ops):
                s, op, i = ops[k]
                if op == "F":
                    deps = ((s - 1, "F", i),) if s > 0 else ()
                elif op == "W":
                    deps = ((s, back, i),)
                else:
                    deps = ((s, "F", i), (s + 1, back, i)) if s < n_stages - 1 else ((s, "F", i),)
                if any(d not in when for d in deps):
                    break
                start = max([t, *(when[d][1] for d in deps)])
                t = start + secs[op] * (shares[r] if shares else 1.0)
                when[ops[k]] = (start, t)
                k += 1
            moved += k - pos[r]
            pos[r], free[r] = k, t
        if not moved:
            waiting = [o[k] for o, k in zip(orders, pos) if k < len(o)]
            raise RuntimeError(f"the {schedule} order deadlocks at p={p}, m={m}, v={v}: next actions {waiting}")
        left -= moved
    return orders, when


@functools.lru_cache(maxsize=4096)
def _makespan(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float, shares: tuple[float, ...] | None) -> float:
    _, when = _simulate(schedule, p, m, v, t_f, t_b, t_w, shares)
    return max(end for _, end in when.values())


def makespan(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float, *, virtual: int = 2,
             shares: tuple[float, ...] | None = None) -> float:
    """Seconds from the first forward to the last backward of the simulated schedule (cached per time ratio);
    `shares`: each rank's seconds as a share of the slowest rank's `t_f`, `t_b`, `t_w` (None: all the slowest's)."""
    v = chunks_per_device(schedule, virtual)
    check_microbatches(schedule, p, m, v)
    scale = max(t_f, t_b, t_w)
    if scale <= 0:
        return 0.0
    return scale * _makespan(schedule, p, m, v, t_f / scale, t_b / scale, t_w / scale, shares)


def timeline(schedule: str, stages: int, microbatches: int, t_f: float, t_b: float | None = None, t_w: float | None = None, *,
             virtual: int = 2, send_s: float = 0.0, shares: tuple[float, ...] | None = None) -> Timeline:
    """Every rank's blocks (forward, backward, weight, send, bubble) of `schedule` with `stages` ranks and `microbatches`
    microbatches, where the slowest rank spends `t_f` + `t_b` + `t_w` seconds per microbatch (all its chunks) and rank
    r `shares[r]` times that, as `schedule_time` takes them. `send_s`: seconds of one send, drawn at the end of a
    forward (backward) whose activation (gradient) goes to another rank, inside the block's time."""
    t_b = t_f if t_b is None else t_b
    t_w = t_f if t_w is None else t_w
    p, m = stages, microbatches
    v = chunks_per_device(schedule, virtual)
    check_microbatches(schedule, p, m, v)
    orders, when = _simulate(schedule, p, m, v, t_f, t_b, t_w, shares)
    span = max((end for _, end in when.values()), default=0.0)
    n_stages = p * v
    eps = 1e-12 * span
    rows: list[tuple[Block, ...]] = []
    for r, ops in enumerate(orders):
        blocks: list[Block] = []
        t = 0.0
        for s, op, i in ops:
            start, end = when[s, op, i]
            chunk = s // p if schedule != "zbv" else int(s >= p)
            if start - t > eps:
                blocks.append(Block(r, "bubble", None, None, None, t, start))
            peer = s + 1 if op == "F" else s - 1 if op in ("B", "I") else None
            send = min(send_s, end - start) if peer is not None and 0 <= peer < n_stages and stage_rank(peer, p, schedule) != r else 0.0
            if send > 0:
                blocks += [Block(r, _KIND[op], i, chunk, s, start, end - send), Block(r, "send", i, chunk, s, end - send, end)]
            else:
                blocks.append(Block(r, _KIND[op], i, chunk, s, start, end))
            t = end
        if span - t > eps:
            blocks.append(Block(r, "bubble", None, None, None, t, span))
        rows.append(tuple(blocks))
    return Timeline(schedule=schedule, stages=p, microbatches=m, chunks=v, t_f=t_f, t_b=t_b, t_w=t_w, shares=shares, send_s=send_s,
                    rows=tuple(rows), makespan_s=span)
