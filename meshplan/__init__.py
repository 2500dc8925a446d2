"""meshplan: an auto-parallel planner and graph compiler for PyTorch.

    pmodel = meshplan.auto_parallelize(model, devices=4, example_inputs=(tokens,))
    print(pmodel.plan)

The public names load on first use, so `import meshplan` (and `meshplan --help`) does not import torch,
and reading a plan file does not import the planner or the runtime.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

_EXPORTS = {
    "auto_parallelize": "meshplan.api", "plan": "meshplan.api",
    "list_ops": "meshplan.inspect", "load_plan": "meshplan.inspect", "plan_code": "meshplan.inspect",
    "Partial": "meshplan.ir.placement", "Replicate": "meshplan.ir.placement", "Shard": "meshplan.ir.placement",
    "MixedPrecision": "meshplan.ir.precision",
    "RegionOp": "meshplan.ir.regions", "register_region_op": "meshplan.ir.regions",
    "Layout": "meshplan.planner.annotations", "shard": "meshplan.planner.annotations",
    "PipelineOptions": "meshplan.planner.pipeline",
    "Plan": "meshplan.plans.plan",
    "load_checkpoint": "meshplan.runtime.checkpoint", "save_checkpoint": "meshplan.runtime.checkpoint",
    "CollectiveError": "meshplan.runtime.collectives",
    "ParallelModule": "meshplan.runtime.parallel_module",
}
"""Public name -> the module defining it (tests/test_imports.py counts these as the root's imports)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshplan' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _attach_reading_methods(module) -> None:
    # A Plan is data (meshplan/plans); its reading methods come from the presentation layer above it.
    from meshplan.inspect.methods import attach_reading_methods

    attach_reading_methods(module.Plan)


def _import_regions(module) -> None:
    importlib.import_module("meshplan.regions")  # which registers them as it finishes loading (below)


def _register_regions(module) -> None:
    module.register_builtin_regions()


class _AfterLoad(importlib.abc.MetaPathFinder):
    """Runs an action as a module finishes loading, however it was imported: what this package once did on its own
    import, now done when the modules it concerns load. The built-in region ops (ir/regions.py: plugins that planning
    and running look up) are registered once the planner or the runtime has loaded (`meshplan.ir.trace` used alone
    sees none); meshplan.regions, which imports the runtime, registers them when it has itself loaded."""

    ACTIONS = {
        "meshplan.plans.plan": _attach_reading_methods,
        "meshplan.planner": _import_regions,
        "meshplan.runtime": _import_regions,
        "meshplan.regions": _register_regions,
    }

    def find_spec(self, fullname, path, target=None):
        action = self.ACTIONS.get(fullname)
        spec = action and importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if not spec:
            return None
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            action(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterLoad())
