"""The `meshplan` command: its subcommands (`commands.py`), the models they plan (`models.py`: factories and Hugging
Face configs), `meshplan demo` (`demo.py`) and the progress display (`progress.py`). `main` is the installed command's
entry point."""

from meshplan.cli.commands import main

__all__ = ["main"]
