"""Views that flatten or split a group of dims sharded over several mesh axes at once.

DTensor's view rule is per mesh axis: a flatten keeps a split only on the group's first dim, so a [b, S, h] tensor
split over (dp on the batch, cp on the sequence) has no flattened [b S, h] layout but a strided shard, which meshplan
does not run. When every dim before the last split one is cut down to one row per rank (a microbatch of one sequence
per data-parallel rank, as context parallelism runs it), each rank's block is one contiguous run of the flattened
dim, in the mesh's axis order: plain nested `Shard`s, with no data moved. Without these layouts every linear layer of
a dp x cp plan gathers the sequence (Llama-3-70B at 131k tokens: 1.7x its stage profile's price).
"""

from __future__ import annotations

import itertools
import math

from torch.distributed.tensor import Partial, Replicate, Shard

from meshplan.ir.placement import Placements

VIEW_OPS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})


def dim_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The view from `src` to `dst` as groups of source dims and the destination dims they become (equal products);
    trailing dims of one size left over form groups with nothing on the other side."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        ins, outs, a, b = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                ins.append(i)
                a, i = a * src[i], i + 1
            elif b < a and j < len(dst):
                outs.append(j)
                b, j = b * dst[j], j + 1
            else:
                return []  # not a view (sizes do not match)
        groups.append((ins, outs))
    groups += [([k], []) for k in range(i, len(src))] + [([], [k]) for k in range(j, len(dst))]
    return groups


def _mapped(splits: list[tuple[int, int]], ins: list[int], outs: list[int], src: tuple[int, ...], dst: tuple[int, ...],
            mesh_shape: tuple[int, ...]) -> dict[int, int] | None:
    """Mesh axis -> destination dim for the axes `splits` ((axis, source dim), in mesh order) of one group, or None when
    some rank's block is not a nested split of the destination dims."""
    if not splits:
        return {}
    if not ins or not outs:  # a single dim left over: split, it is uneven
        return None
    if len(ins) == 1 and len(outs) == 1:
        return {axis: outs[0] for axis, _ in splits}
    if len(outs) == 1:  # flatten: axes cut the dims outer-first, and every dim before the last cut one to single rows
        dims = [d for _, d in splits]
        if dims != sorted(dims):
            return None
        local = {d: src[d] // math.prod(mesh_shape[a] for a, e in splits if e == d) for d in ins}
        if any(local[d] != 1 for d in ins[:ins.index(dims[-1])]):
            return None
        return {axis: outs[0] for axis, _ in splits}
    if len(ins) == 1:  # split: each destination dim cut to single rows before the next takes an axis
        out, k, left = {}, 0, dst[outs[0]]
        for axis, _ in splits:
            while left == 1 and k + 1 < len(outs):
                k += 1
                left = dst[outs[k]]
            if left % mesh_shape[axis]:
                return None
            left //= mesh_shape[axis]
            out[axis] = outs[k]
        return out
    return None


def nested_view_layouts(src: tuple[int, ...], dst: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[tuple[Placements, Placements]]:
    """Every (input layout, output layout) of a view from `src` to `dst` in which some group of dims is split over
    several mesh axes (DTensor's rule has the others), each rank's block unmoved."""
    groups = dim_groups(src, dst)
    if not groups:
        return []
    group_of = {d: g for g, (ins, _) in enumerate(groups) for d in ins}
    per_axis = [Replicate(), Partial(), *(Shard(d) for d in range(len(src)))]
    found = []
    for layout in itertools.product(per_axis, repeat=len(mesh_shape)):
        shards = [(axis, p.dim) for axis, p in enumerate(layout) if isinstance(p, Shard)]
        by_group: dict[int, list[tuple[int, int]]] = {}
        for axis, d in shards:
            by_group.setdefault(group_of[d], []).append((axis, d))
        dims: dict[int, int] = {}
        nested = False  # some group split on several of its dims, on either side: DTensor's rule has the others
        for g, splits in by_group.items():
            mapped = _mapped(splits, *groups[g], src, dst, mesh_shape)
            if mapped is None:
                break
            dims.update(mapped)
            nested |= len({d for _, d in splits}) > 1 or len(set(mapped.values())) > 1
        else:
            if nested:
                found.append((layout, tuple(Shard(dims[a]) if isinstance(p, Shard) else p for a, p in enumerate(layout))))
    return found
