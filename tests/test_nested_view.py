"""Views of dims split over several mesh axes at once (`planner/rules/nested_view.py`).

Every layout pair the rule offers is checked on numbers: each rank's block of the input, viewed locally, must be its
block of the output, the blocks cut as DTensor cuts nested `Shard`s (mesh axes in order, each splitting what the
axes before it left)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import is_even, local_shape
from meshplan.ir.trace import trace
from meshplan.planner import strategies
from meshplan.planner.rules.nested_view import dim_groups, nested_view_layouts


def _block(t: torch.Tensor, layout, mesh_shape, coord) -> torch.Tensor:
    for axis, p in enumerate(layout):
        if isinstance(p, Shard):
            t = t.chunk(mesh_shape[axis], dim=p.dim)[coord[axis]]
    return t


CASES = [  # (source shape, destination shape, mesh, how many even layouts are offered)
    ((2, 8, 6), (16, 6), (2, 2), 1),  # a linear's flatten: one sequence per dp rank, the sequence over cp
    ((16, 6), (2, 8, 6), (2, 2), 1),  # and back
    ((2, 8, 6), (16, 6), (2, 2, 3), 3),  # dp x cp x tp: tp on the hidden dim, replicated, or a partial sum
    ((1, 2, 8, 4), (16, 4), (2, 2), 1),  # a leading single dim
    ((2, 4, 2, 6), (8, 2, 6), (2, 2, 2), 13),
    ((4, 8, 6), (32, 6), (2, 2), 0),  # two sequences per dp rank: no nested flatten is offered
    ((32, 6), (4, 8, 6), (2, 2), 0),
]


@pytest.mark.parametrize("src,dst,mesh,even", CASES)
def test_every_offered_layout_keeps_each_block(src, dst, mesh, even):
    x = torch.arange(math.prod(src), dtype=torch.float32).view(src)
    y = x.reshape(dst)
    offered = [(i, o) for i, o in nested_view_layouts(src, dst, mesh) if is_even(src, i, mesh) and is_even(dst, o, mesh)]
    assert len(offered) == even
    for ins, outs in offered:
        for coord in itertools.product(*(range(n) for n in mesh)):
            mine = _block(x, ins, mesh, coord)
            assert torch.equal(mine.reshape(local_shape(dst, outs, mesh)), _block(y, outs, mesh, coord)), (ins, outs, coord)


def test_what_is_offered_and_what_is_not():
    offered = dict(nested_view_layouts((2, 8, 6), (16, 6), (2, 2)))
    assert offered == {(Shard(0), Shard(1)): (Shard(0), Shard(0))}  # dp x cp: each rank a contiguous run of the rows
    # a partial sum beside it passes through; DTensor's own rule has the layouts with one dim split
    assert dict(nested_view_layouts((2, 8, 6), (16, 6), (2, 2, 2)))[(Shard(0), Partial(), Shard(1))] == (Shard(0), Partial(), Shard(0))
    assert (Shard(1), Shard(0)) not in offered  # cp before dp in the mesh: each rank's rows are strided
    assert (Replicate(), Shard(1)) not in offered  # the sequence alone split: both sequences' quarters, strided
    assert nested_view_layouts((4, 8, 6), (32, 6), (2, 2)) == []  # two sequences per dp rank: strided again
    split = dict((o, i) for i, o in nested_view_layouts((16, 6), (2, 8, 6), (2, 2)))
    assert split[(Shard(0), Shard(1))] == (Shard(0), Shard(0))


def test_groups():
    assert dim_groups((2, 8, 6), (16, 6)) == [([0, 1], [0]), ([2], [1])]
    assert dim_groups((1, 16), (16,)) == [([0, 1], [0])]
    assert dim_groups((16, 6), (2, 8, 6)) == [([0], [0, 1]), ([1], [2])]
    assert dim_groups((4,), (5,)) == []


def test_the_planner_offers_them_for_a_linear_layer():
    """A [2, 8, 6] activation through nn.Linear on dp x cp: the flatten and the unflatten keep the sequence split."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 6, bias=False))
    graph = trace(model, (torch.randn(2, 8, 6),))
    found = strategies.generate(graph, MeshSpec((2, 2), ("dp", "cp")))
    views = [n for n in graph.nodes if n.target in ("aten.view.default", "aten._unsafe_view.default")]
    assert len(views) == 2
    first, second = (found.by_node[n.name] for n in views)
    assert any(s.inputs[0] == (Shard(0), Shard(1)) and s.outputs[0] == (Shard(0), Shard(0)) for s in first)
    assert any(s.inputs[0] == (Shard(0), Shard(0)) and s.outputs[0] == (Shard(0), Shard(1)) for s in second)
