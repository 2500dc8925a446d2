"""Checkpoints across plans: save under tensor parallelism on 4 ranks, load under dp x tp on 4
ranks and under another plan on 2 ranks; the state equals the saved one and training continues
with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from _parity import BATCH, megatron_layouts, run_steps

import meshplan
import meshplan.models
from meshplan.runtime import checkpoint
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

NAME = "gpt"  # tied embedding: one tensor under two FQNs
SAVE_AT, MORE = 2, 2


def build(name: str = NAME):
    """A one-layer GPT (the parity tests' GPT has two): 4-rank runs on 2 shared cores are slow."""
    torch.manual_seed(0)
    model = meshplan.models.GPT(meshplan.models.GPTConfig(layers=1))
    tokens = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(1))
    return model, tokens, tokens


def _plan(mesh_shape, megatron: bool):
    model, x, _ = build(NAME)
    kw = {}
    if megatron:
        kw["param_layouts"], kw["input_layouts"] = megatron_layouts(NAME, len(mesh_shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=int(torch.tensor(mesh_shape).prod()), example_inputs=(x,),
                             mesh_shape=mesh_shape, **kw)


def _steps(pmodel, opt, x, y, n):
    return run_steps(pmodel, opt, x, y, NAME, n)


def _save_worker(rank, world, plan, path):
    model, x, y = build(NAME)
    pmodel = meshplan.auto_parallelize(model, example_inputs=(x,), plan=plan)
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-2)
    before = _steps(pmodel, opt, x, y, SAVE_AT)
    meshplan.save_checkpoint(path, pmodel, opt, step=SAVE_AT, extra={"data": "epoch 0"})
    # the whole tensors as saved, gathered through the DTensor views
    whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in checkpoint.model_state_dict(pmodel).items()}
    osd = checkpoint.optimizer_state_dict(pmodel, opt)["state"]
    whole_state = {k: {s: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for s, v in d.items()} for k, d in osd.items()}
    after = _steps(pmodel, opt, x, y, MORE)
    # load back into the same plan: the continuation repeats exactly
    info = meshplan.load_checkpoint(path, pmodel, opt)
    again = _steps(pmodel, opt, x, y, MORE)
    # whole tensors in, this rank's blocks out
    checkpoint.load_model_state_dict(pmodel, whole)
    reloaded = {k: local_of(v.detach()).clone() for k, v in pmodel.state_dict().items()}
    # DTensors of another layout on this mesh in (replicated): the same blocks out, by DTensor's redistribution
    replicated = {k: distribute_tensor(v, pmodel.device_mesh, [Replicate()] * pmodel.device_mesh.ndim) for k, v in whole.items()}
    with torch.no_grad():
        for v in pmodel.state_dict().values():
            local_of(v).zero_()
    checkpoint.load_model_state_dict(pmodel, replicated)
    redistributed = {k: local_of(v.detach()).clone() for k, v in pmodel.state_dict().items()}
    dtensors = {isinstance(v, DTensor) for v in pmodel.parameters()} | {isinstance(v, DTensor) for d in opt.state.values() for v in d.values()}
    return before, after, again, info, whole, whole_state, reloaded, dtensors, redistributed


def _load_worker(rank, world, plan, path):
    model, x, y = build(NAME)
    torch.manual_seed(1000 + rank)  # the loaded weights, not these, must win
    for p in model.parameters():
        torch.nn.init.normal_(p)
    pmodel = meshplan.auto_parallelize(model, example_inputs=(x,), plan=plan)
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-2)
    info = meshplan.load_checkpoint(path, pmodel, opt)
    params = {k: local_of(v.detach()).clone() for k, v in pmodel.named_parameters()}
    state = {k: {s: local_of(v).clone() for s, v in opt.state[p].items()} for k, p in pmodel.named_parameters()}
    losses = _steps(pmodel, opt, x, y, MORE)
    return info, params, state, losses


def _reference():
    """One process, no checkpoint: the losses of every step."""
    model, x, y = build(NAME)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return _steps(model, opt, x, y, SAVE_AT + MORE)


@pytest.mark.multiprocess
def test_checkpoint_reshards_across_plans_and_world_sizes(tmp_path):
    path = str(tmp_path / "ckpt")
    tp4 = _plan((4,), megatron=True)
    saved = run_local(4, _save_worker, tp4, path, timeout=600)
    ref_losses = _reference()
    tp4_layouts = {f: p.layout for p in tp4.params for f in p.fqns}
    for rank, (before, after, again, info, whole, _, reloaded, _, redistributed) in enumerate(saved):
        torch.testing.assert_close(torch.tensor(before + after), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        assert again == after, "reloading under the same plan must repeat the continuation exactly"
        assert info == checkpoint.CheckpointInfo(step=SAVE_AT, plan_hash=tp4.hash(), mesh_shape=(4,), extra={"data": "epoch 0"})
        assert set(reloaded) == set(whole)
        for k, v in reloaded.items():  # load_model_state_dict with whole tensors keeps this rank's block
            assert torch.equal(v, shard_tensor(whole[k], tp4_layouts[k], tp4.mesh, rank)), k
            assert torch.equal(redistributed[k], v), k
    uninterrupted, saved_params, saved_state = saved[0][1], saved[0][4], saved[0][5]
    assert any(tp4_layouts[k] != (meshplan.Replicate(),) for k in saved_params)  # tp=4 really shards
    assert set(saved_state) == {k for k, _ in build(NAME)[0].named_parameters()}
    assert all(set(d) == {"step", "exp_avg", "exp_avg_sq"} for d in saved_state.values())

    for world, plan in [(4, _plan((2, 2), megatron=True)), (2, _plan((2,), megatron=False))]:
        assert plan.hash() != tp4.hash()
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        for rank, (info, params, state, losses) in enumerate(run_local(world, _load_worker, plan, path, timeout=600)):
            assert info.step == SAVE_AT and info.mesh_shape == (4,)
            for fqn, local in params.items():  # exactly the saved values, in this plan's layout
                assert torch.equal(local, shard_tensor(saved_params[fqn], layouts[fqn], plan.mesh, rank)), (world, rank, fqn)
                for key, value in saved_state[fqn].items():
                    want = value if value.dim() == 0 else shard_tensor(value, layouts[fqn], plan.mesh, rank)
                    assert torch.equal(state[fqn][key], want), (world, rank, fqn, key)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted), rtol=1e-4, atol=1e-6)

    # a standard DCP checkpoint: one process loads the model part into the plain model
    model, _, _ = build(NAME)
    plain = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load({"model": plain}, storage_reader=checkpoint.SafeFileSystemReader(path))
    assert set(plain) == set(saved_params)
    for fqn, value in saved_params.items():
        assert torch.equal(plain[fqn], value), fqn
    info = json.loads((tmp_path / "ckpt" / checkpoint.INFO_FILE).read_text())
    assert info["optimizer"]["class"] == "Adam" and info["optimizer"]["param_groups"][0]["lr"] == 1e-2


@pytest.mark.multiprocess
def test_a_data_parallel_plan_keeps_plain_tensors_and_its_checkpoint_loads_under_tensor_parallelism(tmp_path):
    """A plan that replicates every parameter keeps parameters and optimizer state plain, as DDP does;
    its checkpoint stores the state as replicated DTensors, so a sharding plan loads it like any other."""
    model, x, _ = build(NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dp2 = meshplan.plan(model, devices=2, example_inputs=(x,), mesh_shape=(2,), mode="data_parallel")
    tp2 = _plan((2,), megatron=True)
    assert dp2.plain_params and not tp2.plain_params
    path = str(tmp_path / "ckpt")
    saved = run_local(2, _save_worker, dp2, path, timeout=600)
    for before, after, again, info, whole, whole_state, reloaded, dtensors, redistributed in saved:
        torch.testing.assert_close(torch.tensor(before + after), torch.tensor(_reference()), rtol=1e-4, atol=1e-6)
        assert again == after and dtensors == {False}
        assert all(torch.equal(reloaded[k], whole[k]) and torch.equal(redistributed[k], whole[k]) for k in whole)
    saved_params, saved_state = saved[0][4], saved[0][5]
    assert all(set(d) == {"step", "exp_avg", "exp_avg_sq"} for d in saved_state.values())
    layouts = {f: p.layout for p in tp2.params for f in p.fqns}
    assert any(layout != (meshplan.Replicate(),) for layout in layouts.values())
    for rank, (info, params, state, losses) in enumerate(run_local(2, _load_worker, tp2, path, timeout=600)):
        for fqn, local in params.items():
            assert torch.equal(local, shard_tensor(saved_params[fqn], layouts[fqn], tp2.mesh, rank)), (rank, fqn)
            for key, value in saved_state[fqn].items():
                want = value if value.dim() == 0 else shard_tensor(value, layouts[fqn], tp2.mesh, rank)
                assert torch.equal(state[fqn][key], want), (rank, fqn, key)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved[0][1]), rtol=1e-4, atol=1e-6)


def test_checkpoint_metadata_is_unpickled_safely(tmp_path):
    """DCP's .metadata is a pickle: only DCP's metadata classes may appear in it."""
    model = meshplan.models.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path))
        reader = checkpoint.SafeFileSystemReader(str(tmp_path))
        assert set(reader.read_metadata().state_dict_metadata) == {f"model.{k}" for k in model.state_dict()}

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match=r"corrupt or unsafe: (posix|os)\.system is not allowed in checkpoint metadata"):
        checkpoint.SafeFileSystemReader(str(tmp_path)).read_metadata()
    (tmp_path / ".metadata").write_bytes(b"\x80\x04truncated")
    with pytest.raises(ValueError, match="corrupt or unsafe"):
        checkpoint.SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_incomplete_or_foreign_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"is not a complete meshplan checkpoint: meshplan.json is missing"):
        checkpoint.read_info(tmp_path)
    (tmp_path / checkpoint.INFO_FILE).write_text('{"format": 1, "step": ')
    with pytest.raises(ValueError, match="meshplan.json is not valid JSON"):
        checkpoint.read_info(tmp_path)
    (tmp_path / checkpoint.INFO_FILE).write_text('{"format": 99}')
    with pytest.raises(ValueError, match="has format 99; this meshplan reads format 1"):
        checkpoint.read_info(tmp_path)
    assert checkpoint.latest_checkpoint(tmp_path / "none") is None
    for step in (3, 12):
        d = tmp_path / "ck" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / checkpoint.INFO_FILE).write_text("{}")
    (tmp_path / "ck" / "step_000013").mkdir()  # interrupted save: no meshplan.json
    assert checkpoint.latest_checkpoint(tmp_path / "ck") == str(tmp_path / "ck" / "step_000012")
