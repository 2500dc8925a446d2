"""run_local: per-rank results, a working group, errors and hangs reported on the caller."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from meshplan.runtime.launch import free_port, is_torchrun, run_local

pytestmark = pytest.mark.multiprocess


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "sum": t.item() * scale,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]),
        "torchrun": is_torchrun(),
        "threads": torch.get_num_threads(),
        "tensor": torch.full((2,), float(rank)),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_returns_per_rank_values_in_rank_order(world_size: int) -> None:
    out = run_local(world_size, _all_reduce_rank, 2.0, timeout=120)
    expected_sum = 2.0 * sum(range(world_size))
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["sum"] == expected_sum for o in out)
    assert [o["env"] for o in out] == [(str(r), str(world_size), "127.0.0.1") for r in range(world_size)]
    assert all(o["torchrun"] and o["threads"] == 1 for o in out)
    assert torch.equal(out[-1]["tensor"], torch.full((2,), float(world_size - 1)))
    assert not dist.is_initialized()  # the caller's process is untouched


def test_closure_works_with_fork() -> None:
    offset = 10
    assert run_local(2, lambda rank, world: rank + world + offset, timeout=120) == [12, 13]


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("bad shard size 7 on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits on rank 1, which never comes
    return rank


def test_raising_rank_names_rank_and_error() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_local(2, _raise_on_rank_1, timeout=120)
    text = str(info.value)
    assert "rank 1 failed" in text
    assert "ValueError: bad shard size 7 on purpose" in text
    assert "_raise_on_rank_1" in text  # the formatted traceback
    assert time.monotonic() - start < 60


def _sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        while True:
            time.sleep(1)
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank


def test_timeout_is_enforced() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?i)timed out") as info:
        run_local(2, _sleep_on_rank_1, timeout=20)
    elapsed = time.monotonic() - start
    assert elapsed < 35, elapsed
    assert "rank 1" in str(info.value)


def _exit_hard(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def test_crashed_rank_is_reported() -> None:
    with pytest.raises(RuntimeError, match="rank 0 failed:\nprocess exited with code 3"):
        run_local(2, _exit_hard, timeout=60)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_local(0, _exit_hard)
    with pytest.raises(ValueError, match="timeout"):
        run_local(1, _exit_hard, timeout=0)


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
