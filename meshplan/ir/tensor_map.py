"""Placements <-> MindSpore's (device matrix, tensor map), so plans can be read by MindSpore users.

MindSpore describes a layout by a *device matrix* (the mesh shape, outer axis first) and a *tensor
map* with one entry per tensor dim: `-1` when the dim is not split, `k` when it is split over the
device-matrix dim counted from the right (mesh axis `ndim - 1 - k`), or a tuple of such indices,
major first, when several mesh axes split the same dim. Replicated mesh axes are simply unused.

DTensor's `Shard(d)` on several axes splits `d` with the outer axis major, so a multi-axis entry
must list its axes outer first; the other order (and `Partial`, which a tensor map cannot express)
raises `ValueError`.
"""

from __future__ import annotations

from meshplan.ir.placement import Partial, Placements, Replicate, Shard

TensorMapEntry = int | tuple[int, ...]


def to_tensor_map(placements: Placements, mesh_shape: tuple[int, ...], ndim: int) -> tuple[tuple[int, ...], tuple[TensorMapEntry, ...]]:
    """`(device_matrix, tensor_map)` of a tensor with `ndim` dims laid out as `placements` on the mesh."""
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements do not fit mesh shape {tuple(mesh_shape)}: expected one per mesh axis")
    axes_of_dim: list[list[int]] = [[] for _ in range(ndim)]
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"placement {p} on mesh axis {axis} has no tensor-map form; allowed: Shard(d) and Replicate()")
        if isinstance(p, Shard):
            if not 0 <= p.dim < ndim:
                raise ValueError(f"Shard({p.dim}) on mesh axis {axis} is out of range for a tensor with {ndim} dims")
            axes_of_dim[p.dim].append(axis)
    last = len(mesh_shape) - 1
    entries: list[TensorMapEntry] = []
    for axes in axes_of_dim:
        right = tuple(last - a for a in axes)  # mesh axis order is outer first, which is major first
        entries.append(-1 if not right else right[0] if len(right) == 1 else right)
    return tuple(int(n) for n in mesh_shape), tuple(entries)


def from_tensor_map(device_matrix: tuple[int, ...], tensor_map: tuple[TensorMapEntry, ...]) -> Placements:
    """Inverse of `to_tensor_map`: one placement per device-matrix dim."""
    ndev = len(device_matrix)
    if ndev == 0 or any(not isinstance(n, int) or n < 1 for n in device_matrix):
        raise ValueError(f"device matrix {device_matrix!r} is invalid; expected a non-empty tuple of positive ints")
    placements: list = [Replicate()] * ndev
    used: set[int] = set()
    for dim, entry in enumerate(tensor_map):
        ks = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
        if ks == (-1,):
            continue
        for k in ks:
            if not isinstance(k, int) or not 0 <= k < ndev:
                raise ValueError(
                    f"tensor map entry {entry!r} for tensor dim {dim} is invalid; allowed: -1 or indices 0..{ndev - 1} "
                    f"of device matrix {tuple(device_matrix)} counted from the right"
                )
            if k in used:
                raise ValueError(f"device-matrix dim {k} (from the right) splits more than one tensor dim in {tuple(tensor_map)!r}")
            used.add(k)
        if list(ks) != sorted(ks, reverse=True):
            raise ValueError(
                f"tensor map entry {entry!r} for tensor dim {dim} lists its device dims inner first; DTensor placements "
                f"express only outer-major splits, e.g. {tuple(sorted(ks, reverse=True))!r}"
            )
        for k in ks:
            placements[ndev - 1 - k] = Shard(dim)
    return tuple(placements)
