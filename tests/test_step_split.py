"""benchmarks/step_split.py: the split of the time blocked in collectives into waiting for the last rank and the rest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("step_split", Path(__file__).resolve().parents[1] / "benchmarks" / "step_split.py")
step_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_split)

WHOLE = (0, ())  # the group of a 1-axis mesh: axis 0, no other coordinates


def test_arrival_split_charges_the_wait_for_the_last_rank_apart_from_the_collective():
    # two ranks, three steps of two collectives each: (entry, exit, group) on the machine's one clock
    rank0 = [[(0.0, 3.0, WHOLE), (10.0, 11.0, WHOLE)], [(0.0, 2.0, WHOLE), (5.0, 6.0, WHOLE)], [(0.0, 4.0, WHOLE), (5.0, 6.0, WHOLE)]]
    rank1 = [[(2.0, 3.0, WHOLE), (10.5, 11.0, WHOLE)], [(1.0, 2.0, WHOLE), (5.0, 6.0, WHOLE)], [(0.0, 4.0, WHOLE), (5.5, 6.0, WHOLE)]]
    waiting, inside = step_split.arrival_split([rank0, rank1])
    # rank 0 waits 2 + 0.5, 1 + 0, 0 + 0.5 per step (median 1.0); rank 1 never waits
    assert waiting == pytest.approx(1.0)
    # after the last entry, on both ranks: 1 + 0.5, 1 + 1, 4 + 0.5 per step (median 2.0)
    assert inside == pytest.approx(2.0)


def test_arrival_split_compares_a_call_only_among_its_group():
    # a 2 x 2 mesh, one all-reduce per step over axis 1: ranks 0 and 1 (coordinate 0 on axis 0) form one group,
    # ranks 2 and 3 the other, which enters 5 s later: nobody waits for the other group
    g0, g1 = (1, (0,)), (1, (1,))
    calls = [[[(0.0, 2.0, g0)]], [[(1.0, 2.0, g0)]], [[(5.0, 7.0, g1)]], [[(5.0, 7.0, g1)]]]
    waiting, inside = step_split.arrival_split(calls)
    assert waiting == pytest.approx(1.0)  # rank 0 for rank 1
    assert inside == pytest.approx(2.0)  # ranks 2 and 3


def test_arrival_split_refuses_a_call_some_of_its_group_did_not_count():
    with pytest.raises(RuntimeError, match="call 1 of group .* was counted by 1 of its 2 ranks"):
        step_split.arrival_split([[[(0.0, 1.0, WHOLE)]], [[(0.0, 1.0, WHOLE), (2.0, 3.0, WHOLE)]]])
