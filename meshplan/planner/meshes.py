"""The meshes to plan for: the one the user gave, or every factorisation of a device count the mesh search tries."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshplan.ir.mesh import MeshSpec

Devices = int | Sequence[int] | DeviceMesh


def resolve_mesh(
    devices: Devices, mesh_shape: Sequence[int] | None = None, axis_names: Sequence[str] | None = None, devices_per_node: int | None = None
) -> list[MeshSpec]:
    """The mesh(es) to consider: one when the shape is known, otherwise every factorisation into
    up to three axes whose innermost axis fits in a node (`mesh_shapes`)."""
    names = tuple(axis_names) if axis_names else ()
    if isinstance(devices, DeviceMesh):
        shape = tuple(devices.shape)
        names = names or tuple(devices.mesh_dim_names or ())
        if not torch.equal(devices.mesh.flatten(), torch.arange(devices.size())):
            raise ValueError(f"DeviceMesh {devices} must hold ranks 0..{devices.size() - 1} in row-major order")
        return [MeshSpec(shape, names)]
    if isinstance(devices, (tuple, list)):
        shape = tuple(int(d) for d in devices)
        if mesh_shape is not None and tuple(mesh_shape) != shape:
            raise ValueError(f"devices={shape} and mesh_shape={tuple(mesh_shape)} disagree; give one of them")
        return [MeshSpec(shape, names)]
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive int, a mesh shape tuple or a DeviceMesh; got {devices!r}")
    if mesh_shape is not None:
        shape = tuple(int(s) for s in mesh_shape)
        n = math.prod(shape)
        if n != devices:
            raise ValueError(f"mesh_shape {shape} has {n} devices but devices={devices}; their product must equal devices")
        return [MeshSpec(shape, names)]
    # searched meshes keep the given names where they fit, else MeshSpec's defaults (the solver decides what each axis carries)
    return [MeshSpec(shape, names if len(names) == len(shape) else ()) for shape in mesh_shapes(devices, devices_per_node)]


def mesh_shapes(devices: int, devices_per_node: int | None = None, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Factorisations of `devices` into 1..`max_axes` axes (each > 1), outermost first.

    With `devices_per_node`, the innermost axis must fit in one node (the fast link): an inner
    axis that crosses nodes is never better than the same shape with axes swapped, since every
    axis can carry any parallelism. For the same reason two orders of the same axes whose sizes
    meet the same links ((2, 4) and (4, 2) inside one node) are one candidate: the first is kept.
    """

    def split(n: int, axes: int) -> list[tuple[int, ...]]:
        if axes == 1:
            return [(n,)]
        return [(d, *rest) for d in range(2, n) if n % d == 0 for rest in split(n // d, axes - 1)]

    shapes = [s for k in range(1, max_axes + 1) for s in split(devices, k) if devices > 1 or k == 1]
    if devices_per_node:
        shapes = [s for s in shapes if s[-1] <= devices_per_node or len(s) == 1]

    def links(shape: tuple[int, ...]) -> tuple:
        """Each axis's size with whether its groups fit in one node (`ClusterPreset.link_for_axis`)."""
        return tuple(sorted((n, not devices_per_node or math.prod(shape[a:]) <= devices_per_node) for a, n in enumerate(shape)))

    kept: dict[tuple, tuple[int, ...]] = {}
    for shape in shapes:
        kept.setdefault(links(shape), shape)
    return list(kept.values())
