"""Factories for the `meshplan plan MODULE:FACTORY` command: each returns `(model, example_inputs)`.

The contract (also in docs/cli.md): a factory is a callable taking no arguments that returns
`(model, example_inputs)` with `example_inputs` a tuple (or a single tensor), or
`(model, example_inputs, example_kwargs)`; or it returns a model with an `example_inputs()` method.
A factory may build its model on the meta device: planning needs only shapes.
"""

from __future__ import annotations

import torch

from meshplan.models.gpt import GPT, GPTConfig
from meshplan.models.llama import Llama, LlamaConfig
from meshplan.models.mlp import MLP

BATCH = 8
"""Example batch size of the small factories (divisible by the device counts tests use)."""


def gpt_small() -> tuple[GPT, tuple[torch.Tensor]]:
    """The demo GPT (2 layers, width 64, vocabulary 128) with a batch of 8 sequences of 16 tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    return model, (torch.randint(0, model.cfg.vocab_size, (BATCH, model.cfg.seq_len)),)


def llama_small() -> tuple[Llama, tuple[torch.Tensor]]:
    """The demo Llama (2 layers, width 64, grouped-query attention) with a batch of 8 x 16 tokens."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    return model, (torch.randint(0, model.cfg.vocab_size, (BATCH, model.cfg.seq_len)),)


def mlp_small() -> tuple[MLP, tuple[torch.Tensor]]:
    """A 3-layer MLP (32 -> 64 -> 64 -> 16) with a batch of 8."""
    torch.manual_seed(0)
    return MLP(), (torch.randn(BATCH, 32),)

