"""meshplan.elastic's pieces and its errors: the batch cut per world, the smallest world a plan fits, the plan store,
a resume under another world, the checkpoint of another model or global batch, and the save on SIGTERM."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F

from meshplan.elastic import ElasticRun, plan_for_world, split_batch
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.launch import run_local

CFG = GPTConfig(layers=1)


def _batch(step: int, n: int = 8) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=torch.Generator().manual_seed(step))


def test_the_global_batch_is_cut_per_world_or_refused():
    assert [(s.accumulation, s.micro_batch, s.per_rank) for s in (split_batch(8, w, 2) for w in (1, 2, 4, 8))] == [
        (4, 2, 2), (2, 4, 2), (1, 8, 2), (1, 8, 1)]
    assert split_batch(8, 2).accumulation == 1  # no per-rank limit: one micro-batch
    with pytest.raises(ValueError, match=r"global batch 8 cannot be split over 3 ranks: .* World sizes that split it: \[1, 2, 4, 8\]"):
        split_batch(8, 3)
    with pytest.raises(ValueError, match=r"over 16 ranks with at most 2 samples per rank"):
        split_batch(8, 16, 2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"global_batch must be a positive int; got"):
            split_batch(bad, 2)


def test_a_world_no_plan_fits_names_the_smallest_that_does():
    model, x = GPT(CFG), _batch(0)
    # peaks on this model: 1,599,616 bytes per device on 1 device, 1,475,968 on 2
    with pytest.raises(ValueError, match=r"no plan fits 1 rank \(memory budget .*\); the smallest world that works is 2 ranks"):
        plan_for_world(model, 1, lambda w: (x,), global_batch=8, micro_batch=None, max_world=4, memory_budget=1_500_000)
    with pytest.raises(ValueError, match=r"no plan fits 1 rank .* nor any world up to 2 ranks"):
        plan_for_world(model, 1, lambda w: (x,), global_batch=8, micro_batch=None, max_world=2, memory_budget=100_000)


def test_torchruns_shared_store_is_refused_with_the_variable_that_fixes_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ValueError, match=r"needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .*TORCHELASTIC_RESTART_COUNT=2"):
        _start(str(tmp_path))


def _loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))


def _start(root, cfg=CFG, global_batch=8, **kw):
    torch.manual_seed(0)
    return ElasticRun.start(GPT(cfg), (_batch(0, global_batch),), checkpoint_dir=root, global_batch=global_batch,
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **kw)


def _train(run, total, kill_at=None):
    losses = []
    for step in run.steps(total):
        loss = 0.0
        for tokens in run.micro_batches(_batch(step)):
            part = _loss(run.model, tokens) / run.split.accumulation
            part.backward()
            loss += part.item()
        run.optimizer.step()
        run.optimizer.zero_grad()
        losses.append(loss)
        run.extra["samples"] = step * run.split.global_batch  # the data position, saved with every checkpoint
        if step == kill_at and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # preemption: this rank alone is told
    return losses


def _save_on_sigterm_then_resume_elsewhere(rank, world, root):
    run = _start(root, micro_batch=2, checkpoint_every=2)
    assert (run.plan_source, run.split.accumulation) == ("planned", 2 if world == 2 else 4)
    try:
        _train(run, 6, kill_at=3)
    except SystemExit as e:
        stopped = str(e)
    return run.step, stopped, sorted(os.listdir(os.path.join(root, "ckpt")))


def _resume(rank, world, root):
    run = _start(root, micro_batch=2, checkpoint_every=2)
    resumed = (run.plan_source, os.path.basename(run.resumed_from), run.step, run.split.accumulation, dict(run.extra))
    losses = _train(run, 5)
    again = _start(root, micro_batch=2)  # the same world again: its plan comes from the store
    return resumed, losses, again.plan_source


def _uninterrupted(rank, world, root):
    return _train(_start(root, micro_batch=2), 5)


def _refused(rank, world, root):
    errors = {}
    for name, call in {
        "model": lambda: _start(root, cfg=GPTConfig(layers=1, hidden=32)),
        "batch": lambda: _start(root, global_batch=4),
        "step batch": lambda: next(_start(root).micro_batches(_batch(0, 6))),
    }.items():
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    return errors


@pytest.mark.multiprocess
def test_sigterm_saves_and_a_smaller_world_resumes_with_the_same_losses(tmp_path):
    root = str(tmp_path / "run")
    results = run_local(2, _save_on_sigterm_then_resume_elsewhere, root, timeout=300)
    # rank 1 alone was sent SIGTERM after step 3: every rank saved step 3 and stopped there
    assert [r[0] for r in results] == [3, 3]
    assert "this rank was sent SIGTERM; checkpoint of step 3 saved" in results[1][1]
    assert "another rank was sent SIGTERM" in results[0][1]
    assert results[0][2] == ["step_000000002", "step_000000003"]
    # a save a lost world left half-written is discarded before anyone saves again
    os.makedirs(os.path.join(root, "ckpt", "step_000000009"))
    open(os.path.join(root, "ckpt", "step_000000009", "__3_0.distcp"), "w").close()
    # one rank resumes it with its own plan (4 micro-batches of 2 instead of 2 micro-batches of 4 per rank)
    [(resumed, losses, again)] = run_local(1, _resume, root, timeout=300)
    assert resumed == ("planned", "step_000000003", 3, 4, {"samples": 24}) and again == "store"
    assert sorted(os.listdir(os.path.join(root, "ckpt"))) == ["step_000000004", "step_000000005"]
    reference = run_local(2, _uninterrupted, str(tmp_path / "reference"), timeout=300)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[3:]), rtol=1e-4, atol=0)
    errors = run_local(2, _refused, root, timeout=300)[0]
    assert "was saved from a different model" in errors["model"]
    assert "was trained with global batch 8 and this run has 4" in errors["batch"]
    assert "batch has 6 samples on dim 0 but the global batch is 8" in errors["step batch"]


def _with_dropout(rank, world, root, total, stop_at):
    run = _start(root, cfg=GPTConfig(layers=1, dropout=0.2), micro_batch=2)
    try:
        return run.resumed_from is not None, _train(run, total, kill_at=stop_at)
    except SystemExit:
        return None


@pytest.mark.multiprocess
def test_a_resume_draws_the_dropout_masks_an_uninterrupted_run_draws(tmp_path):
    """The runtime's own random stream (dropout) is in the checkpoint: stopped after step 2 and resumed on the same
    world, steps 3 and 4 equal the uninterrupted run's (the masks of a micro-batch cut differ between worlds)."""
    root = str(tmp_path / "run")
    assert run_local(2, _with_dropout, root, 4, 2, timeout=300) == [None, None]
    resumed, losses = run_local(2, _with_dropout, root, 4, None, timeout=300)[0]
    fresh, reference = run_local(2, _with_dropout, str(tmp_path / "reference"), 4, None, timeout=300)[0]
    assert resumed and not fresh
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[2:]), rtol=1e-5, atol=0)
