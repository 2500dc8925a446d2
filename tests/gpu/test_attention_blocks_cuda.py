"""Context-parallel attention's per-rank math on one CUDA device (regions/attention_blocks.py on the flash and
flash, cuDNN and memory-efficient kernels): each kernel's blocks for P = 4 ranks simulated in one process (tests/_attention_blocks.py)
against plain SDPA, forward and backward, causal and not, bf16 on the kernel SDPA picks and on flash and cuDNN
forced, fp32 (memory-efficient). The same
simulation runs on the CPU in tests/test_attention_blocks.py, and the CUDA calls on fake tensors there.

Skipped without CUDA; run with `python -m pytest tests/gpu -m cuda`."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/_attention_blocks.py
from _attention_blocks import LAYOUTS, check_against_sdpa  # noqa: E402

from meshplan.regions import attention_blocks  # noqa: E402
from meshplan.regions.attention_blocks import block_forward, cuda_kernel  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [(layout, causal) for layout in LAYOUTS for causal in (False, True) if causal or not layout.endswith("balanced")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,causal", CASES)
def test_blocks_match_sdpa_on_cuda(layout, causal, dtype):
    check_against_sdpa(layout, "cuda", dtype, causal)


def test_three_ranks_and_a_scale_on_cuda():
    for layout in LAYOUTS:
        check_against_sdpa(layout, "cuda", torch.bfloat16, True, ranks=3, seq=240, head_dim=64, scale=0.3)


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("layout", ["ring", "balanced"])
def test_blocks_on_each_bf16_kernel_on_cuda(monkeypatch, layout, kernel):
    """Whichever kernel SDPA would pick, each one's blocks merge right (the ring's diagonal and whole blocks, the
    balanced kernel's gathered keys)."""
    monkeypatch.setattr(attention_blocks, "cuda_kernel", lambda q, k, v, causal: kernel)
    check_against_sdpa(layout, "cuda", torch.bfloat16, True)


def test_blocks_run_the_kernel_sdpa_picks_on_cuda():
    """fp32 runs the memory-efficient kernel; bf16 the one SDPA itself picks for the same shapes."""
    q = torch.randn(1, 2, 40, 64, device="cuda")
    _, lse, saved = block_forward(q, q, q, True, None)
    assert lse.shape == (1, 2, 40) and saved[0] == "efficient"
    b = q.bfloat16()
    _, lse, saved = block_forward(b, b, b, True, None)
    assert lse.shape == (1, 2, 40) and lse.dtype == torch.float32 and saved[0] == cuda_kernel(b, b, b, True)
    print(f"bf16 blocks on {torch.cuda.get_device_name()}: {saved[0]}")
