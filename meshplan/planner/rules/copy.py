"""`aten.copy` (the functional form of `dst.copy_(src)`, left by slice assignments such as T5's
`shift_right`): the result has `dst`'s shape and takes `src`'s values, broadcast."""

from __future__ import annotations

from meshplan.ir.placement import Partial, Replicate, Shard
from meshplan.planner.rules.registry import Row, tensor_args


def copy_rule(args, kwargs) -> list[Row]:
    dst, src = tensor_args(args, kwargs)[:2]
    lead = dst.ndim - src.ndim  # src broadcasts from the right
    rows: list[Row] = []
    for d in range(dst.ndim):
        s = d - lead
        # dst only gives the result's shape (its values are overwritten): it is split like the result;
        # a dim src broadcasts along stays whole in src
        src_p = Shard(s) if s >= 0 and src.shape[s] == dst.shape[d] else Replicate()
        rows.append([Shard(d), Shard(d), src_p])
    # a partial src gives a partial result when every value of dst is overwritten (same shape) and no
    # cast rounds the parts (both floating point)
    if tuple(src.shape) == tuple(dst.shape) and src.dtype.is_floating_point and dst.dtype.is_floating_point:
        rows.append([Partial(), Replicate(), Partial()])
    return rows
