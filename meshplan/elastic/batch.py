"""The global batch, constant across world sizes: how many micro-batches a step accumulates on a given world.

Step k of an elastic run consumes the same global batch (the same samples, the same loss and gradient) on
any number of ranks. What changes with the world is how the batch is cut: each micro-batch gives every
rank the same whole number of samples, at most `micro_batch` of them, and the step accumulates
`accumulation` micro-batches. A world that cannot be cut so is refused, never served a different batch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchSplit", "split_batch", "worlds_that_split"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSplit:
    """How one step's global batch runs on `world` ranks."""

    global_batch: int
    """Samples per optimizer step, the same on every world."""
    world: int
    """Ranks the step runs on."""
    accumulation: int
    """Micro-batches per step (gradients accumulate over them)."""

    @property
    def micro_batch(self) -> int:
        """Samples of one micro-batch, over all ranks (the batch the plan is made for)."""
        return self.global_batch // self.accumulation

    @property
    def per_rank(self) -> int:
        """Samples of one micro-batch that each rank's share holds under data parallelism."""
        return self.micro_batch // self.world

    def __str__(self) -> str:
        return (f"global batch {self.global_batch} = {self.accumulation} micro-batch(es) of {self.micro_batch} "
                f"({self.per_rank} per rank on {self.world} rank{'s' if self.world != 1 else ''})")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def _split(global_batch: int, world: int, micro_batch: int | None) -> BatchSplit | None:
    for accumulation in range(1, global_batch + 1):  # fewest micro-batches first: each costs a pass
        if global_batch % accumulation:
            continue
        micro = global_batch // accumulation
        if micro % world == 0 and (micro_batch is None or micro // world <= micro_batch):
            return BatchSplit(global_batch=global_batch, world=world, accumulation=accumulation)
    return None


def worlds_that_split(global_batch: int, micro_batch: int | None, up_to: int) -> list[int]:
    """World sizes up to `up_to` over which `global_batch` splits (with at most `micro_batch` per rank)."""
    return [w for w in range(1, up_to + 1) if _split(global_batch, w, micro_batch) is not None]


def split_batch(global_batch: int, world: int, micro_batch: int | None = None) -> BatchSplit:
    """The cut of `global_batch` for `world` ranks with the fewest micro-batches, each giving every rank the
    same whole number of samples, at most `micro_batch` (None: no limit). A `ValueError` names the world sizes
    that work when there is none: the global batch is never changed to fit a world."""
    _check_positive("global_batch", global_batch)
    _check_positive("world", world)
    if micro_batch is not None:
        _check_positive("micro_batch", micro_batch)
    found = _split(global_batch, world, micro_batch)
    if found is None:
        limit = f" with at most {micro_batch} samples per rank per micro-batch" if micro_batch is not None else ""
        good = worlds_that_split(global_batch, micro_batch, max(2 * world, 8))
        raise ValueError(
            f"global batch {global_batch} cannot be split over {world} ranks{limit}: every micro-batch must give each "
            f"rank the same whole number of samples, and the global batch stays {global_batch} whatever the world "
            f"(another size would change training). World sizes that split it: {good}; launch one of those, or "
            "start a new run with another global batch")
    return found
