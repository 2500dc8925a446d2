"""No silent hangs: with a short collective timeout, a rank that joins late, skips a collective or
dies makes the other rank raise `CollectiveError` within a bounded time (and the late or skipping
rank errors too when it comes back).

These tests start two forked processes by hand instead of `run_local`, which stops every rank as
soon as one fails: here the point is to see what each surviving rank does on its own.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _parity import build, loss_fn

import meshplan
from meshplan.runtime.launch import free_port

pytestmark = pytest.mark.multiprocess

TIMEOUT = 5.0  # seconds: every collective of the runtime gives up after this
SLACK = 15.0  # the 2-core machine is shared: generous margin on top of TIMEOUT
LATE = TIMEOUT + 3  # how long the misbehaving rank stays away


def _rank_main(rank: int, port: int, scenario: str, plan, out_dir: str) -> None:
    torch.set_num_threads(1)
    # the launcher's own group: long timeout, it only hosts the rendezvous
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    record: dict = {"rank": rank, "error": None}
    start = time.monotonic()
    try:
        model, x, y = build("mlp")
        ready = os.path.join(out_dir, "rank0_ready")
        if scenario == "join_late" and rank == 0:
            open(ready, "w").close()
        if scenario == "join_late" and rank == 1:
            # late relative to rank 0 reaching its first collective, however slow the machine is
            while not os.path.exists(ready):
                time.sleep(0.05)
            time.sleep(LATE)
            start = time.monotonic()
        pmodel = meshplan.auto_parallelize(model, example_inputs=(x,), plan=plan, timeout=TIMEOUT)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
        for step in range(1, 4):
            if scenario == "skip" and rank == 1 and step == 2:
                time.sleep(LATE)  # rank 1 skips step 2's collectives, then carries on with step 3
                continue
            start = time.monotonic()
            opt.zero_grad()
            loss = loss_fn("mlp", pmodel(x), y)
            if scenario == "die" and rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: rank 0 is about to wait for its gradients
            loss.backward()
            opt.step()
        record["steps"] = 3
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        record.update(error=type(e).__name__, message=str(e), is_collective=isinstance(e, meshplan.CollectiveError))
    record["elapsed"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    os._exit(0)  # no clean-up collectives: the peer may be gone


def _run_pair(scenario: str, tmp_path, plan) -> dict[int, dict]:
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, scenario, plan, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"{scenario}: ranks {hung} were still running after 120 s (a hang)"
    records = {}
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        if path.exists():
            records[r] = json.loads(path.read_text())
    return records


@pytest.fixture(scope="module")
def plan():
    model, x, _ = build("mlp")
    return meshplan.plan(model, devices=2, example_inputs=(x,), mode="data_parallel")


def _assert_timed_out(record: dict, what: str) -> None:
    assert record["error"] == "CollectiveError" and record["is_collective"], record
    assert what in record["message"], record["message"]
    assert "another rank died, failed to join, or ran a different sequence of collectives" in record["message"]
    assert record["elapsed"] < TIMEOUT + SLACK, record


def test_rank_that_joins_late(tmp_path, plan):
    records = _run_pair("join_late", tmp_path, plan)
    _assert_timed_out(records[0], "creating the process group for mesh axes (0,) (ranks [0, 1]) failed after waiting at most 5 s")
    assert records[0]["elapsed"] > TIMEOUT * 0.8, "rank 0 should have waited for the timeout"
    assert records[1]["error"] == "CollectiveError", records[1]  # the latecomer finds nobody
    assert records[1]["elapsed"] < TIMEOUT + SLACK


def test_rank_that_skips_a_step(tmp_path, plan):
    records = _run_pair("skip", tmp_path, plan)
    _assert_timed_out(records[0], "failed after waiting at most 5 s")
    assert records[0]["elapsed"] > TIMEOUT * 0.8
    _assert_timed_out(records[1], "failed after waiting at most 5 s")  # its step 3 has no partner


def test_rank_that_dies(tmp_path, plan):
    records = _run_pair("die", tmp_path, plan)
    assert 1 not in records  # SIGKILLed: it wrote nothing
    _assert_timed_out(records[0], "all_reduce over mesh axes ['dp'] failed")  # the gradient all-reduce
