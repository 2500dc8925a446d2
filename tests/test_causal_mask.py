"""Causal-mask recognition (ir/causal_mask.py) beyond the size it computes whole: Hugging Face's masks at long
sequences become `is_causal=True`, and every other mask stays a mask, by the same answer as computing it whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from meshplan.ir import causal_mask
from meshplan.ir.causal_mask import is_causal_mask
from meshplan.ir.trace import trace

SDPA = "aten.scaled_dot_product_attention.default"


def _hf(seq: int, window: int | None = None):
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=seq)
    cfg = tf.MistralConfig(sliding_window=window, **shape) if window else tf.LlamaConfig(**shape)
    cfg.use_cache = False
    with torch.device("meta"):
        model = (tf.MistralForCausalLM if window else tf.LlamaForCausalLM)(cfg)
    return model, torch.zeros(1, seq, dtype=torch.long, device="meta")


def _attention_inputs(model, tokens) -> list[int]:
    graph = trace(model, (tokens,), {"labels": tokens})
    return [len(n.inputs) for n in graph.nodes if n.target == SDPA]


def test_hf_mask_at_long_sequences_becomes_the_causal_flag():
    """8,192 tokens: a 2^26-element mask, over the size computed whole; 131,072 (16 GiB as a mask) alike."""
    for seq in (8192, 131072):
        assert seq * seq > causal_mask.MAX_MASK_ELEMENTS
        assert _attention_inputs(*_hf(seq)) == [3]  # q, k, v: the mask is gone


def test_hf_sliding_window_mask_stays_a_mask():
    assert _attention_inputs(*_hf(8192, window=4096)) == [4]  # keys more than 4,096 back are masked: not causal
    assert _attention_inputs(*_hf(16, window=4096)) == [3]  # a window longer than the sequence is the causal mask


S = 16
MASKS = {
    "causal": lambda i, j: j <= i,
    "causal, keys on the left": lambda i, j: i >= j,
    "causal within one segment": lambda i, j: (i // S == j // S) & (j <= i),
    "causal and a flag": lambda i, j: torch.ones((), dtype=torch.bool) & (j <= i),
    "strictly causal": lambda i, j: j < i,
    "shifted": lambda i, j: j <= i + 1,
    "sliding window": lambda i, j: (j <= i) & (j > i - 4),
    "packed segments": lambda i, j: (i // 8 == j // 8) & (j <= i),
    "bidirectional": lambda i, j: j >= 0,
    "anti-causal": lambda i, j: j >= i,
    "or": lambda i, j: (j <= i) | (j == S - 1),
    "keys unsorted": lambda i, j: (S - 1 - j) <= i,
    "a query flag": lambda i, j: (i != 3) & (j <= i),
}


class Masked(torch.nn.Module):
    def __init__(self, rule) -> None:
        super().__init__()
        self.rule = rule

    def forward(self, x):
        q = x.view(1, 1, S, 4)
        pos = torch.arange(S, device=x.device)
        mask = self.rule(pos.view(1, 1, S, 1), pos.view(1, 1, 1, S))
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask.expand(1, 1, S, S))


@pytest.mark.parametrize("name", MASKS)
def test_masks_over_the_size_answer_as_computed_whole(name, monkeypatch):
    """With the whole-mask limit below the mask, the intervals of keys give the answer the whole mask gives."""
    rule = MASKS[name]
    pos = torch.arange(S)
    whole = rule(pos.view(1, 1, S, 1), pos.view(1, 1, 1, S)).expand(1, 1, S, S)
    monkeypatch.setattr(causal_mask, "MAX_MASK_ELEMENTS", 4 * S)  # vectors are computed, the S x S mask is not
    (inputs,) = [len(n.inputs) for n in trace(Masked(rule), (torch.randn(S, 4),)).nodes if n.target == SDPA]
    assert (inputs == 3) == is_causal_mask(whole, S, S)
    assert (inputs == 3) == (name in ("causal", "causal, keys on the left", "causal within one segment", "causal and a flag"))
