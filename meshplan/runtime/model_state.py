"""Module attributes a forward reassigns that change what later forwards compute, followed as one process would.

Hugging Face RWKV halves its deeper blocks' output weights on its first eval-mode call and records that in
`layers_are_rescaled`; its next eval call leaves the weights alone, and its next training call doubles them back.
Each traced program computes what the model computed from the attributes it had when traced
(`TracedProgram.attributes`), and the trace records the ones its forward moves on (`TracedProgram.state_changes`,
ir/trace.py). `ModelState` keeps the attributes earlier forwards left and the programs traced from them, one per
mode and state, so every call runs the program of the state one process's model would be in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshplan.ir.mutations import UNSET
from meshplan.ir.trace import TracedProgram


class ModelState:
    """The attributes earlier forwards moved away from `initial` (the attributes the module's own programs were
    traced with), and the programs traced from them."""

    def __init__(self, initial: dict[str, Any]) -> None:
        self.initial = initial
        self.moved: dict[str, Any] = {}
        self._programs: dict[tuple, Any] = {}

    def after(self, traced: TracedProgram) -> None:
        """Record the attributes a forward of `traced`'s program left."""
        for key, value in traced.state_changes.items():
            if self.initial.get(key, UNSET) == value:
                self.moved.pop(key, None)
            else:
                self.moved[key] = value

    def program(self, training: bool, build: Callable[[bool, dict[str, Any]], Any]) -> Any:
        """None while every attribute is as the module's own programs were traced; else this mode's program for the
        attributes now, `build(training, attributes)` the first time they are asked for."""
        if not self.moved:
            return None
        key = (training, tuple(sorted(self.moved.items(), key=repr)))
        if key not in self._programs:
            self._programs[key] = build(training, dict(self.moved))
        return self._programs[key]

    def check(self, traced: TracedProgram, mode: str) -> None:
        """A ValueError when an earlier forward left an attribute with another value than `traced`'s program was traced
        with: it would compute what the model computed then, not now."""
        for key, value in self.moved.items():
            then = traced.attributes.get(key, UNSET)
            if then != value:
                was = "did not exist" if then is UNSET else f"was {then!r}"
                raise ValueError(
                    f"an earlier forward set the model's attribute {key} to {value!r}, and it {was} when the {mode}-mode "
                    "program was traced: the program computes what the model computed in that state, and this "
                    "ParallelModule has no source to trace it again from the new one (meshplan.auto_parallelize gives it "
                    "one; or pass eval_source=)"
                )
