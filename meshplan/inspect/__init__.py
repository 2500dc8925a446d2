"""Reading plans: the summary, explanations, diffs, the per-rank program (`plan_code`), loading strategy files
(`load_plan`), the HTML report; op coverage of a model before planning (`list_ops`).

This package sits above the runtime (the per-rank program is the runtime's rewrite) and the plan
data (`meshplan/plans`); `methods.py` holds the Plan's reading methods, which `meshplan/__init__.py`
attaches to the class.
"""

from meshplan.inspect.load import load_plan
from meshplan.inspect.report import write_report

__all__ = ["OpsReport", "list_ops", "load_plan", "plan_code", "write_report"]


def __getattr__(name: str) -> object:
    # plan_code needs the runtime and list_ops the planner: imported when asked for, so reading a plan needs neither
    if name == "plan_code":
        from meshplan.inspect.code import plan_code

        return plan_code
    if name in ("OpsReport", "list_ops"):
        from meshplan.inspect import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'meshplan.inspect' has no attribute {name!r}")
