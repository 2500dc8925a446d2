"""Reading plans: the summary, explanations, diffs, the per-rank program (`plan_code`), loading strategy files
(`load_plan`), the HTML report; op coverage of a model before planning (`list_ops`).

This package sits above the runtime (the per-rank program is the runtime's rewrite) and the plan
data (`meshplan/plans`); `methods.py` holds the Plan's reading methods, which `meshplan/__init__.py`
attaches to the class.
"""

from meshplan.inspect.code import plan_code
from meshplan.inspect.load import load_plan
from meshplan.inspect.ops import OpsReport, list_ops
from meshplan.inspect.report import write_report

__all__ = ["OpsReport", "list_ops", "load_plan", "plan_code", "write_report"]
