"""The `meshplan` command: its subcommands (`commands.py`), `meshplan demo` (`demo.py`) and the progress display
(`progress.py`). `main` is the installed command's entry point."""

from meshplan.cli.commands import main

__all__ = ["main"]
