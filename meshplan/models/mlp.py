"""A plain multi-layer perceptron: the smallest model every plan must handle."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """x [batch, d_in] -> [batch, d_out], with GELU between `nn.Linear` layers."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 16, depth: int = 2) -> None:
        super().__init__()
        widths = [d_in] + [hidden] * depth + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return x
