"""meshplan's own sharding rules, for ops DTensor lacks or gets wrong (one file per op family).

A rule returns single-mesh-axis rows `[outputs..., inputs...]` of placements, like DTensor's
single-dim strategies; the strategy generator expands them over every mesh axis.
"""

from meshplan.planner.rules import attention, batch_norm, conv, copy, moe, random, softmax  # noqa: F401  (register their rules)
from meshplan.planner.rules.registry import KEEP, RULES, register_rule

__all__ = ["KEEP", "RULES", "register_rule"]
