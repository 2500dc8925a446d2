"""Python's cyclic garbage collector while planning: young collections as usual, full ones rare.

Planning allocates millions of small objects that live until it ends (candidate strategies, priced moves, cost
tables, traced programs) and makes little cyclic garbage. Under CPython's default thresholds (700, 10, 10) those
survivors keep triggering full collections, and each walks the whole heap: planning Llama-3-70B at 131,072 tokens on
256 H100s (benchmarks/long_context.py --big) ran 18 full collections of about 0.3 s, 6.1 of its 25.9 s. With
`PLANNING_THRESHOLDS` it ran none, and the collector took 1.2 s in all; the peak resident memory stayed 629 MiB
(627 before). The caller's thresholds come back when planning ends, also on an error; thresholds already higher
than these, or a collector the caller disabled, are left as they are.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

PLANNING_THRESHOLDS = (10_000, 10, 100)
"""gc.set_threshold while planning: a young collection per 10,000 allocations (CPython's default: 700), a full one
after 100 middle ones (default: 10)."""

F = TypeVar("F", bound=Callable)


def fewer_collections(fn: F) -> F:
    """Run `fn` with the collector's thresholds at least `PLANNING_THRESHOLDS` (nested calls keep the outer ones)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = gc.get_threshold()
        if before[0]:  # 0: the caller turned automatic collection off
            gc.set_threshold(*(max(have, want) for have, want in zip(before, PLANNING_THRESHOLDS)))
        try:
            return fn(*args, **kwargs)
        finally:
            gc.set_threshold(*before)

    return run  # type: ignore[return-value]
