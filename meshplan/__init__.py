"""meshplan: an auto-parallel planner and graph compiler for PyTorch.

    pmodel = meshplan.auto_parallelize(model, devices=4, example_inputs=(tokens,))
    print(pmodel.plan)
"""

from meshplan.api import auto_parallelize, plan
from meshplan.inspect import load_plan, plan_code
from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.planner.plan import Plan
from meshplan.runtime.parallel_module import ParallelModule

__all__ = [
    "ParallelModule", "Partial", "Plan", "Replicate", "Shard", "auto_parallelize", "load_plan", "plan", "plan_code",
]
