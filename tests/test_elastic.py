"""Elastic training under torchrun's elastic agent: two agents of 2 ranks each (two "nodes") train a GPT at a
fixed global batch; after step 5 one agent and its workers are SIGKILLed, the survivors restart on 2 ranks
under a 2-rank plan from the last checkpoint; after step 10 a new agent joins and training returns to 4 ranks
(the 4-rank plan read from the plan store); the run ends at step 15. Every logged step's loss equals an
uninterrupted 4-rank run's, and the steps redone are at most the checkpoint interval.

The kill and the join are ordered by files the script writes (`--hold-after`: the ranks wait after the step,
checkpoints complete, until released or stopped), never by sleeps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from meshplan.runtime.launch import free_port

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import elastic_agents as ea  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS, KILL_AFTER, JOIN_AFTER, EVERY = 15, 5, 10, 3
RDZV = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=300"


def _reference_losses(work) -> dict[int, float]:
    """An uninterrupted 4-rank run of the same script."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", ea.SCRIPT,
           "--work", str(work), "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
    proc = subprocess.run(cmd, cwd=ea.ROOT, env=ea.env("ref"), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = ea.records(str(work))
    assert [r["world"] for r in records if r.get("event") == "start"] == [4]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_lose_a_node_then_grow_back(tmp_path):
    work = str(tmp_path / "elastic")
    args = ["--work", work, "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
            "--hold-after", str(KILL_AFTER), "--hold-after", str(JOIN_AFTER)]
    port = free_port()
    agents = {}
    logs = {n: open(tmp_path / f"agent_{n}.txt", "w") for n in "abc"}
    try:
        agents["a"] = ea.agent("a", port, RDZV, args, logs["a"], host=True)  # serves the rendezvous store: must survive
        agents["b"] = ea.agent("b", port, RDZV, args, logs["b"], host=False)
        ea.wait_for(work, lambda r: r.get("event") == "held" and r["step"] == KILL_AFTER, agents)
        ea.kill_node(work, "b", agents.pop("b"))
        open(os.path.join(work, f"release_{KILL_AFTER}"), "w").close()
        ea.wait_for(work, lambda r: r.get("event") == "held" and r["step"] == JOIN_AFTER, agents)
        agents["c"] = ea.agent("c", port, RDZV, args, logs["c"], host=False)
        ea.wait_for(work, lambda r: r.get("event") == "start" and r["step"] >= JOIN_AFTER, agents)
        open(os.path.join(work, f"release_{JOIN_AFTER}"), "w").close()
        for name, proc in agents.items():
            assert proc.wait(timeout=400) == 0, f"agent {name} failed: {(tmp_path / f'agent_{name}.txt').read_text()[-4000:]}"
    finally:
        ea.stop_all(work, agents)
        for f in logs.values():
            f.close()
    records = ea.records(work)
    starts = [r for r in records if r.get("event") == "start"]
    # 4 ranks; 2 ranks under a plan made for 2 (accumulating 2 micro-batches of the same global batch), from the
    # checkpoint before the kill; 4 ranks again, from the checkpoint the SIGTERM saved, with the stored 4-rank plan
    assert [(s["world"], s["accumulation"], s["plan_source"], s["step"]) for s in starts] == [
        (4, 1, "planned", 0), (2, 2, "planned", 3), (4, 1, "store", JOIN_AFTER)]
    assert [s["resumed_from"] for s in starts] == ["", "step_000000003", f"step_{JOIN_AFTER:09d}"]
    assert starts[0]["mesh"] == starts[2]["mesh"]
    steps = [(r["world"], r["step"]) for r in records if "loss" in r]
    assert steps == ([(4, s) for s in range(1, KILL_AFTER + 1)] + [(2, s) for s in range(4, JOIN_AFTER + 1)]
                     + [(4, s) for s in range(JOIN_AFTER + 1, STEPS + 1)])
    redone = KILL_AFTER - starts[1]["step"]
    assert 0 < redone <= EVERY
    reference = _reference_losses(tmp_path / "reference")
    assert sorted(reference) == list(range(1, STEPS + 1))
    got = torch.tensor([r["loss"] for r in records if "loss" in r])
    want = torch.tensor([reference[r["step"]] for r in records if "loss" in r])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
