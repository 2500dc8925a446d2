"""Causal masks made from shapes alone become attention's `is_causal=True` flag.

Hugging Face's models (Llama, Mistral, Qwen2, GPT-2, ...) pass SDPA `is_causal=True` when they run eagerly,
but under `torch.export` they build the causal mask as a tensor from `arange`s and comparisons (their
`_ignore_causal_mask_sdpa` refuses to skip it while exporting). A mask tensor hides from the planner that the
attention is causal, and context parallelism cannot split an arbitrary mask. So where a mask's value depends on
no input, parameter, buffer or constant, it is computed here once, on the CPU, and where it is exactly the causal
mask (bool: the lower triangle; float: 0 there, -inf or the dtype's lowest value above) the op gets
`is_causal=True` instead: the same numbers, and the mask's ops leave the graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MAX_MASK_ELEMENTS = 1 << 24
"""A larger mask is left a mask: computing it to check it would take memory planning should not (16 MiB at this size;
a 131,072-token mask is 16 GiB)."""


def _inputs_only_made_here(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes computing `mask`, in graph order, or None when one of them reads a placeholder (data)."""
    seen: dict[fx.Node, None] = {}
    todo = [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op != "call_function":
            return None
        seen[n] = None
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(nodes: list[fx.Node]) -> torch.Tensor:
    env: dict[fx.Node, object] = {}
    for n in nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}  # the trace may have run on meta
        env[n] = n.target(*args, **kwargs)
    return env[nodes[-1]]


def is_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """`mask` (broadcast to [..., q_len, kv_len]) is SDPA's `is_causal=True` mask (upper-left aligned)."""
    if mask.shape[-2:] != (q_len, kv_len):
        return False
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.is_floating_point():
        return False
    lowest = torch.finfo(mask.dtype).min
    return bool((mask.masked_select(allowed) == 0).all() and (mask.masked_select(~allowed) <= lowest).all())


def causal_masks_to_flags(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA node whose mask is a causal mask made from shapes alone (module doc); returns how many."""
    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not SDPA:
            continue
        named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), n.args)) | dict(n.kwargs)
        mask = named.get("attn_mask")
        if not isinstance(mask, fx.Node) or named.get("is_causal"):
            continue
        meta = mask.meta.get("val")
        if meta is None or meta.numel() > MAX_MASK_ELEMENTS:
            continue
        nodes = _inputs_only_made_here(mask)
        if nodes is None:
            continue
        q, k = named["query"].meta["val"], named["key"].meta["val"]
        if not is_causal_mask(_evaluate(nodes), q.shape[-2], k.shape[-2]):
            continue
        q_node, k_node, v_node = named.pop("query"), named.pop("key"), named.pop("value")
        named.pop("attn_mask")
        n.args, n.kwargs = (q_node, k_node, v_node), {**named, "is_causal": True}
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten
