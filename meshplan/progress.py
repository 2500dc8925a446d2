"""Phases and timed parts of planning: what every layer reports, with no display of its own.

Library code calls `phase("...")` at the start of each phase: a one-line call, no context to
manage, free when nobody listens (the default for library use). Each phase's duration is logged
at INFO level through `logging` (logger `meshplan.progress`, shown by the CLI's `--verbose`), and
a listener (`listen`) sees each phase as it starts: the CLI's spinner (`cli/progress.py`).
`timed` and `collect` count seconds per part of planning (benchmarks/planning_time.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger("meshplan.progress")

_state: dict = {"listener": None, "phase": None, "since": 0.0}
_seconds: list[dict[str, float]] = []
"""Open `collect()` blocks, innermost last."""

F = TypeVar("F", bound=Callable)


def timed(part: str) -> Callable[[F], F]:
    """Count the decorated function's seconds as `part` of planning in every open `collect()` block."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not _seconds:
                return fn(*args, **kwargs)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                for seconds in _seconds:
                    seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - began

        return run  # type: ignore[return-value]

    return wrap


@contextlib.contextmanager
def collect() -> Iterator[dict[str, float]]:
    """Seconds spent in each `timed` part of planning while the block runs (benchmarks/planning_time.py)."""
    seconds: dict[str, float] = {}
    _seconds.append(seconds)
    try:
        yield seconds
    finally:
        _seconds.remove(seconds)


def phase(description: str) -> None:
    """Mark the start of a phase (ends the previous one)."""
    now = time.perf_counter()
    if _state["phase"] is not None:
        log.info("%s: %.2f s", _state["phase"], now - _state["since"])
    _state["phase"], _state["since"] = description, now
    if _state["listener"] is not None:
        _state["listener"](description)


@contextlib.contextmanager
def listen(listener: Callable[[str], None] | None) -> Iterator[None]:
    """Call `listener(description)` at the start of every phase while the block runs; the last phase ends with it."""
    _state["listener"] = listener
    try:
        yield
    finally:
        phase("done")
        _state.update(listener=None, phase=None)
