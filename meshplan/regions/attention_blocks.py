"""Attention by blocks of keys merged by their log-sum-exp, on the CPU and on CUDA: what each rank of a
context-parallel kernel computes (`regions/context_parallel.py`).

A block is one fused attention call that also returns the log-sum-exp of each query row's scores (natural log,
fp32, [batch, heads, rows]): the CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`); on CUDA the
kernel torch's SDPA itself picks for the block (`cuda_kernel`: flash, cuDNN or memory-efficient), so a rank's blocks
run what one SDPA over the whole sequence runs. The memory-efficient kernel pads its log-sum-exp to a multiple of 32
rows, cuDNN's has a trailing dimension of 1. Blocks merge exactly: with l_i a block's log-sum-exp and
l = logsumexp_i(l_i), the output is sum_i exp(l_i - l) o_i. Backward runs each block's own backward with the
merged output and log-sum-exp, which gives each block's share of the whole softmax's gradient (ring attention's
backward). No mask tensor and no score matrix exist.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

aten = torch.ops.aten
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
FLASH_CUDA = aten._scaled_dot_product_flash_attention.default
FLASH_CUDA_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default
CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention_backward.default
DEVICES = ("cpu", "cuda")
"""Device types with a fused attention kernel that returns the log-sum-exp."""
SEQ = 2
"""q, k, v and the output are [batch, heads, seq, head_dim]."""


def check_device(device: torch.device, what: str, hint: str = "") -> None:
    if device.type not in DEVICES:
        raise ValueError(f"{what} runs attention by blocks on {' or '.join(DEVICES)} (a fused kernel that returns the "
                         f"log-sum-exp); got tensors on {device}{hint}")


def cuda_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The fused kernel torch's SDPA would run for this block ("flash", "cudnn" or "efficient"), under the backends
    the user enabled. On an H100, torch 2.11, the busiest rank's blocks took 1.9-2.9x their share of one SDPA over the
    whole sequence on the flash kernel, 1.2-1.9x on the one SDPA picks (cuDNN; benchmarks/gpu_cp_blocks.py). SDPA's
    math path returns no log-sum-exp: where it is all that is left, the blocks run the memory-efficient kernel."""
    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=causal))
    return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.CUDNN_ATTENTION: "cudnn"}.get(choice, "efficient")


def block_forward(q, k, v, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(output, log-sum-exp [batch, heads, rows] fp32, what `block_backward` needs: on CUDA the kernel's name and its
    saved values) of q against one block of keys, whole or a causal diagonal (query i sees keys <= i)."""
    check_device(q.device, "context-parallel attention")
    if q.device.type == "cpu":
        out, lse = FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    kernel = cuda_kernel(q, k, v, causal)
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = FLASH_CUDA(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (kernel, cum_q, cum_k, max_q, max_k, seed, offset)
    if kernel == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = CUDNN(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, lse.squeeze(-1), (kernel, cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, seed, offset = EFFICIENT(q, k, v, None, True, 0.0, causal, scale=scale)
    # its rows padded to a multiple of 32 (copied out, not viewed: the CPU tests run these calls on fake CUDA tensors,
    # where a slice view cannot be made)
    return out, lse.narrow_copy(-1, 0, q.shape[SEQ]), (kernel, seed, offset, lse.shape[-1])


def block_backward(grad, q, k, v, out, lse, saved: tuple, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the merged `out` and `lse` and the block's `saved` from `block_forward`."""
    if q.device.type == "cpu":
        return FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, scale=scale)
    kernel, *saved = saved
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return FLASH_CUDA_BACKWARD(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    if kernel == "cudnn":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return CUDNN_BACKWARD(grad, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
                              scale=scale)
    seed, offset, padded = saved
    lse = torch.cat([lse, lse.new_zeros(*lse.shape[:-1], padded - lse.shape[-1])], dim=-1)  # the layout the forward returned
    dq, dk, dv, _ = EFFICIENT_BACKWARD(grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values ([batch, kv heads, seq, head_dim]) repeated to `heads` query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def sum_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of `repeat_heads`: each group of repeated heads summed back to one of `heads`."""
    b, h, s, d = grad.shape
    return grad if h == heads else grad.view(b, heads, h // heads, s, d).sum(2)


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in `dtype`, log-sum-exp) of the blocks together, merged in fp32."""
    lse = torch.logsumexp(torch.stack([x.float() for x in lses]), dim=0)
    out = sum(o.float() * (part - lse).exp().unsqueeze(-1) for o, part in zip(outs, lses))
    return out.to(dtype), lse


class BlockAttention(torch.autograd.Function):
    """q against key/value blocks, each whole or causal (a diagonal block: query i sees keys <= i), one fused kernel
    call per block, merged by log-sum-exp. Backward runs each block's backward with the merged output and
    log-sum-exp; the query gradient is summed in fp32."""

    @staticmethod
    def forward(ctx, q, scale, causal: tuple[bool, ...], *kv):
        outs, lses, saved = [], [], []
        for i, is_causal in enumerate(causal):
            o, lse, s = block_forward(q, kv[2 * i], kv[2 * i + 1], is_causal, scale)
            outs.append(o)
            lses.append(lse)
            saved.append(s)
        out, lse = merge_blocks(outs, lses, q.dtype)
        ctx.scale, ctx.causal, ctx.blocks = scale, causal, saved
        ctx.save_for_backward(q, out, lse, *kv)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, out, lse, *kv = ctx.saved_tensors
        grad, grad_q, grad_kv = grad.contiguous(), torch.zeros_like(q, dtype=torch.float32), []
        for i, is_causal in enumerate(ctx.causal):
            dq, dk, dv = block_backward(grad, q, kv[2 * i], kv[2 * i + 1], out, lse, ctx.blocks[i], is_causal, ctx.scale)
            grad_q += dq
            grad_kv += [dk, dv]
        return (grad_q.to(q.dtype), None, None, *grad_kv)
