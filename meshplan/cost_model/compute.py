"""Compute time of one ATen op: FLOPs and bytes from tensor metas, then a roofline.

Exact formulas cover the ops that dominate training time (matmuls, attention, convolutions, norms,
softmax); everything else gets a cheap default. The formulas work on whatever shapes they are
given: pass global metas for global FLOPs or a device's local metas for its share.

Matmul-family formulas follow `torch.utils.flop_counter` (bias additions of addmm/baddbmm are not
counted) so the cost-model fidelity benchmarks compare like with like against `FlopCounterMode`.
"""

from __future__ import annotations

import math
import re

from ..ir.graph import TensorMeta
from .presets import DevicePreset

BACKWARD_FACTOR = 2.0
"""Backward FLOPs / forward FLOPs. A matmul's backward is two matmuls of the same size (grad of
input and grad of weight); elementwise ops are close to that ratio too. Used when the graph holds
only the forward."""

_VIEW_OPS = frozenset(
    "view _unsafe_view reshape _reshape_alias view_as permute transpose t expand expand_as unsqueeze "
    "squeeze slice select split split_with_sizes unbind chunk narrow flatten unflatten alias detach "
    "as_strided".split()
)
# Ops that move data without arithmetic: 0 FLOPs but they do read and write memory.
_MOVE_OPS = frozenset(
    "embedding index_select gather index cat stack clone copy copy_ _to_copy contiguous "
    "scatter new_zeros zeros_like ones_like empty_like full_like fill_ zero_".split()
)
_SDPA_OPS = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)
_DENSE_OPS = frozenset("mm addmm bmm baddbmm matmul linear convolution".split())
_NORM_FLOPS_PER_ELEM = 8.0  # mean, var (sub, square, sum), rsqrt, normalise, scale, shift
_SOFTMAX_FLOPS_PER_ELEM = 5.0  # max, sub, exp, sum, div


def _op_name(target: str) -> str:
    """`"aten.mm.default"` / `"aten::mm"` / `"mm"` -> `"mm"`."""
    return re.sub(r"^aten(\.|::)", "", target).split(".", 1)[0]


def is_view(target: str) -> bool:
    """True for ops that only reinterpret storage: free in FLOPs and in bytes."""
    return _op_name(target) in _VIEW_OPS


def is_dense(target: str) -> bool:
    """Matmuls, convolutions and attention: the ops "model FLOPs" (MFU) count."""
    return _op_name(target) in _DENSE_OPS or _op_name(target) in _SDPA_OPS


def _tensors(metas: list[TensorMeta | None]) -> list[TensorMeta]:
    return [m for m in metas if m is not None]


def _need(target: str, inputs: list[TensorMeta], count: int, ndims: tuple[int, ...]) -> None:
    if len(inputs) < count:
        raise AssertionError(f"{target}: expected {count} tensor inputs, got {len(inputs)}")
    for i, nd in enumerate(ndims):
        if len(inputs[i].shape) < nd:
            raise AssertionError(f"{target}: input {i} {inputs[i]} needs at least {nd} dims")


def attention_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """Query-key pairs attention computes: all of them, or those SDPA's `is_causal` mask keeps (upper-left
    aligned: query i sees keys 0..i). The flash and memory-efficient kernels skip the masked blocks, so this,
    not the whole rectangle, is their work (up to the half-masked blocks on the diagonal)."""
    if not causal:
        return q_len * kv_len
    seen = min(q_len, kv_len)  # rows 0..seen-1 see i+1 keys, later rows all of them
    return seen * (seen + 1) // 2 + (q_len - seen) * kv_len


def op_flops(target: str, inputs: list[TensorMeta], outputs: list[TensorMeta | None], *, causal: bool = False) -> float:
    """Forward FLOPs of one op (a multiply-add counts 2). `causal`: an attention op called with `is_causal=True`,
    counted at the pairs its mask keeps (`attention_pairs`) where `FlopCounterMode` counts the whole rectangle."""
    name = _op_name(target)
    if causal and name not in _SDPA_OPS:
        raise ValueError(f"causal=True prices attention ops ({', '.join(sorted(_SDPA_OPS))}); got {target!r}")
    ins, outs = _tensors(inputs), _tensors(outputs)
    if name in _VIEW_OPS or name in _MOVE_OPS:
        return 0.0
    if name == "mm":  # [M,K] @ [K,N]
        _need(target, ins, 2, (2, 2))
        (m, k), n = ins[0].shape, ins[1].shape[1]
        return 2.0 * m * k * n
    if name == "addmm":  # bias + [M,K] @ [K,N]
        _need(target, ins, 3, (0, 2, 2))
        (m, k), n = ins[1].shape, ins[2].shape[1]
        return 2.0 * m * k * n
    if name in ("bmm", "baddbmm"):  # [B,M,K] @ [B,K,N]
        a, b = (ins[0], ins[1]) if name == "bmm" else (ins[1], ins[2])
        _need(target, [a, b], 2, (3, 3))
        bsz, m, k = a.shape
        return 2.0 * bsz * m * k * b.shape[2]
    if name in ("matmul", "linear") and outs:  # 2 FLOPs per output element per reduced element
        _need(target, ins, 2, (1,))
        return 2.0 * outs[0].numel * ins[0].shape[-1]
    if name in _SDPA_OPS:  # q [..., S, D], k [..., Skv, D], v [..., Skv, Dv]: QK^T then AV
        _need(target, ins, 3, (2, 2, 2))
        q, k, v = ins[:3]
        batch_heads = math.prod(q.shape[:-2])
        s, d, skv, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        return 2.0 * batch_heads * attention_pairs(s, skv, causal) * (d + dv)
    if name == "convolution" and outs:  # out [N, Cout, *spatial], weight [Cout, Cin/groups, *kernel]
        # Assumes a forward (not transposed) convolution: the metas alone cannot tell them apart.
        _need(target, ins, 2, (0, 2))
        return 2.0 * outs[0].numel * math.prod(ins[1].shape[1:])
    if name == "native_layer_norm":
        _need(target, ins, 1, (0,))
        return _NORM_FLOPS_PER_ELEM * ins[0].numel
    if name in ("_softmax", "_log_softmax", "softmax", "log_softmax"):
        _need(target, ins, 1, (0,))
        return _SOFTMAX_FLOPS_PER_ELEM * ins[0].numel
    # Default, pointwise or reduction: ~1 FLOP per element of the largest tensor involved, which is
    # the output of a (broadcasting) pointwise op and the input of a reduction.
    return float(max((t.numel for t in ins + outs), default=0))


def op_bytes(target: str, inputs: list[TensorMeta], outputs: list[TensorMeta | None]) -> float:
    """Bytes the op reads plus bytes it writes (every input once, every output once)."""
    name = _op_name(target)
    if name in _VIEW_OPS:
        return 0.0
    ins, outs = _tensors(inputs), _tensors(outputs)
    written = sum(t.nbytes for t in outs)
    if name == "embedding" and len(ins) >= 2:
        # Reads only the looked-up rows (as many bytes as the output) and the indices.
        return float(ins[1].nbytes + 2 * written)
    return float(sum(t.nbytes for t in ins) + written)


def roofline_time(flops: float, nbytes: float, device: DevicePreset, dtype: str) -> float:
    """Seconds for an op on `device`: bound by compute or by memory traffic, whichever is slower."""
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and nbytes must be >= 0; got flops={flops!r}, nbytes={nbytes!r}")
    return max(flops / device.peak(dtype), nbytes / device.memory_bandwidth)


def op_time(target: str, inputs: list[TensorMeta], outputs: list[TensorMeta | None], device: DevicePreset) -> float:
    """Forward seconds of one op: roofline at the dtype of its first floating-point tensor."""
    if is_view(target):
        return 0.0
    dtype = next((t.dtype for t in _tensors(inputs) + _tensors(outputs) if t.torch_dtype.is_floating_point), "float32")
    return roofline_time(op_flops(target, inputs, outputs), op_bytes(target, inputs, outputs), device, dtype)
