"""DTensor's `_MaskPartial`: vocabulary-parallel embedding lookups and gathers.

DTensor marks the lookup `embedding(weight Shard(0) on the vocabulary, ids)` with a masked partial:
the ids arrive whole, each device looks up only the ids in its own rows (the others give zeros),
and the results are partial sums. meshplan writes that as an ordinary layout plus a kernel: the ids
(and gather's index) are `Replicate()` on that axis, the output `Partial("sum")`, and the strategy's
`kernel="masked"` tells the runtime to shift and mask the ids locally (`regions/masked_lookup.py`). The
partial output then moves like any other (all-reduce, or reduce-scatter into a sequence shard).
"""

from __future__ import annotations

from torch.distributed.tensor import placement_types as dt

from meshplan.ir.placement import Partial, Placement, Replicate


def is_mask_partial(p: object) -> bool:
    return isinstance(p, dt._MaskPartial)


def from_mask_partial(p: dt._MaskPartial, *, is_input: bool) -> Placement:
    """The ids/index input stays whole (the kernel masks it locally); the output is a sum partial."""
    if p.reduce_op != "sum":
        raise AssertionError(f"masked partial with reduce op {p.reduce_op}")
    return Replicate() if is_input else Partial("sum")
