"""The token batches and the loss the training scripts share: step k's batch is a function of k alone, so a resumed
run, or a run on another world, sees the same data."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def batch(step: int, size: int, vocab_size: int, seq_len: int) -> torch.Tensor:
    """`size` sequences of arithmetic token progressions, drawn from a generator seeded by `step`."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab_size, (size, 1), generator=gen)
    stride = torch.randint(1, 5, (size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab_size


def next_token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
