"""Optimizer-state offload: priced per parameter in the solve, run by `make_optimizer` with parity."""

from __future__ import annotations

import warnings

import pytest
import torch
from _parity import STEPS, build, run_steps

import meshplan
from meshplan.cost_model.presets import get_cluster
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of


def _plan(**kw):
    model, x, _ = build("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # fp32 (the h100 default is bf16): the parity test compares with one fp32 process
        return meshplan.plan(model, devices=2, example_inputs=(x,), mesh_shape=(2,), mode="data_parallel", cluster="h100",
                             mixed_precision="fp32", **kw)


def test_offload_moves_optimizer_state_to_the_host_and_charges_the_round_trip():
    keep, host = _plan(offload="never"), _plan(offload="always")
    trainable = [p for p in host.params if not p.is_buffer]
    assert all(p.offload for p in trainable) and not any(p.offload for p in keep.params)
    assert host.memory.optimizer == 0 and keep.memory.optimizer > 0
    assert host.memory.params == keep.memory.params and host.memory.total < keep.memory.total
    device = get_cluster("h100").device
    elements = sum(torch.Size(p.shape).numel() for p in trainable)
    # on the host: each fp32 gradient down and parameter up over the host link, then Adam reads master, gradient and
    # two moments and writes master and moments (7 x 4 bytes per element) at host memory bandwidth
    host_step = 2 * 4 * elements / device.host_link_bandwidth + 28 * elements / device.host_memory_bandwidth
    # on the device (no profile): the same 28 bytes per element at the device's memory bandwidth
    device_step = 28 * elements / device.memory_bandwidth
    # the host steps instead of the device
    assert host.host_s == pytest.approx(host_step, rel=1e-6) and host.optimizer_s == 0
    assert keep.optimizer_s == pytest.approx(device_step, rel=1e-6) and keep.host_s == 0
    assert host.step_time_s - keep.step_time_s == pytest.approx(host_step - device_step, rel=1e-6)


def test_the_solver_offloads_only_what_the_budget_needs():
    keep, host = _plan(offload="never"), _plan(offload="always")
    assert _plan(offload="auto").params == keep.params  # no memory pressure: offloading only costs time
    budget = (keep.memory.total + host.memory.total) // 2
    some = _plan(offload="auto", memory_budget=budget, recompute="never")
    n = sum(p.offload for p in some.params)
    assert 0 < n < sum(not p.is_buffer for p in some.params)
    assert some.memory.total <= budget
    assert keep.step_time_s < some.step_time_s < host.step_time_s


def test_offload_needs_a_host():
    with pytest.raises(ValueError, match="offload='always' but cluster 'cpu'"):
        model, x, _ = build("gpt")
        meshplan.plan(model, devices=2, example_inputs=(x,), mesh_shape=(2,), cluster="cpu", offload="always")
    with pytest.raises(ValueError, match="offload='host' is not supported; allowed: never, auto, always"):
        _plan(offload="host")


def _worker(rank, world, plans, path):
    out = []
    for i, plan in enumerate(plans):
        model, x, y = build("gpt")
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan)
        opt = pmodel.make_optimizer(torch.optim.Adam, lr=1e-2)
        assert isinstance(opt, torch.optim.Adam)  # an ordinary optimizer: schedulers and checkpoints take it
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        losses = run_steps(pmodel, opt, x, y, "gpt", STEPS)
        schedule.step()
        state = {k: {s: local_of(v).clone() for s, v in opt.state[t].items() if s != "step"}
                 for k, t in (dict(pmodel.named_parameters()) | pmodel.offload_copies).items()}
        if i == 0:  # the offloading run saves its checkpoint ...
            meshplan.save_checkpoint(path, pmodel, opt, step=STEPS)
        else:  # ... which loads into the plan that keeps its state on the device
            meshplan.load_checkpoint(path, pmodel, opt)
            state = {k: {s: local_of(v).clone() for s, v in opt.state[t].items() if s != "step"}
                     for k, t in pmodel.named_parameters()}
        out.append((losses, {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}, state))
    return out


@pytest.mark.multiprocess
def test_parity_with_offloaded_optimizer_state(tmp_path):
    """Adam with host-offloaded state trains exactly like Adam on the device under the same layouts, and
    both match one process's losses. (Parameters are compared between the two distributed runs: Adam
    turns the rounding noise of a gradient that is mathematically zero, such as the key bias's, into
    steps of size lr, so a comparison with one process would measure that noise, not the offload.)"""
    host, keep = _plan(offload="always"), _plan(offload="never")
    results = run_local(2, _worker, [host, keep], str(tmp_path / "ckpt"), timeout=600)
    model, x, y = build("gpt")
    reference = run_steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), x, y, "gpt", STEPS)
    for rank, ((host_losses, host_params, host_state), (keep_losses, keep_params, loaded_state)) in enumerate(results):
        torch.testing.assert_close(torch.tensor(host_losses), torch.tensor(reference), rtol=1e-4, atol=1e-6)
        assert host_losses == keep_losses
        assert set(host_params) == {k for k, _ in model.named_parameters()}
        for fqn, value in host_params.items():
            torch.testing.assert_close(value, keep_params[fqn], rtol=0, atol=0, msg=lambda m: f"rank {rank} {fqn}: {m}")
        # the host-held Adam state, checkpointed and loaded into the on-device plan, is the same state
        assert set(loaded_state) == set(host_state) and all(host_state.values())
        for fqn, entries in host_state.items():
            for key, value in entries.items():
                torch.testing.assert_close(loaded_state[fqn][key], value, rtol=0, atol=0, msg=lambda m: f"rank {rank} {fqn}.{key}: {m}")
