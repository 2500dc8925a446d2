"""Candidate strategies per node, the OR-Tools search, and the Plan it produces."""

from meshplan.planner.planner import PlanOptions, make_plan
from meshplan.plans.plan import Plan
from meshplan.plans.strategy import Strategy

__all__ = ["Plan", "PlanOptions", "Strategy", "make_plan"]
