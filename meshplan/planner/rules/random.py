"""Random ops (dropout masks, noise): drawn whole on every device.

Every rank holds the same generator state (ParallelModule broadcasts rank 0's at start) and runs
the same random ops in the same order as the single-device model, so drawing each random tensor
whole reproduces the single-device draw exactly: ranks holding replicas get identical masks, and
a sharded consumer takes its slice of the very mask one device would have drawn. Sharding the
draw itself would make each rank draw a smaller tensor from the start of the same stream, which
is a different mask. The cost is generating the whole mask on every device (cheap next to the
matmuls around it); see docs/regions.md.
"""

from __future__ import annotations

from meshplan.planner.rules.registry import Row


def random_rule(args, kwargs) -> list[Row]:
    return []  # only the replicated strategy (the generator adds it for every op)
