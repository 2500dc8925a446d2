"""What real models need from the tracer and the tying: no_grad / autocast regions, export's
metadata asserts, device-pinned ops, and repeated layers whose first copy computes extra ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshplan.ir import trace
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.trace import TraceError
from meshplan.planner.strategies import generate
from meshplan.planner.tying import tie_repeated_layers


class Rotary(nn.Module):
    """Like HF Llama's rotary embedding: a no_grad region, a `.to()` and an arange pinned to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4), persistent=False)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            pos = torch.arange(x.shape[1], device="cpu").float()
            angles = (pos[:, None] * self.inv_freq[None, :] * self.fc.weight[0, 0]).to(torch.float32)
        return self.fc(x) * torch.cat([angles.cos(), angles.sin()], dim=-1)


def test_no_grad_regions_are_inlined_and_asserts_dropped():
    graph = trace(Rotary(), (torch.randn(2, 6, 8),))
    targets = [n.target for n in graph.nodes if n.kind == "op"]
    assert not any("higher_order" in t or "_assert_tensor_metadata" in t for t in targets)
    cos = next(n for n in graph.nodes if n.target == "aten.cos.default")
    assert cos.requires_grad == (False,)  # computed without gradients, as in eager
    assert not generate(graph, MeshSpec((2,))).fallbacks


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


def test_an_enabled_autocast_region_is_refused_by_name():
    with pytest.raises(TraceError, match=r"torch.autocast\('cpu', dtype=torch.bfloat16\) region"):
        trace(Autocast(), (torch.randn(2, 8),))


class Block(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.fc = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.zeros(8)) if first else None

    def forward(self, x, extra):
        if self.first:  # only the first layer computes this (as T5's first block computes the position bias)
            extra = (self.bias * 2).tanh()
        return torch.relu(self.fc(x) + extra), extra


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(i == 0) for i in range(3)])

    def forward(self, x):
        extra = torch.zeros(8)
        for layer in self.layers:
            x, extra = layer(x, extra)
        return x


def test_layers_that_differ_at_the_start_still_tie():
    graph = trace(Stack(), (torch.randn(4, 8),))
    cands = generate(graph, MeshSpec((2,)))
    tying = tie_repeated_layers(graph, cands.by_node)
    first = [n for n in graph.nodes if n.layer == "layers.0"]
    later = [n for n in graph.nodes if n.layer in ("layers.1", "layers.2")]
    assert len(first) > len(later) // 2  # layer 0 has the extra ops
    tied = [n for n in later if tying.rep[n.name] != n.name]
    assert tying.layers == {"layers.*": 3} and len(tied) == len(later)
