"""Reading plans: the per-rank program (`plan_code`), loading strategy files (`load_plan`), the HTML report.

This package sits above the runtime (the per-rank program is the runtime's rewrite), so `Plan`
methods that need it (`Plan.code`, `Plan.report`) import it lazily.
"""

from meshplan.inspect.code import plan_code
from meshplan.inspect.load import load_plan
from meshplan.inspect.report import write_report

__all__ = ["load_plan", "plan_code", "write_report"]
