"""A node's sharding strategy: the layout of each input it reads and each output it writes."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir.placement import Placements, fmt, parse


@dataclass(frozen=True, slots=True)
class Strategy:
    """Layouts (one placement per mesh axis) of a node's tensor inputs and outputs."""

    inputs: tuple[Placements, ...]
    """Layout each tensor input must have when the op runs (IR input order)."""
    outputs: tuple[Placements | None, ...]
    """Layout of each output; None for a non-tensor output."""
    source: str = "dtensor"
    """Where the rule came from: dtensor, meshplan (our registry), fallback (replicate) or leaf."""
    kernel: str = ""
    """Non-empty when the op does not run as its plain local op but as a sharded kernel, built by the
    op's region op (`meshplan/regions/`): 'masked' (vocabulary-parallel lookups: DTensor's MaskPartial)
    or 'log_softmax(dim=d)' (max/sum all-reduces inside the op, listed on its node in the plan)."""

    def __str__(self) -> str:
        ins = ",".join(fmt(p) for p in self.inputs)
        outs = ",".join("-" if p is None else fmt(p) for p in self.outputs)
        return f"{ins or '()'}->{outs}" + (f" [{self.kernel}]" if self.kernel else "")

    def to_json(self) -> dict:
        d = {
            "inputs": [fmt(p) for p in self.inputs],
            "outputs": [None if p is None else fmt(p) for p in self.outputs],
            "source": self.source,
        }
        if self.kernel:  # only when set: plan files (and hashes) without kernels stay as they were
            d["kernel"] = self.kernel
        return d

    @staticmethod
    def from_json(d: dict) -> Strategy:
        return Strategy(
            tuple(parse(p) for p in d["inputs"]),
            tuple(None if p is None else parse(p) for p in d["outputs"]),
            d["source"],
            d.get("kernel", ""),
        )
