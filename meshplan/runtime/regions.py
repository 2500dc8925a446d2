"""Per-rank implementations of meshplan's region ops (ir/regions.py): a module per node, built from
the node's strategy, that computes this rank's part and runs the op's own collectives."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

RegionFactory = Callable[..., nn.Module]
"""(strategy, comm, static args) -> the module this rank calls with the node's tensor arguments."""

REGION_RUNTIMES: dict[object, RegionFactory] = {}


def register_region_runtime(op: object) -> Callable[[RegionFactory], RegionFactory]:
    def wrap(fn: RegionFactory) -> RegionFactory:
        assert op not in REGION_RUNTIMES, f"two runtimes for {op}"
        REGION_RUNTIMES[op] = fn
        return fn

    return wrap
