"""The `meshplan` command line, run as `python -m meshplan` in subprocesses (plus fast in-process error cases)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.cli.commands import main, parse_mesh, parse_size
from meshplan.plans.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    # the subprocess must import this checkout's meshplan, whatever is installed
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshplan", *args], cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=600)
    return p.returncode, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of the small MLP (1-D and 2x2 mesh), planned concurrently by the CLI."""
    d = tmp_path_factory.mktemp("cli")
    a = start("plan", "meshplan.models:mlp_small", "--devices", "2", "--out", "a.json", "--verbose", cwd=d)
    b = start(
        "plan", "meshplan.models:mlp_small", "--devices", "4", "--mesh", "2x2", "--cluster", "h100", "--mode", "data_parallel",
        "-o", "b.json", cwd=d,
    )
    return d, finish(a), finish(b)


def test_plan_writes_a_plan_and_prints_it(plans):
    d, (rc, out, err), (rc_b, out_b, _) = plans
    assert rc == 0 and rc_b == 0, err
    a, b = Plan.from_json((d / "a.json").read_text()), Plan.from_json((d / "b.json").read_text())
    assert a.mesh.shape == (2,) and b.mesh.shape == (2, 2) and b.cluster == "h100" and b.mode == "data_parallel"
    assert out.startswith("meshplan plan for MLP on mesh rep=2 (2 devices") and f"plan saved to a.json (hash {a.hash()})" in out
    # --verbose logs each phase with its duration through logging
    for phase in ("meshplan.progress INFO: tracing MLP", "candidate strategies on mesh dp=2", "ilp search on mesh dp=2"):
        assert phase in err


def test_show_explain_diff_report_read_the_plan_file(plans):
    d, *_ = plans
    procs = {
        "show": start("show", "b.json", "--ops", cwd=d),
        "explain": start("explain", "b.json", "layers.1", cwd=d),
        "diff": start("diff", "a.json", "b.json", cwd=d),
        "report": start("report", "b.json", "-o", "b.html", cwd=d),
    }
    res = {k: finish(p) for k, p in procs.items()}
    for k, (rc, _, err) in res.items():
        assert rc == 0, f"{k}: {err}"
    b = Plan.from_json((d / "b.json").read_text())
    assert res["show"][1].rstrip("\n") == b.summary(ops=True)
    assert res["explain"][1].rstrip("\n") == str(b.explain("layers.1"))
    a = Plan.from_json((d / "a.json").read_text())
    assert res["diff"][1].rstrip("\n") == str(a.diff(b)) and "devices: 2 devices = rep 2 -> 4 devices = " in res["diff"][1]
    html = (d / "b.html").read_text()
    assert res["report"][1].strip() == "report written to b.html" and html.startswith("<!DOCTYPE html>") and b.hash() in html


def test_code_prints_the_rank_program(plans):
    d, *_ = plans
    rc, out, err = finish(start("code", "b.json", "meshplan.models:mlp_small", "--rank", "2", cwd=d))
    assert rc == 0, err
    # data parallel with whole outputs for the user: the output is all-gathered over both axes
    assert "rank 2 of mesh dp=2 x tp=2 at (dp=1, tp=0)" in out and "self.move_0(" in out
    assert "all_gather(tp,d0) -> all_gather(dp,d0)" in out


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{}")
    cases = [
        (["show", str(tmp_path / "missing.json")], "cannot read plan file"),
        (["show", str(tmp_path / "bad.json")], "schema version None is not supported"),
        (["plan", "meshplan.models", "--devices", "2", "-o", "x.json"], "expected MODULE:FACTORY"),
        (["plan", "meshplan.models:nope", "--devices", "2", "-o", "x.json"], "has no callable 'nope'"),
        (["plan", "no_such_module_xyz:f", "--devices", "2", "-o", "x.json"], "cannot import module 'no_such_module_xyz'"),
        (["plan", "meshplan.models:MLP", "--devices", "2", "-o", "x.json"], "without an example_inputs() method"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"meshplan {argv[0]}: error: ") and message in err and err.count("\n") == 1, err


def test_memory_budget_reaches_the_planner(tmp_path, capsys):
    argv = ["plan", "meshplan.models:mlp_small", "--devices", "2", "-o", str(tmp_path / "m.json"), "--no-progress"]
    assert main(argv + ["--memory", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan plan: error: memory budget 1.0 KiB per device is infeasible") and err.count("\n") == 1
    assert main(argv + ["--memory", "1GiB"]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["mesh"]["shape"] == [2]


def test_argument_parsers():
    assert parse_mesh("8x8") == (8, 8) and parse_mesh("4") == (4,)
    assert parse_size("80GB") == 80 * 10**9 and parse_size("80GiB") == 80 * 2**30 and parse_size("1.5 kib") == 1536
    for bad in ("8x", "0x2", "ax2"):
        with pytest.raises(Exception, match="not a shape"):
            parse_mesh(bad)
    with pytest.raises(Exception, match="is not understood"):
        parse_size("80 parsecs")
    with pytest.raises(SystemExit):
        main(["plan", "meshplan.models:mlp_small", "--devices", "2", "--mesh", "3y3", "-o", "x.json"])


# ---------------------------------------------------------------- issue 31: check first, answer fast


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # --help, --version and argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_flags_are_checked_before_the_model_is_built(tmp_path, capsys):
    """Each bad flag is named before the factory runs: meshplan.models:MLP would fail on its own (no example_inputs())."""
    argv = ["plan", "meshplan.models:MLP", "--devices", "2", "--no-progress"]
    cases = [
        (["--cluster", "H200x"], "--cluster 'H200x' is not a preset; allowed (any case): a100, cpu, h100, h200"),
        (["--mode", "dataparallel"], "--mode 'dataparallel' is not supported; allowed: auto, data_parallel, semi_auto, manual"),
        (["--inputs", "locall"], "--inputs 'locall' is not supported; allowed: global, local"),
        (["--mixed-precision", "fp16"], "--mixed-precision 'fp16' is not supported; allowed: auto, fp32, bf16"),
        (["--out", str(tmp_path / "missing" / "p.json")], f"directory {tmp_path / 'missing'} does not exist"),
        (["--out", str(tmp_path)], f"--out {str(tmp_path)!r} is a directory"),
    ]
    for flags, message in cases:
        rc, _, err = run_main(argv + flags, capsys)
        assert rc == 2 and err.startswith("meshplan plan: error: ") and message in err and err.count("\n") == 1, (flags, err)


def test_cluster_names_are_case_insensitive_and_listed(tmp_path, capsys):
    rc, out, err = run_main(["plan", "meshplan.models:mlp_small", "--devices", "2", "--cluster", "H100", "-o", str(tmp_path / "p.json"),
                             "--no-progress"], capsys)
    assert rc == 0, err
    assert Plan.from_json((tmp_path / "p.json").read_text()).cluster == "h100"
    rc, out, _ = run_main(["clusters"], capsys)
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip() and not line.startswith("--cluster")}
    assert set(rows) == {"a100", "cpu", "h100", "h200"}
    assert rows["h100"].split()[1:4] == ["H100-SXM5-80GB", "8", "80.0"] and "NVLink4 450 GB/s" in rows["h100"] and "IB-NDR400 50 GB/s" in rows["h100"]


def test_plan_without_out_prints_the_plan_and_says_it_is_not_saved(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(["plan", "meshplan.models:mlp_small", "--devices", "2", "--no-progress"], capsys)
    assert rc == 0, err
    assert out.startswith("meshplan plan for MLP on mesh ") and re.search(r"\nplan not saved, no --out given \(hash [0-9a-f]{16}\)\n$", out)
    assert list(tmp_path.iterdir()) == []


def test_factory_from_a_file_path(tmp_path, capsys, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("WIDTH = 32\n")
    (tmp_path / "sub" / "my_net.py").write_text(
        "import torch\nfrom helper import WIDTH  # a module beside the file\nfrom meshplan.models import MLP\n\n\n"
        "def build():\n    return MLP(WIDTH, 64), (torch.zeros(8, WIDTH),)\n"
    )
    monkeypatch.chdir(tmp_path)
    for target in ("./sub/my_net.py:build", str(tmp_path / "sub" / "my_net.py") + ":build", "sub/my_net.py:build"):
        rc, out, err = run_main(["plan", target, "--devices", "2", "-o", "f.json", "--no-progress"], capsys)
        assert rc == 0 and out.startswith("meshplan plan for MLP on mesh "), (target, err)
    for target, message in (("./sub/my_net:build", "'./sub/my_net' of './sub/my_net:build' is not a module name"),
                            ("./sub/nope.py:build", "no file './sub/nope.py'"), ("./sub/my_net.py:nope", "has no callable 'nope'")):
        rc, _, err = run_main(["plan", target, "--devices", "2", "-o", "f.json"], capsys)
        assert rc == 2 and message in err and err.count("\n") == 1, (target, err)


TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "torch_dtype": "bfloat16",
}


def test_plan_a_hugging_face_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(TINY_LLAMA))
    rc, out, err = run_main(["plan", "--hf", "llama/config.json", "--batch", "2", "--seq", "16", "--devices", "2", "-o", "hf.json",
                             "--no-progress"], capsys)
    assert rc == 0, err
    plan = Plan.from_json((tmp_path / "hf.json").read_text())
    assert plan.model == "LlamaForCausalLM" and out.startswith("meshplan plan for LlamaForCausalLM")
    # built in fp32 whatever the config's torch_dtype (the planner prices mixed precision), with its loss inside
    assert {p.dtype for p in plan.params} == {"float32"} and "aten._log_softmax.default" in {n.target for n in plan.nodes}
    rc, out, err = run_main(["ops", "--hf", "llama", "--batch", "2", "--seq", "16", "--min-share", "0.05"], capsys)  # the directory works too
    assert rc == 0 and "LlamaForCausalLM" in out, err
    (tmp_path / "bad.json").write_text("{not json")
    cases = [
        (["--hf", "missing.json", "--batch", "2", "--seq", "16"], "--hf 'missing.json': no such file"),
        (["--hf", "bad.json", "--batch", "2", "--seq", "16"], "--hf 'bad.json' is not a Hugging Face model config"),
        (["--hf", "llama", "--batch", "2", "--seq", "64"], "--seq 64 exceeds the model's max_position_embeddings 32"),
        (["--hf", "llama", "--batch", "2"], "--hf needs --batch B and --seq S"),
        (["meshplan.models:mlp_small", "--hf", "llama", "--batch", "2", "--seq", "16"], "got both 'meshplan.models:mlp_small' and --hf 'llama'"),
        ([], "give the model as MODULE:FACTORY"),
        (["meshplan.models:mlp_small", "--seq", "16"], "--batch and --seq go with --hf"),
    ]
    for flags, message in cases:
        rc, _, err = run_main(["plan", *flags, "--devices", "2"], capsys)
        assert rc == 2 and message in err and err.count("\n") == 1, (flags, err)


def test_version(capsys):
    from importlib.metadata import version

    rc, out, _ = run_main(["--version"], capsys)
    assert rc == 0 and out == f"meshplan {version('meshplan')} (torch {version('torch')})\n"


def _modules_after(code: str) -> set[str]:
    res = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"], env=env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return set(res.stdout.split("\n")[-2].split())


def test_help_and_version_import_no_torch():
    modules = _modules_after("from meshplan.cli import main\nfor a in ('--help', '--version'):\n"
                             "    try:\n        main([a])\n    except SystemExit as e:\n        assert e.code == 0")
    assert "torch" not in modules and "meshplan.cli.commands" in modules


def test_reading_commands_import_neither_the_planner_nor_the_runtime(plans):
    d, *_ = plans
    modules = _modules_after(f"import os\nos.chdir({str(d)!r})\nfrom meshplan.cli import main\n"
                             "for argv in (['show', 'b.json', '--ops'], ['diff', 'a.json', 'b.json'], ['explain', 'b.json', 'layers.1']):\n"
                             "    assert main(argv) == 0")
    assert "meshplan.plans.plan" in modules and "meshplan.inspect.explain" in modules
    assert not sorted(m for m in modules if m.startswith(("meshplan.planner", "meshplan.runtime", "meshplan.regions")))
