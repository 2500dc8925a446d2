"""The reading methods of `Plan`: `summary()`, `str()`, `explain()`, `diff()`, `code()` and `report()`.

A plan is data (`meshplan/plans`); presenting it takes this layer, rich, and for `code()` the
runtime's rewrite. So the methods live here, and `meshplan/__init__.py`, which sits above both
packages, attaches them to the class (`attach_reading_methods`). Importing any part of meshplan
runs that package first, so every Plan has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.inspect.diff import PlanDiff, diff_plans
from meshplan.inspect.explain import Explanation, explain as explain_plan
from meshplan.inspect.report import write_report
from meshplan.inspect.summary import format_summary

if TYPE_CHECKING:
    from meshplan.plans.plan import Plan


def summary(self: Plan, *, ops: bool = False) -> str:
    """Mesh, per-layer layouts and collectives, time and memory split (`ops=True` adds every costly op)."""
    return format_summary(self, ops=ops)


def explain(self: Plan, query: str) -> Explanation:
    """Chosen strategy, alternatives with cost deltas, and what ruled others out, for a module path, FQN or node."""
    return explain_plan(self, query)


def diff(self: Plan, other: Plan) -> PlanDiff:
    """What changed from this plan to `other` and what it costs."""
    return diff_plans(self, other)


def code(self: Plan, rank: int = 0, *, model=None, example_inputs: tuple = (), example_kwargs: dict | None = None, graph=None) -> str:
    """The program rank `rank` runs, with its collectives visible; needs the traced model (`model` +
    `example_inputs`, or the `ir.Graph` it was planned from). See `meshplan.plan_code`."""
    from meshplan.inspect.code import plan_code  # the runtime's rewrite: not needed to read a plan

    return plan_code(self, model, example_inputs, rank=rank, example_kwargs=example_kwargs, graph=graph)


def report(self: Plan, path: str) -> str:
    """Write a self-contained HTML report to `path` and return the path."""
    return write_report(self, path)


def attach_reading_methods(cls: type) -> None:
    """Give the Plan class its reading methods (called once, by `meshplan/__init__.py`)."""
    cls.summary, cls.explain, cls.diff, cls.code, cls.report = summary, explain, diff, code, report
    cls.__str__ = summary
