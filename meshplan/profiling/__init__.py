"""Measuring a machine for the cost model: the op and collective profilers, the pipelining runtime's and
DTensor's overheads, calibration on a model (`calibrate.py`, `meshplan profile ...`) and the fidelity
benchmark (`fidelity.py`, `meshplan validate`). It writes the profile database that the cost model reads
(`cost_model/profile.py`: the data stays below the planner, the measuring sits on top, as it runs models
through the planner and the runtime)."""
