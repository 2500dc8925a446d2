"""Progress display for the phases of planning that can take a while (tracing, strategies, solving).

Library code calls `phase("...")` at the start of each phase: a one-line call, no context to
manage, free when progress is off (the default for library use). The CLI turns it on with
`enabled()`, which shows a rich spinner with the current phase and the elapsed time on stderr,
and logs each phase with its duration at INFO level through `logging` (shown by `--verbose`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger("meshplan.progress")

_state: dict = {"progress": None, "task": None, "phase": None, "since": 0.0}
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
    progress = _state["progress"]
    if progress is not None:
        progress.update(_state["task"], description=description)


@contextlib.contextmanager
def enabled(title: str = "planning", *, show: bool = True) -> Iterator[None]:
    """Show phases under `title` while the block runs (a rich live display on stderr when `show`)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = None
    if show:
        progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.fields[title]}[/]"), TextColumn("{task.description}"), TimeElapsedColumn(),
            console=Console(stderr=True), transient=True,
        )
        _state["task"] = progress.add_task("starting", title=title, total=None)
        progress.start()
    _state["progress"] = progress
    try:
        yield
    finally:
        phase("done")
        if progress is not None:
            progress.stop()
        _state.update(progress=None, task=None, phase=None)
