"""Tiny Hugging Face transformers models (random weights, no download) for tests, docs and the CLI.

transformers is optional: it is imported when a factory is called, and only the `test` extra
installs it. Each factory follows the `meshplan plan MODULE:FACTORY` contract: it returns
`(model, example_inputs, example_kwargs)`, the kwargs holding `labels` so the model computes its own
loss (the natural way to train a Hugging Face model). Configs use eager/sdpa attention (both trace),
no dropout (so runs compare bit for bit across plans; dropout itself has parity: planner/rules/random.py)
and no KV cache.
"""

from __future__ import annotations

import importlib

import torch

BATCH = 4
SEQ = 16
VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
IMAGE = 16
PATCH = 4
CLASSES = 16

HF_MODELS = ("gpt2", "llama", "bert", "t5", "vit")
"""Names accepted by `hf_model`."""


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("the Hugging Face models need transformers: pip install 'meshplan[test]' (or transformers==5.23.0)") from e


def _tokens(seed: int, shape=(BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def hf_gpt2():
    """GPT2LMHeadModel: 2 layers, width 64, 4 heads, vocabulary 128 (tied embedding and LM head)."""
    tf = _transformers()
    cfg = tf.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    tokens = _tokens(1)
    return tf.GPT2LMHeadModel(cfg), (tokens,), {"labels": tokens.clone()}


def hf_llama(vocab: int = VOCAB):
    """LlamaForCausalLM: 2 layers, width 64, 4 query / 2 key-value heads, SwiGLU 128, vocabulary 128
    (or `vocab`: a large one makes the logits, not the weights, the tensor worth not moving)."""
    tf = _transformers()
    cfg = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ,
        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return tf.LlamaForCausalLM(cfg), (tokens,), {"labels": tokens.clone()}


def hf_bert():
    """BertForMaskedLM: 2 layers, width 64, 4 heads, vocabulary 128; a quarter of the labels are -100."""
    tf = _transformers()
    cfg = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    tokens = _tokens(1)
    labels = tokens.clone()
    labels[:, ::4] = -100  # positions the masked-LM loss ignores
    return tf.BertForMaskedLM(cfg), (tokens,), {"labels": labels}


def hf_t5():
    """T5ForConditionalGeneration: 2 encoder + 2 decoder layers, width 64, 4 heads, vocabulary 128."""
    tf = _transformers()
    cfg = tf.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(cfg), (_tokens(1),), {"labels": _tokens(2, (BATCH, SEQ // 2))}


def hf_vit():
    """ViTForImageClassification: 16x16 RGB images in 4x4 patches, 2 layers, width 64, 16 classes."""
    tf = _transformers()
    cfg = tf.ViTConfig(
        image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=CLASSES, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(2))
    return tf.ViTForImageClassification(cfg), (pixels,), {"labels": labels}


def hf_llama_big_vocab():
    """`hf_llama` with a vocabulary of 32768: 8 MB of logits, which moving costs more than the all-reduces
    of a vocabulary-parallel loss on this machine's gloo links."""
    return hf_llama(vocab=32768)


_FACTORIES = {"gpt2": hf_gpt2, "llama": hf_llama, "bert": hf_bert, "t5": hf_t5, "vit": hf_vit, "llama_big_vocab": hf_llama_big_vocab}


def hf_model(name: str):
    """`(model, example_inputs, example_kwargs)` of the tiny model `name` (one of `HF_MODELS`, or 'llama_big_vocab')."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown Hugging Face model {name!r}; allowed: {', '.join(_FACTORIES)}")
    return _FACTORIES[name]()
