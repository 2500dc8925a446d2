"""benchmarks/step_split.py: the split of the time blocked in collectives into waiting for the last rank and the rest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("step_split", Path(__file__).resolve().parents[1] / "benchmarks" / "step_split.py")
step_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_split)


def test_arrival_split_charges_the_wait_for_the_last_rank_apart_from_the_collective():
    # two ranks, three steps of two collectives each: (entry, exit) on the machine's one clock
    rank0 = [[(0.0, 3.0), (10.0, 11.0)], [(0.0, 2.0), (5.0, 6.0)], [(0.0, 4.0), (5.0, 6.0)]]
    rank1 = [[(2.0, 3.0), (10.5, 11.0)], [(1.0, 2.0), (5.0, 6.0)], [(0.0, 4.0), (5.5, 6.0)]]
    waiting, inside = step_split.arrival_split([rank0, rank1])
    # rank 0 waits 2 + 0.5, 1 + 0, 0 + 0.5 per step (median 1.0); rank 1 never waits
    assert waiting == pytest.approx(1.0)
    # after the last entry, on both ranks: 1 + 0.5, 1 + 1, 4 + 0.5 per step (median 2.0)
    assert inside == pytest.approx(2.0)


def test_arrival_split_refuses_ranks_that_counted_different_collectives():
    with pytest.raises(RuntimeError, match="different collectives in step 0"):
        step_split.arrival_split([[[(0.0, 1.0)]], [[(0.0, 1.0), (2.0, 3.0)]]])
