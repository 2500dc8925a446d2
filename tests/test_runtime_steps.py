"""The runtime's all-gather and reduce-scatter steps give DTensor's results on every tensor dim (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from meshplan.cost_model.redistribution import CommStep
from meshplan.ir.mesh import MeshSpec
from meshplan.runtime.collectives import MeshComm, run_step
from meshplan.runtime.launch import run_local

pytestmark = pytest.mark.multiprocess


def _local(rank: int) -> torch.Tensor:
    return torch.arange(4 * 8 * 4, dtype=torch.float32).view(4, 8, 4) * (rank + 1) + rank


def _steps(rank: int, world: int) -> dict:
    comm = MeshComm(MeshSpec((world,)), rank)
    comm.create_groups([(0,)])
    x = _local(rank)
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        for dim in (0, 1, 2):
            out[kind, dim] = run_step(CommStep(kind, 0, dim), x, comm, "forward")
            assert torch.equal(x, _local(rank)), "the input must not be modified"
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gather_and_scatter_on_every_dim(world):
    results = run_local(world, _steps, timeout=300)
    whole = [_local(r) for r in range(world)]
    total = sum(whole)
    for rank, out in enumerate(results):
        for dim in (0, 1, 2):
            torch.testing.assert_close(out["all_gather", dim], torch.cat(whole, dim=dim), rtol=0, atol=0)
            torch.testing.assert_close(out["reduce_scatter", dim], total.chunk(world, dim=dim)[rank], rtol=0, atol=0)
