"""Small models, each with its batch and loss, for the device tests (tests/test_device_placement.py, tests/gpu):
a GPT, Linear layers scaled by tensor literals, and a mixture-of-experts layer. Each builder seeds itself, so
every rank builds the same model and batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.models import GPT, GPTConfig
from meshplan.regions.moe import MOE_OP

BATCH = 8


class Scaled(nn.Module):
    """Linear layers, each output scaled by a tensor literal: a lifted constant of the trace, made on the host, so the
    model runs on the CPU only, unless the runtime moves the constant."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x)) * torch.tensor([0.5, 1.0, 1.5, 2.0] * (x.shape[-1] // 4))
        return x


class Experts(nn.Module):
    """A mixture-of-experts layer: meshplan's moe op on its router and experts."""

    def __init__(self, hidden: int = 16, inter: int = 256, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(experts, hidden) * 0.3)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)

    def forward(self, x):
        return MOE_OP(x, self.router, self.gate_up, self.down, 2, True, "silu")


class TinyMoE(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.experts = Experts(hidden)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.head(self.experts(x))


def lm_loss(out, y):
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1))


def gpt():
    """(model, input, target, loss): a 2-layer GPT and its next-token loss."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab_size=64, seq_len=8))
    tokens = torch.randint(0, 64, (BATCH, 8), generator=torch.Generator().manual_seed(1))
    return model, tokens, tokens, lm_loss


def scaled():
    torch.manual_seed(0)
    return Scaled(), torch.randn(BATCH, 8), torch.randn(BATCH, 8), F.mse_loss


def moe(split: int | None = None):
    """With `split`, the tokens enter the experts split that many ways: with the experts split too (param_layouts
    {"experts.gate_up": "S(0)", "experts.down": "S(0)"}), the plan is expert parallel."""
    torch.manual_seed(0)
    model = TinyMoE()
    if split is not None:
        meshplan.shard(model.experts, in_strategy=((split, 1),))
    return model, torch.randn(BATCH, 16), torch.randn(BATCH, 16), F.mse_loss


EXPERT_PARALLEL = dict(param_layouts={"experts.gate_up": "S(0)", "experts.down": "S(0)"})


def pipelined(degree: int = 2) -> dict:
    """Plan options: a pipeline of `degree` stages, 1F1B over two microbatches."""
    return dict(pipeline=meshplan.PipelineOptions(degrees=(degree,), schedules=("1f1b",), microbatch_sizes=(BATCH // 2,)))
