"""Pipeline runtime parity on real gloo processes: loss and gradients of a tiny GPT against one process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from meshplan.cost_model.memory import MemoryBreakdown
from meshplan.models import GPT, GPTConfig
from meshplan.planner.pipeline_plan import PipelinePlan, PipelineStage
from meshplan.runtime.launch import run_local

BATCH, SEQ, VOCAB = 8, 8, 64
CFG = dict(layers=4, hidden=32, heads=2, vocab_size=VOCAB, seq_len=SEQ)


def loss_fn(out, y):
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1))


def data():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, x


def pipe_plan(schedule: str, degree: int, micro: int, starts: list[str]) -> PipelinePlan:
    zero = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0)
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    stages = tuple(
        PipelineStage(index=k, device=k % degree, units=(m,), modules=(m,), time_s=0.0, recompute=False, memory=zero) for k, m in enumerate(starts)
    )
    assert len(stages) == degree * v
    return PipelinePlan(degree=degree, schedule=schedule, microbatches=micro, chunks=v, stages=stages, step_s=0.0, bubble_s=0.0,
                        bubble_fraction=0.0, p2p_s=0.0)


def worker(rank, world, cases):
    from meshplan.runtime.pipeline import PipelineRunner

    warnings.simplefilter("ignore")
    out = []
    for pipe, dp in cases:
        model, x = data()
        local = x.chunk(dp)[rank % dp]
        runner = PipelineRunner(model, pipe, (local[: local.shape[0] // pipe.microbatches],), loss_fn, data=dp)
        loss = runner.step(local, local)
        out.append((None if loss is None else float(loss), {n: p.grad.clone() for n, p in runner.named_parameters()}))
    return out


CASES = [
    (pipe_plan("gpipe", 2, 2, ["wte", "layers.2"]), 1),
    (pipe_plan("1f1b", 2, 4, ["wte", "layers.1"]), 1),
    (pipe_plan("interleaved_1f1b", 2, 2, ["wte", "layers.1", "layers.2", "layers.3"]), 1),
    (pipe_plan("1f1b", 2, 2, ["wte", "layers.2"]), 2),
]


@pytest.mark.multiprocess
def test_pipeline_parity_world2_and_4():
    model, x = data()
    ref_loss = loss_fn(model(x), x)
    ref_loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    results2 = run_local(2, worker, CASES[:3], timeout=600)
    results4 = run_local(4, worker, CASES[3:], timeout=600)
    for i, (pipe, dp) in enumerate(CASES):
        results = results2 if dp == 1 else results4
        idx = i if dp == 1 else i - 3
        losses = [r[idx][0] for r in results if r[idx][0] is not None]
        # each data-parallel replica reports its own shard's loss; their mean is the whole batch's
        assert len(losses) == dp and abs(sum(losses) / dp - ref_loss.item()) < 1e-5, (pipe.schedule, losses, ref_loss.item())
        seen = set()
        for r in results:
            for name, g in r[idx][1].items():
                torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{pipe.schedule} dp={dp} {name}: {m}")
                seen.add(name)
        assert seen == set(ref), set(ref) ^ seen  # every parameter checked on some rank
