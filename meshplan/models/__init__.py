"""Small reference models used by the demo, the examples and the parity tests."""

from meshplan.models.factories import gpt_small, llama_small, mlp_small
from meshplan.models.gpt import GPT, GPTConfig
from meshplan.models.llama import Llama, LlamaConfig
from meshplan.models.mlp import MLP

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "gpt_small", "llama_small", "mlp_small"]
