"""Context-parallel attention's per-rank math on one CUDA device (regions/attention_blocks.py on the flash and
memory-efficient kernels): each kernel's blocks for P = 4 ranks simulated in one process (tests/_attention_blocks.py)
against plain SDPA, forward and backward, causal and not, bf16 (flash) and fp32 (memory-efficient). The same
simulation runs on the CPU in tests/test_attention_blocks.py, and the CUDA calls on fake tensors there.

Skipped without CUDA; run with `python -m pytest tests/gpu -m cuda`."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/_attention_blocks.py
from _attention_blocks import LAYOUTS, check_against_sdpa  # noqa: E402

from meshplan.regions.attention_blocks import block_forward  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [(layout, causal) for layout in LAYOUTS for causal in (False, True) if causal or not layout.endswith("balanced")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,causal", CASES)
def test_blocks_match_sdpa_on_cuda(layout, causal, dtype):
    check_against_sdpa(layout, "cuda", dtype, causal)


def test_three_ranks_and_a_scale_on_cuda():
    for layout in LAYOUTS:
        check_against_sdpa(layout, "cuda", torch.bfloat16, True, ranks=3, seq=240, head_dim=64, scale=0.3)


def test_the_kernel_each_dtype_runs_on_cuda():
    """bf16 runs the flash kernel from sm80 on (its backward takes 6 saved values), fp32 the memory-efficient one."""
    q = torch.randn(1, 2, 40, 64, device="cuda")
    _, lse, saved = block_forward(q, q, q, True, None)
    assert lse.shape == (1, 2, 40) and len(saved) == 3
    if torch.cuda.get_device_capability()[0] >= 8:
        _, lse, saved = block_forward(q.bfloat16(), q.bfloat16(), q.bfloat16(), True, None)
        assert lse.shape == (1, 2, 40) and lse.dtype == torch.float32 and len(saved) == 6
