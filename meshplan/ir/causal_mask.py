"""Causal masks made from shapes alone become attention's `is_causal=True` flag.

Hugging Face's models (Llama, Mistral, Qwen2, GPT-2, ...) pass SDPA `is_causal=True` when they run eagerly,
but under `torch.export` they build the causal mask as a tensor from `arange`s and comparisons (their
`_ignore_causal_mask_sdpa` refuses to skip it while exporting). A mask tensor hides from the planner that the
attention is causal, and context parallelism cannot split an arbitrary mask. So where a mask's value depends on
no input, parameter, buffer or constant, it is computed here on the CPU, and where it is exactly the causal
mask (bool: the lower triangle; float: 0 there, -inf or the dtype's lowest value above) the op gets
`is_causal=True` instead: the same numbers, and the mask's ops leave the graph.

A mask of up to `MAX_MASK_ELEMENTS` is computed whole. A larger one (a 131,072-token mask is 16 GiB) is computed
as rows of allowed keys instead (`_allowed_keys`): every op whose output is at most that size runs as it is (the
position and sequence-id vectors Hugging Face compares are S long), and the ops above that size must be
comparisons of a per-query vector with a per-key vector that is sorted along the keys, the `and` of such, or
views. Against a sorted vector each comparison allows one interval of keys per query (`torch.searchsorted` finds
its ends), and their `and` is the intersection of the intervals: exact, in O(S log S). Anything else over the
size (an `or`, a negation, a float mask, keys not sorted) leaves the mask a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MAX_MASK_ELEMENTS = 1 << 24
"""The largest mask (and intermediate) computed whole: 16 MiB of bools; larger ones go by intervals of keys."""
aten = torch.ops.aten
COMPARE = {aten.le.Tensor: "le", aten.lt.Tensor: "lt", aten.ge.Tensor: "ge", aten.gt.Tensor: "gt", aten.eq.Tensor: "eq"}
FLIPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}
"""`u op v` is `v FLIPPED[op] u`."""
AND = (aten.bitwise_and.Tensor, aten.logical_and.default)
VIEWS = (aten.expand.default, aten.alias.default, aten.clone.default)


@dataclass(frozen=True, slots=True)
class Keys:
    """A [..., q, kv] bool mask too large to compute, as the keys each query may see: the interval [lo, hi) of the
    last dim (lo, hi: [..., q], broadcastable to the mask's leading dims)."""

    lo: torch.Tensor
    hi: torch.Tensor
    kv: int


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


def _evaluate(nodes: list[fx.Node]) -> torch.Tensor | Keys | None:
    """The value of the last of `nodes`: a tensor, its `Keys` when it is over `MAX_MASK_ELEMENTS`, or None when an op
    over that size is not one `_allowed_keys` follows."""
    env: dict[fx.Node, object] = {}
    for n in nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > MAX_MASK_ELEMENTS:
            env[n] = _allowed_keys(n.target, args, tuple(val.shape))
            if env[n] is None:
                return None
            continue
        if any(isinstance(a, Keys) for a in (*args, *kwargs.values())):
            return None  # a small value made from a large mask (a reduction, a slice): not followed
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}  # the trace may have run on meta
        env[n] = n.target(*args, **kwargs)
    return env[nodes[-1]]


def _allowed_keys(target, args: tuple, shape: tuple[int, ...]) -> Keys | None:
    """The `Keys` of op `target` on `args` (tensors or `Keys`) giving a bool [..., q, kv] mask of `shape`, or None."""
    if target in VIEWS:
        return args[0] if isinstance(args[0], Keys) and (args[0].lo.shape[-1], args[0].kv) == shape[-2:] else None
    if target in AND:
        a, b = args[:2]
        if isinstance(a, Keys) and isinstance(b, Keys):
            return Keys(torch.maximum(a.lo, b.lo), torch.minimum(a.hi, b.hi), shape[-1])
        keys, flag = (a, b) if isinstance(a, Keys) else (b, a)
        if not isinstance(keys, Keys) or not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool:
            return None
        if flag.dim() and flag.shape[-1] != 1:
            return None  # only a flag per query (or per batch, head, or one for all) keeps an interval of keys
        on = flag.squeeze(-1) if flag.dim() > 1 else flag.reshape(1)
        return Keys(torch.where(on, keys.lo, 0), torch.where(on, keys.hi, 0), shape[-1])
    if target not in COMPARE or not all(isinstance(a, torch.Tensor) for a in args[:2]):
        return None
    a, b = (x if x.dim() >= 2 else x.view(*(1,) * (2 - x.dim()), *x.shape) for x in args[:2])
    op = COMPARE[target]
    if a.shape[-1] == 1 and b.shape[-2] == 1:  # query vector op key vector
        a, b, op = b, a, FLIPPED[op]
    if not (a.shape[-2] == 1 and b.shape[-1] == 1):
        return None
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    dtype = torch.promote_types(a.dtype, b.dtype)
    v = a.squeeze(-2).to(dtype).expand(*lead, shape[-1]).contiguous()  # per key
    u = b.squeeze(-1).to(dtype).expand(*lead, shape[-2]).contiguous()  # per query
    if v.is_floating_point() and (v.isnan().any() or u.isnan().any()):
        return None
    if v.shape[-1] > 1 and not bool((v[..., 1:] >= v[..., :-1]).all()):
        return None  # keys not sorted: the allowed keys of a query need not be an interval
    left, right = torch.searchsorted(v, u), torch.searchsorted(v, u, right=True)
    start, end = torch.zeros_like(left), torch.full_like(left, shape[-1])
    return Keys(*{"le": (start, right), "lt": (start, left), "ge": (left, end), "gt": (right, end), "eq": (left, right)}[op], shape[-1])


def is_causal_mask(mask: torch.Tensor | Keys, q_len: int, kv_len: int) -> bool:
    """`mask` (broadcast to [..., q_len, kv_len]) is SDPA's `is_causal=True` mask (upper-left aligned)."""
    if isinstance(mask, Keys):
        rows = torch.arange(1, q_len + 1)
        return (q_len == kv_len == mask.kv and mask.lo.shape[-1] == q_len
                and bool((mask.lo == 0).all() and (mask.hi == rows).all()))
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
    causal: dict[tuple[fx.Node, int, int], bool] = {}  # a model's layers share one mask: each is evaluated once
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not SDPA:
            continue
        named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), n.args)) | dict(n.kwargs)
        mask = named.get("attn_mask")
        if not isinstance(mask, fx.Node) or named.get("is_causal") or mask.meta.get("val") is None:
            continue
        q, k = named["query"].meta["val"], named["key"].meta["val"]
        key = (mask, q.shape[-2], k.shape[-2])
        if key not in causal:
            nodes = _inputs_only_made_here(mask)
            value = None if nodes is None else _evaluate(nodes)
            causal[key] = value is not None and is_causal_mask(value, q.shape[-2], k.shape[-2])
        if not causal[key]:
            continue
        q_node, k_node, v_node = named.pop("query"), named.pop("key"), named.pop("value")
        named.pop("attn_mask")
        n.args, n.kwargs = (q_node, k_node, v_node), {**named, "is_causal": True}
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten
