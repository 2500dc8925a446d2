"""meshplan: an auto-parallel planner and graph compiler for PyTorch.

    pmodel = meshplan.auto_parallelize(model, devices=4, example_inputs=(tokens,))
    print(pmodel.plan)
"""

from meshplan.api import auto_parallelize, plan
from meshplan.inspect import list_ops, load_plan, plan_code
from meshplan.inspect.methods import attach_reading_methods
from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.ir.precision import MixedPrecision
from meshplan.ir.regions import RegionOp, register_region_op
from meshplan.planner.annotations import Layout, shard
from meshplan.planner.pipeline import PipelineOptions
from meshplan.plans.plan import Plan
from meshplan.regions import register_builtin_regions
from meshplan.runtime.checkpoint import load_checkpoint, save_checkpoint
from meshplan.runtime.collectives import CollectiveError
from meshplan.runtime.parallel_module import ParallelModule
from meshplan.runtime.pipeline import PipelineRunner

# A Plan is data (meshplan/plans); its reading methods come from the presentation layer above it.
attach_reading_methods(Plan)
# Region ops (ir/regions.py) are plugins every layer looks up; the built-in ones are registered here, once.
register_builtin_regions()

__all__ = [
    "CollectiveError", "Layout", "MixedPrecision", "ParallelModule", "Partial", "PipelineOptions", "PipelineRunner", "Plan", "RegionOp", "Replicate", "Shard",
    "auto_parallelize", "list_ops", "load_checkpoint", "load_plan", "plan", "plan_code", "register_region_op", "save_checkpoint", "shard",
]
