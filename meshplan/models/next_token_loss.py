"""A causal language model of one sequence with its next-token loss inside its forward (the whole step in the plan)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class NextTokenLoss(nn.Module):
    """`lm` (tokens [1, S] -> logits [1, S, V]) whose forward returns its next-token loss, so the whole step is in the
    plan (and in its predicted peak). The labels are shifted, not the logits, as Hugging Face's causal-LM loss does
    (`ForCausalLMLoss`: pad with the ignored index, then drop the first): the logits keep all S positions, so they
    split with the sequence. The same loss as slicing the logits to S-1 rows, whose 4,095 rows at 4,096 tokens do not
    split in 4 (docs/long_context.md)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        labels = F.pad(tokens[0], (0, 1), value=-100)[1:]
        return F.cross_entropy(self.lm(tokens)[0], labels, ignore_index=-100)
