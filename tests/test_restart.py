"""A lost rank under torchrun: one rank is SIGKILLed mid-step, torchrun restarts the group, the
job reloads its plan from the strategy file (no re-solve) and resumes from the last checkpoint.
The logged (step, loss) sequence has no gap and no repeat and equals an uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_resumable.py")
STEPS, KILL_AT = 6, 4

sys.path.insert(0, os.path.dirname(SCRIPT))
import train_resumable  # noqa: E402


def test_training_survives_a_killed_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", SCRIPT, "--work", str(tmp_path), "--steps", str(STEPS), "--kill-at", str(KILL_AT)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]

    # the first attempt solved and saved the plan; the restart loaded it from the file
    plans = [r for r in records if r.get("event") == "plan"]
    assert [(r["attempt"], r["source"]) for r in plans] == [(0, "solved"), (1, "file")]
    assert plans[0]["hash"] == plans[1]["hash"]
    # the restart resumed from the last complete checkpoint: the step before the kill
    resumes = [r for r in records if r.get("event") == "resume"]
    assert resumes == [{"attempt": 1, "event": "resume", "checkpoint": f"step_{KILL_AT - 1:06d}", "step": KILL_AT - 1}]
    # steps: no gap, no repeat; the kill split them between the attempts
    steps = [(r["attempt"], r["step"]) for r in records if "loss" in r]
    assert [s for _, s in steps] == list(range(1, STEPS + 1))
    assert steps == [(0, s) for s in range(1, KILL_AT)] + [(1, s) for s in range(KILL_AT, STEPS + 1)]
    # and the losses are those of an uninterrupted run
    losses = [r["loss"] for r in records if "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(train_resumable.reference_losses(STEPS)), rtol=1e-4, atol=1e-6)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"step_{STEPS - 1:06d}", f"step_{STEPS:06d}"]
