"""Small reference models used by the demo, the examples and the parity tests."""

from meshplan.models.gpt import GPT, GPTConfig
from meshplan.models.llama import Llama, LlamaConfig
from meshplan.models.mlp import MLP

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP"]
