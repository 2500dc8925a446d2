"""Priced moves between layouts, kept between cost tables.

Building a mesh's tables prices every (given, needed) layout pair of every edge: hundreds of thousands of
`transfer_times` calls on a 3-axis mesh. The same moves come back in every table of one cluster and mesh shape (a
neighbourhood search's subsets, the memory row solved again, a pipeline search's stage plans, a model planned
twice), so they are priced once per process and looked up by small integers: a layout's hash is a Python call per
placement (DTensor's `__hash__`), and the lookups, not the pricing, were most of the table building.
"""

from __future__ import annotations

from meshplan.cost_model.estimate import transfer_times
from meshplan.cost_model.presets import ClusterPreset
from meshplan.cost_model.redistribution import InfeasibleRedistribution
from meshplan.ir.graph import TensorMeta
from meshplan.ir.placement import Placements

Moves = dict[tuple[int, int], tuple[float, float] | None]
"""(id of the given layout, id of the needed one) -> (forward, backward) seconds of the move, None if impossible."""

KEPT_LIMIT = 1 << 18
"""Priced moves kept in all (about 50 MB); past it the caches start again (tables in use keep theirs). The layout
ids are kept: equal layouts have one id for the life of the process (a few thousand layouts)."""

_IDS: dict[Placements, int] = {}
_CACHES: dict[tuple, dict[TensorMeta, Moves]] = {}
_KEPT = [0]


def layout_id(layout: Placements) -> int:
    """The same int for equal layouts."""
    found = _IDS.get(layout)
    if found is None:
        found = _IDS[layout] = len(_IDS)
    return found


def shared_moves(cluster: ClusterPreset, mesh_shape: tuple[int, ...]) -> dict[TensorMeta, Moves]:
    """The priced moves of every table of `cluster` (the object: presets are frozen) on meshes of `mesh_shape`,
    per tensor meta."""
    return _CACHES.setdefault((_Same(cluster), mesh_shape), {})


def priced(moves: Moves, key: tuple[int, int], meta: TensorMeta, src: Placements, dst: Placements, mesh_shape: tuple[int, ...],
           cluster: ClusterPreset) -> tuple[float, float] | None:
    """`transfer_times` of the move `src` -> `dst` (`key`: their ids), or None if impossible, kept in `moves`."""
    try:
        found = transfer_times(meta, src, dst, mesh_shape, cluster)
    except InfeasibleRedistribution:
        found = None
    moves[key] = found
    _KEPT[0] += 1
    if _KEPT[0] > KEPT_LIMIT:
        _CACHES.clear()
        _KEPT[0] = 0
    return found


class _Same:
    """A key by identity that keeps its object alive, so that no other object takes its id while the key is held."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj
