"""Attention by blocks merged by log-sum-exp (regions/attention_blocks.py), each context-parallel kernel's per-rank
math simulated for P ranks in one process (tests/_attention_blocks.py), against plain SDPA on the CPU; the CUDA
kernels' calls on fake CUDA tensors (their schemas and log-sum-exp layouts; tests/gpu/test_attention_blocks_cuda.py
runs the same simulation on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from _attention_blocks import LAYOUTS, check_against_sdpa
from meshplan.regions import attention_blocks
from meshplan.regions.attention_blocks import block_backward, block_forward, merge_blocks
from meshplan.regions.context_parallel import ContextParallelAttention, busiest_rank

CASES = [(layout, causal) for layout in LAYOUTS for causal in (False, True) if causal or not layout.endswith("balanced")]
"""Balanced chunks exist for causal masks only (without one every rank already does the same work)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,causal", CASES)
def test_blocks_match_sdpa_on_the_cpu(layout, causal, dtype):
    check_against_sdpa(layout, "cpu", dtype, causal)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_three_ranks_and_a_scale(layout):
    check_against_sdpa(layout, "cpu", torch.float32, True, ranks=3, seq=240, head_dim=16, scale=0.3)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float16, "cudnn"), (torch.float32, "efficient")])
def test_cuda_kernel_calls_on_fake_cuda_tensors(monkeypatch, dtype, kernel):
    """Each CUDA kernel a block may run (flash, cuDNN, memory-efficient, which pads its log-sum-exp to 32 rows; cuDNN's
    has a trailing 1): each block's log-sum-exp comes out [batch, heads, rows] fp32 as the merge needs, and the
    backward takes the merged one back in the layout its kernel gave. Runs the aten ops' fake kernels, so a wrong
    argument order or count fails here. Which kernel SDPA picks needs a real GPU (tests/gpu)."""
    monkeypatch.setattr(attention_blocks, "cuda_kernel", lambda q, k, v, causal: kernel)
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 40, 16, device="cuda", dtype=dtype) for _ in range(3))
        blocks = [block_forward(q, k, v, causal, None) for causal in (False, True)]
        assert all(lse.shape == (2, 4, 40) and lse.dtype == torch.float32 for _, lse, _ in blocks)
        assert all(saved[0] == kernel and len(saved) == (4 if kernel == "efficient" else 7) for _, _, saved in blocks)
        out, lse = merge_blocks([o for o, _, _ in blocks], [lse for _, lse, _ in blocks], dtype)
        for causal, (_, _, saved) in zip((False, True), blocks):
            grads = block_backward(out, q, k, v, out, lse, saved, causal, None)
            assert [tuple(g.shape) for g in grads] == [(2, 4, 40, 16)] * 3 and all(g.dtype == dtype for g in grads)


def test_other_devices_are_refused():
    q = torch.empty(1, 2, 8, 16, device="meta")
    with pytest.raises(ValueError, match="context-parallel attention runs attention by blocks on cpu or cuda .*; got tensors on meta"):
        block_forward(q, q, q, True, None)
    # the rank's kernel refuses before any collective (no communicator is reached)
    with pytest.raises(ValueError, match=r"cp_attention\(ring,causal\) runs .* got tensors on meta. Plan with force_context_parallel\('ulysses'\)"):
        ContextParallelAttention("ring", True, 0, None)(q, q, q, is_causal=True)


def test_the_busiest_rank_the_profiler_times():
    """The last rank of a contiguous causal split computes the most pairs; balanced (or without a mask) all alike."""
    assert [busiest_rank(layout, 4, True) for layout in LAYOUTS] == [3, 0, 3, 0]
    assert [busiest_rank(layout, 4, False) for layout in ("ring", "allgather")] == [0, 0]
