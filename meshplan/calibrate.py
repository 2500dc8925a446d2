"""Deprecated name of `meshplan.profiling.calibrate` (the profilers moved to `meshplan/profiling`); importing it
warns and gives the same functions."""

import warnings

from meshplan.profiling.calibrate import op_workload, profile_comm, profile_comm_torchrun, profile_graph, profile_model

warnings.warn("meshplan.calibrate is deprecated; import meshplan.profiling.calibrate", DeprecationWarning, stacklevel=2)

__all__ = ["op_workload", "profile_comm", "profile_comm_torchrun", "profile_graph", "profile_model"]
