"""A tiny Hugging Face Mixtral (mixture of experts; random weights, no download) for docs and the CLI.

Same contract as `meshplan/models/hf.py`: `(model, example_inputs, example_kwargs)` with `labels`.
Each `MixtralSparseMoeBlock` traces as one `meshplan::moe` op (docs/regions.md).
"""

from __future__ import annotations

import torch

from meshplan.models.hf import BATCH, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, _tokens, _transformers

EXPERTS = 4
TOP_K = 2


def hf_mixtral():
    """MixtralForCausalLM: 2 layers, width 64, 4 query / 2 key-value heads, 4 experts (top 2) of 128, vocabulary 128."""
    tf = _transformers()
    cfg = tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=SEQ, router_jitter_noise=0.0, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    tokens = _tokens(1, (BATCH, SEQ))
    return tf.MixtralForCausalLM(cfg), (tokens,), {"labels": tokens}
