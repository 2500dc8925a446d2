"""meshplan's own sharding rules, for ops DTensor lacks or gets wrong (one file per op family).

A rule returns single-mesh-axis rows `[outputs..., inputs...]` of placements, like DTensor's
single-dim strategies; the strategy generator expands them over every mesh axis. Region ops
(ir/regions.py) carry their rules themselves: attention's (`attention.py`) is read by the
context-parallel region op (regions/context_parallel.py), which adds its sequence-split kernels.
"""

import torch

from meshplan.ir.op_kinds import RANDOM_OPS
from meshplan.planner.rules.conv import conv_rule
from meshplan.planner.rules.copy import copy_rule
from meshplan.planner.rules.random import random_rule
from meshplan.planner.rules.registry import RULES, register_rule

_aten = torch.ops.aten
register_rule(_aten.convolution.default)(conv_rule)
register_rule(_aten.copy.default)(copy_rule)
register_rule(*RANDOM_OPS)(random_rule)

__all__ = ["RULES", "register_rule"]
