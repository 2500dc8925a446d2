"""The docs' examples run as written.

For each page, the ```python blocks run in order as one script in a fresh process, in a temporary
directory. In docs/cli.md, each ```python block is also written to the file its first comment
names (`# my_models.py`), its ```json block to config.json, and each line of a ```bash block must be
a `meshplan ...` command, run through `meshplan.cli.main` (the installed command's entry point) in
that directory; all must exit 0, and every command has one. Blocks in other languages (```sh,
```text) are not executed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def blocks(page: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (DOCS / page).read_text(), re.S)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


NOT_RUN = re.compile(r"<!-- not runnable: [^>]+ -->\n```python\n")
"""A python block that does not run as written (a fragment of a user's script) says why, just above it."""


def pages_with_python() -> list[str]:
    """Every docs page with python blocks (cli.md has its own test below)."""
    return sorted(p.name for p in DOCS.glob("*.md") if p.name != "cli.md" and blocks(p.name, "python"))


def test_every_python_block_in_the_docs_runs_or_says_why_not():
    assert len(pages_with_python()) >= 9  # all of them run in test_python_blocks_run
    readme = (ROOT / "README.md").read_text()
    assert readme.count("```python\n") == len(NOT_RUN.findall(readme)) > 0, "README.md: mark each python fragment <!-- not runnable: why -->"
    for page in pages_with_python():
        assert not NOT_RUN.search((DOCS / page).read_text()), f"{page}: its python blocks run in tests; drop the not-runnable mark"


LAUNCHES = re.compile(r"\b(run_local|profile_comm)\(")
"""Calls that start local gloo processes: such a page is in the multiprocess lane."""


def _page_param(page: str):
    launches = LAUNCHES.search("\n".join(blocks(page, "python")))
    return pytest.param(page, marks=pytest.mark.multiprocess) if launches else page


@pytest.mark.parametrize("page", [_page_param(p) for p in pages_with_python()])
def test_python_blocks_run(page, tmp_path):
    code = blocks(page, "python")
    assert code, f"{page} has no python examples"
    res = run_python("\n".join(code), tmp_path)
    assert res.returncode == 0, f"{page} examples failed:\n{res.stderr[-3000:]}"


STARTS_PROCESSES = ("meshplan demo", "meshplan validate", "meshplan profile comm")
"""cli.md commands that start local gloo processes: a bash block with one of them is in the multiprocess lane."""


def cli_commands(*, starting_processes: bool) -> list[str]:
    """The `meshplan ...` lines of cli.md's bash blocks that start processes, or of those that do not."""
    chosen = [b for b in blocks("cli.md", "bash") if any(c in b for c in STARTS_PROCESSES) == starting_processes]
    return [line for block in chosen for line in block.splitlines() if line.strip()]


def run_cli_page(commands: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    """Write cli.md's files into `tmp_path` (each python block to the file its first comment names, the json block to
    config.json), run `commands` there through the installed command's entry point, and return their stdout."""
    from meshplan.cli import main

    for code in blocks("cli.md", "python"):
        name = re.match(r"# (\S+\.py)\n", code)
        assert name, "each python block of cli.md starts with the file name it shows"
        (tmp_path / name.group(1)).write_text(code)
    (config,) = blocks("cli.md", "json")
    (tmp_path / "config.json").write_text(config)
    monkeypatch.chdir(tmp_path)
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "meshplan", f"cli.md bash lines must be meshplan commands: {line!r}"
        try:
            rc = main(argv[1:])
        except SystemExit as e:  # --help and --version
            rc = e.code
        assert rc == 0, f"{line!r} failed:\n{capsys.readouterr().err}"
    return capsys.readouterr().out


def test_cli_page_runs(tmp_path, monkeypatch, capsys):
    commands = cli_commands(starting_processes=False)
    assert len(commands) >= 6
    out = run_cli_page(commands, tmp_path, monkeypatch, capsys)
    res = run_python("import my_models, meshplan\nmodel, inputs = my_models.build()\nmeshplan.plan(model, 2, inputs)", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "plan.html").exists() and (tmp_path / "auto.json").exists() and (tmp_path / "llama.json").exists()
    assert "rank 1 of mesh dp=2 x tp=2" in out and "plan not saved, no --out given" in out and re.search(r"^meshplan \S+ \(torch \S+\)$", out, re.M)


@pytest.mark.multiprocess
def test_cli_page_commands_that_start_processes_run(tmp_path, monkeypatch, capsys):
    commands = cli_commands(starting_processes=True)
    out = run_cli_page(commands, tmp_path, monkeypatch, capsys)
    assert (tmp_path / "prof.json").exists() and "PARITY OK" in out


def test_cli_page_shows_every_command():
    from meshplan.cli.commands import build_parser

    def names(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub:
            return [prefix]
        return [n for name, p in sub[0].choices.items() for n in names(p, f"{prefix} {name}")]

    shown = cli_commands(starting_processes=False) + cli_commands(starting_processes=True)
    missing = [c for c in names(build_parser(), "meshplan") if not any(line == c or line.startswith(c + " ") for line in shown)]
    assert not missing, f"docs/cli.md has no example of {missing}"
