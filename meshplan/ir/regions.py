"""Regions: submodules traced as one op instead of op by op.

Some blocks cannot be traced into a static graph of ATen ops: a mixture-of-experts layer routes
each token to experts chosen at run time, so the number of tokens each expert sees is data. A
region adapter matches such a submodule and, while the model is traced, swaps its `forward` for
one that calls a single custom op. The op becomes one node of the graph, with its own sharding
rules (planner/rules/), costs (cost_model/) and per-rank implementation (runtime/); the model
itself is never modified outside the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class RegionAdapter:
    """How one kind of block is traced as a single op."""

    name: str
    """Short name for messages, e.g. 'moe'."""
    matches: Callable[[nn.Module], bool]
    """True for the submodules this adapter replaces."""
    forward: Callable[..., object]
    """`forward(module, *args, **kwargs)`: the module's computation expressed with the region op."""


ADAPTERS: list[RegionAdapter] = []


def register_region(adapter: RegionAdapter) -> RegionAdapter:
    assert all(a.name != adapter.name for a in ADAPTERS), f"two region adapters named {adapter.name}"
    ADAPTERS.append(adapter)
    return adapter


def find_regions(model: nn.Module) -> list[tuple[str, RegionAdapter]]:
    """(module path, adapter) of every submodule some adapter matches (outermost first)."""
    found = []
    for path, module in model.named_modules():
        for adapter in ADAPTERS:
            if adapter.matches(module):
                found.append((path, adapter))
                break
    return found


@contextlib.contextmanager
def regions_patched(model: nn.Module) -> Iterator[list[str]]:
    """Within the block, every matched submodule runs its region forward; yields their paths."""
    patched: list[tuple[nn.Module, bool, object]] = []
    paths = []
    try:
        for path, adapter in find_regions(model):
            module = model.get_submodule(path)
            had = "forward" in module.__dict__
            patched.append((module, had, module.__dict__.get("forward")))
            module.forward = lambda *a, _m=module, _f=adapter.forward, **k: _f(_m, *a, **k)
            paths.append(path)
        yield paths
    finally:
        for module, had, old in reversed(patched):
            if had:
                module.forward = old
            else:
                del module.forward
