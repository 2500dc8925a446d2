"""Python's cyclic garbage collector while planning: young collections as usual, full ones rare.

Planning allocates millions of small objects that live until it ends (candidate strategies, priced moves, cost
tables, traced programs) and makes little cyclic garbage. Under CPython's default thresholds (700, 10, 10) those
survivors keep triggering full collections, and each walks the whole heap: planning Llama-3-70B at 131,072 tokens on
256 H100s (benchmarks/long_context.py --big) ran 18 full collections of about 0.3 s, 6.1 of its 25.9 s. With
`PLANNING_THRESHOLDS` it ran none, and the collector took 1.2 s in all; the peak resident memory stayed 629 MiB
(627 before). The caller's thresholds come back when planning ends, also on an error; thresholds already higher
than these, or a collector the caller disabled, are left as they are. The thresholds are the process's: while
several threads plan at once, the first to start sets them and the last to finish puts the caller's back.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import TypeVar

PLANNING_THRESHOLDS = (10_000, 10, 100)
"""gc.set_threshold while planning: a young collection per 10,000 allocations (CPython's default: 700), a full one
after 100 middle ones (default: 10)."""

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_planning = 0
"""Calls inside `fewer_collections` now, in every thread (nested ones too)."""
_callers: tuple[int, int, int] = gc.get_threshold()
"""The thresholds before the first of them began."""


def fewer_collections(fn: F) -> F:
    """Run `fn` with the collector's thresholds at least `PLANNING_THRESHOLDS`; the thresholds from before the first
    of any overlapping calls (nested, or in other threads) come back when the last one ends."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        global _planning, _callers
        with _lock:
            if not _planning:
                _callers = gc.get_threshold()
                if _callers[0]:  # 0: the caller turned automatic collection off
                    gc.set_threshold(*(max(have, want) for have, want in zip(_callers, PLANNING_THRESHOLDS)))
            _planning += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _planning -= 1
                if not _planning:
                    gc.set_threshold(*_callers)

    return run  # type: ignore[return-value]
