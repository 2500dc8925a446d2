"""The op profiler on CUDA: with the launch hidden (the default) an op's timing is its kernels alone.

Skipped without CUDA; run where a GPU is lent with `python -m pytest tests/gpu -m cuda`.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from meshplan.profiling.op_profiler import Timer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _median(timer: Timer, fn, runs: int = 30) -> float:
    return statistics.median([timer(fn) for _ in range(runs + 5)][5:])


def test_hidden_launch_times_the_kernels_alone():
    dev = torch.device("cuda")
    a, b = torch.randn(8, device=dev), torch.randn(8, device=dev)
    tiny = lambda: torch.add(a, b)  # noqa: E731
    hidden, synchronised = Timer(dev, hide_launch=True), Timer(dev, hide_launch=False)
    # a tiny kernel takes a few us on the device; one synchronised run also holds its launch
    assert _median(hidden, tiny) < _median(synchronised, tiny)
    assert hidden.host_s > 0
    # a kernel-bound matrix product: its hidden timing is what 20 of them queued back to back take each
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    mm = lambda: x @ x  # noqa: E731
    one = _median(hidden, mm)
    twenty = _median(Timer(dev), lambda: [x @ x for _ in range(20)], runs=10) / 20
    assert one == pytest.approx(twenty, rel=0.2)


def test_the_spin_grows_with_the_host_and_stays_bounded():
    dev = torch.device("cuda")
    timer = Timer(dev, hide_launch=True)
    waits = lambda: torch.ones(1, device=dev).item()  # noqa: E731  (waits for the GPU, so for the spin too)
    for _ in range(12):  # the spin doubles per call up to its cap: the calls' host time stays bounded
        timer(waits)
    assert timer.host_s < 0.1


def test_a_cuda_profile_prices_no_op_below_the_host_issuing_it():
    import dataclasses

    import meshplan
    from meshplan.ir.mesh import MeshSpec
    from meshplan.ir.trace import trace
    from meshplan.models import GPT, GPTConfig
    from meshplan.profiling.calibrate import profile_graph

    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=2, layers=1)).cuda()
    tokens = torch.randint(0, 128, (2, 16), device="cuda")
    prof = profile_graph(trace(model, (tokens,)), [MeshSpec((1,))], cluster="h200", device="cuda")
    # the host issues a tiny model's ops slower than the GPU runs them: a few us per op run at least
    assert prof.host_op_run_s is not None and 1e-6 < prof.host_op_run_s < 1e-3
    with_host = meshplan.plan(model, 1, (tokens,), cluster="h200", profile=prof).compute_s
    kernels_only = meshplan.plan(model, 1, (tokens,), cluster="h200", profile=dataclasses.replace(prof, host_op_run_s=None)).compute_s
    assert with_host > kernels_only
