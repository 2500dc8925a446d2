"""The command line's progress display: a rich spinner on stderr with the current phase of planning
(`meshplan.progress.phase`) and the time elapsed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshplan.progress import listen


@contextlib.contextmanager
def enabled(title: str = "planning", *, show: bool = True) -> Iterator[None]:
    """Show phases under `title` while the block runs (a rich live display on stderr when `show`; the phases'
    durations are logged either way)."""
    if not show:
        with listen(None):
            yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        SpinnerColumn(), TextColumn("[bold]{task.fields[title]}[/]"), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    )
    task = progress.add_task("starting", title=title, total=None)
    progress.start()
    try:
        with listen(lambda description: progress.update(task, description=description)):
            yield
    finally:
        progress.stop()
