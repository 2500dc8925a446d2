"""planner/collector.py: planning raises the collector's thresholds and gives the caller's back, also when plans
overlap in several threads (the thresholds are the process's)."""

from __future__ import annotations

import gc
import threading

import pytest

from meshplan.planner.collector import PLANNING_THRESHOLDS, fewer_collections


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_planning_thresholds_while_inside_and_the_callers_after(thresholds):
    seen = []
    fewer_collections(lambda: seen.append(gc.get_threshold()))()
    assert seen == [PLANNING_THRESHOLDS] and gc.get_threshold() == (700, 10, 10)
    with pytest.raises(ZeroDivisionError):
        fewer_collections(lambda: 1 / 0)()
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_threads_give_the_callers_thresholds_back(thresholds):
    """Thread A starts planning, B starts, A ends while B still plans, then B ends: B keeps the planning thresholds
    after A ends, and the caller's come back when B ends. (Each call used to put back what it saw when it began: A
    put the caller's back under B, and B, which had seen A's, left the planning thresholds for good.)"""
    a_inside, b_inside, a_done, seen = threading.Event(), threading.Event(), threading.Event(), {}

    def a():
        a_inside.set()
        b_inside.wait(30)

    def b():
        b_inside.set()
        a_done.wait(30)
        seen["b after a"] = gc.get_threshold()

    ta = threading.Thread(target=fewer_collections(a))
    tb = threading.Thread(target=fewer_collections(b))
    ta.start()
    a_inside.wait(30)  # A began first
    tb.start()
    ta.join(30)
    a_done.set()
    tb.join(30)
    assert seen == {"b after a": PLANNING_THRESHOLDS}
    assert gc.get_threshold() == (700, 10, 10)


def test_a_disabled_collector_or_higher_thresholds_are_left(thresholds):
    gc.set_threshold(0)
    assert fewer_collections(gc.get_threshold)()[0] == 0
    gc.set_threshold(50_000, 20, 200)
    assert fewer_collections(gc.get_threshold)() == (50_000, 20, 200)
    assert gc.get_threshold() == (50_000, 20, 200)
