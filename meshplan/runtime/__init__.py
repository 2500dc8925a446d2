"""Execute a Plan: shard parameters, run the per-rank program with explicit collectives."""

from meshplan.runtime.collectives import COUNTS, MeshComm, reset_counts
from meshplan.runtime.parallel_module import ParallelModule
from meshplan.runtime.rewrite import local_program

__all__ = ["COUNTS", "MeshComm", "ParallelModule", "local_program", "reset_counts"]
