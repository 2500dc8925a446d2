"""A device mesh described without devices: shape and axis names (the innermost axis is fastest)."""

from __future__ import annotations

import math
from dataclasses import dataclass

CP_AXIS = "cp"
"""The axis name that offers attention split along the sequence (context parallelism, torchtitan's name)."""
DEFAULT_AXIS_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp0", "dp1", "tp")}
"""Names of a mesh given by shape alone, searched or not. A mesh is the intra-op sharding grid (a pipeline is a
separate section of the plan), so no axis is called pp; the solver decides what each axis carries."""


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """N devices viewed as a grid; rank r sits at the row-major coordinate of r."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.shape or any((not isinstance(s, int)) or s < 1 for s in self.shape):
            raise ValueError(f"mesh shape {self.shape!r} is invalid; expected a tuple of positive ints")
        if not self.axis_names:
            names = DEFAULT_AXIS_NAMES.get(len(self.shape)) or tuple(f"ax{i}" for i in range(len(self.shape)))
            object.__setattr__(self, "axis_names", names)
        if len(self.axis_names) != len(self.shape) or len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(
                f"mesh axis names {self.axis_names!r} do not fit shape {self.shape!r}: "
                "expected one distinct name per axis"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        coord = []
        for n in reversed(self.shape):
            coord.append(rank % n)
            rank //= n
        return tuple(reversed(coord))

    def axis(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            return name_or_index
        try:
            return self.axis_names.index(name_or_index)
        except ValueError:
            raise ValueError(f"mesh has no axis {name_or_index!r}; axes are {self.axis_names}") from None

    def __str__(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in zip(self.axis_names, self.shape))
