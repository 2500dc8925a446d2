"""Reading plans: the per-rank program (`plan_code`), loading strategy files (`load_plan`), the HTML report;
op coverage of a model before planning (`list_ops`).

This package sits above the runtime (the per-rank program is the runtime's rewrite), so `Plan`
methods that need it (`Plan.code`, `Plan.report`) import it lazily.
"""

from meshplan.inspect.code import plan_code
from meshplan.inspect.load import load_plan
from meshplan.inspect.ops import OpsReport, list_ops
from meshplan.inspect.report import write_report

__all__ = ["OpsReport", "list_ops", "load_plan", "plan_code", "write_report"]
