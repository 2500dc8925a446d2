"""Ring attention run by torch's own context-parallel templates: the `cp_attention(torch_ring)` kernel.

`torch.distributed.tensor.experimental.context_parallel` runs SDPA on a sequence-split DTensor through
`_templated_ring_attention` and `_templated_ring_attention_backward`, templates over an attention op. Its entry points
dispatch only CUDA's SDPA ops; the templates themselves take any op that returns the output and its log-sum-exp. This
kernel hands them `attention_blocks.block_forward` / `block_backward` (the CPU flash kernel; on CUDA the kernel SDPA
picks), with grouped-query heads repeated per block and their gradients summed back, so torch's ring runs on the CPU
with gloo as on GPUs, K and V travelling with their own heads.

Torch's options as torchtitan sets them for a causal model: head-tail load balancing (rank r holds chunks r and
2P-1-r, the plan's token order, `runtime/token_order.py`) and the all-to-all rotation (K and V passed P-1 times
to the next rank; torch's default all-gathers them once). Backward passes K and V round again (P-1 exchanges) and the
dK/dV sums in fp32 (P exchanges, the last one home), as `ContextParallel.cost` prices it.

Torch issues the collectives (functional `all_to_all_single`), so they are counted as observed: each one the call
issues is a `send_recv` of its phase. The templates read process-wide options (`_cp_options`), set for the call and
put back. Under `torch.compile` the kernel runs eagerly (`torch_ring_attention`), so its exchanges stay the plan's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.regions.attention_blocks import SEQ, block_backward, block_forward, repeat_heads, sum_heads
from meshplan.runtime.collectives import MeshComm, count_collective, forward_phase

ISSUED = (torch.ops._c10d_functional.all_to_all_single.default,)
"""The functional collectives torch's all-to-all rotation issues (`permute_tensor`)."""


class _Issued(TorchDispatchMode):
    """Counts each collective of `ISSUED` run inside it as a `send_recv` of `phase` (`count_collective`)."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ISSUED:
            count_collective(self.phase, "send_recv")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _torch_ring(comm: MeshComm, axis: int, phase: str) -> Iterator[None]:
    """Torch's options for the call (load balanced, all-to-all rotation, fp32 merging), its collectives counted as
    `phase:send_recv` and its failures guarded."""
    options = torch_cp._cp_options
    before = options.enable_load_balance, options.rotate_method, options.convert_to_f32
    options.enable_load_balance, options.rotate_method, options.convert_to_f32 = True, torch_cp._RotateMethod.ALL_TO_ALL, True
    try:
        with comm.guard(f"{phase} ring attention (torch's) over mesh axis {comm.mesh.axis_names[axis]}"), _Issued(phase):
            yield
    finally:
        options.enable_load_balance, options.rotate_method, options.convert_to_f32 = before


class TorchRingAttention(torch.autograd.Function):
    """Causal attention of this rank's two head-tail chunks of q, k, v ([batch, heads, seq, head_dim]) over mesh axis
    `axis`, by torch's ring templates. Every block's kernel state (on CUDA its saved values) is kept in call order:
    torch's backward calls the op on the same blocks in the same order."""

    @staticmethod
    def forward(ctx, q, k, v, scale, axis: int, comm: MeshComm):
        blocks: list[tuple] = []

        def attend(query, key, value, is_causal: bool, **_):
            out, lse, saved = block_forward(query, repeat_heads(key, q.shape[1]), repeat_heads(value, q.shape[1]), is_causal, scale)
            blocks.append(saved)
            return out, lse

        with _torch_ring(comm, axis, forward_phase()):
            out, lse = torch_cp._templated_ring_attention(comm.group((axis,)), SEQ, attend, q, k, v, is_causal=True)
        ctx.scale, ctx.axis, ctx.comm, ctx.blocks = scale, axis, comm, blocks
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        blocks = iter(ctx.blocks)

        def attend_backward(*, grad_out, query, key, value, out, logsumexp, is_causal: bool, **_):
            heads = query.shape[1]
            dq, dk, dv = block_backward(grad_out, query, repeat_heads(key, heads), repeat_heads(value, heads), out, logsumexp,
                                        next(blocks), is_causal, ctx.scale)
            return dq, sum_heads(dk, key.shape[1]), sum_heads(dv, value.shape[1])

        with _torch_ring(ctx.comm, ctx.axis, "backward"):
            dq, dk, dv = torch_cp._templated_ring_attention_backward(ctx.comm.group((ctx.axis,)), SEQ, attend_backward,
                                                                     grad.contiguous(), "grad_out", q, k, v, out, lse, True)
        return dq, dk, dv, None, None, None


@torch.compiler.disable(reason="torch's ring templates run eagerly: traced, AOTAutograd rearranges their exchanges")
def torch_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale, axis: int, comm: MeshComm) -> torch.Tensor:
    """`TorchRingAttention`, run eagerly under `torch.compile` (a graph break on each side). Traced (2 gloo ranks, GPT,
    the min-cut partitioner), AOTAutograd's common-subexpression pass merged the backward's K/V rotation into the
    forward's identical one (4 of the plan's 6 backward exchanges ran, the received blocks held from forward to
    backward), and with that pass off the forward ran 2 exchanges more than the plan's 2: neither is what the plan
    prices. Eagerly the exchanges are the plan's, counted as in an eager step."""
    return TorchRingAttention.apply(q, k, v, scale, axis, comm)


__all__ = ["torch_ring_attention"]
