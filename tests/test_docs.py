"""The docs' examples run as written.

For each page, the ```python blocks run in order as one script in a fresh process, in a temporary
directory. In docs/cli.md, each ```python block is also written to the file its first comment
names (`# my_models.py`), and each line of a ```bash block must be a `meshplan ...` command, run
through `meshplan.cli.main` (the installed command's entry point) in that directory; all must
exit 0. Blocks in other languages (```sh, ```text) are not executed.
"""

from __future__ import annotations

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


def test_cli_page_runs(tmp_path, monkeypatch, capsys):
    from meshplan.cli import main

    for code in blocks("cli.md", "python"):
        name = re.match(r"# (\S+\.py)\n", code)
        assert name, "each python block of cli.md starts with the file name it shows"
        (tmp_path / name.group(1)).write_text(code)
    res = run_python("import my_models, meshplan\nmodel, inputs = my_models.build()\nmeshplan.plan(model, 2, inputs)", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]

    monkeypatch.chdir(tmp_path)
    commands = [line for block in blocks("cli.md", "bash") for line in block.splitlines() if line.strip()]
    assert len(commands) >= 6
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "meshplan", f"cli.md bash lines must be meshplan commands: {line!r}"
        assert main(argv[1:]) == 0, f"{line!r} failed:\n{capsys.readouterr().err}"
    assert (tmp_path / "plan.html").exists() and (tmp_path / "auto.json").exists()
    out = capsys.readouterr().out
    assert "rank 1 of mesh dp=2 x tp=2" in out
