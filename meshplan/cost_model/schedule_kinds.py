"""The pipeline schedules meshplan plans for and runs: their names, torch's classes, and the shape rules each
imposes (chunks per device, microbatch counts). Their costs are `schedules.py`; their timelines `timeline.py`."""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
"""Schedule names meshplan plans for, in the order it prefers them on a tie."""

TORCH_SCHEDULE_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""The `torch.distributed.pipelining` class that runs each schedule."""


def actions_per_microbatch(schedule: str) -> int:
    """Actions one stage runs per microbatch: forward and backward, or under the zero-bubble schedules
    forward, backward for inputs and backward for weights."""
    check_schedule(schedule)
    return 3 if schedule in ("interleaved_zb", "zbv") else 2


def check_microbatches(schedule: str, stages: int, microbatches: int, chunks: int) -> None:
    """torch's interleaved schedules split the m microbatches into max(1, m // p) equal rounds."""
    rounds = max(1, microbatches // stages)
    if chunks > 1 and schedule != "zbv" and microbatches % rounds:
        raise ValueError(f"the {schedule} schedule needs the microbatches ({microbatches}) to be a multiple of its rounds "
                         f"max(1, m // p) = {rounds} with p = {stages} (torch's {TORCH_SCHEDULE_CLASS[schedule]})")


def check_schedule(name: str) -> str:
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not supported; allowed: {', '.join(SCHEDULES)}")
    return name


def chunks_per_device(schedule: str, virtual: int = 2) -> int:
    """Model chunks (virtual stages) each device runs: 1, `virtual` for interleaved schedules, 2 for ZB-V."""
    check_schedule(schedule)
    if schedule in ("gpipe", "1f1b"):
        return 1
    if schedule == "zbv":
        return 2
    if virtual < 2:
        raise ValueError(f"an interleaved schedule needs virtual >= 2 chunks per device; got {virtual}")
    return virtual
