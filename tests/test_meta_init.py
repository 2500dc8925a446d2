"""Models built on the meta device: each rank materialises only its shards, from the model's own
initialisation or from a Hugging Face safetensors checkpoint, and trains with parity.

References are one process: `torch.manual_seed(s); model.to_empty(device="cpu")` (re-tying what
`to_empty` unties) and the same initialisation, or the checkpoint loaded whole.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor
from _parity import loss_fn, megatron_layouts

import meshplan
from meshplan.models import GPT, GPTConfig
from meshplan.models.hf import hf_llama
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

SEED = 5
STEPS = 3
TOKENS = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
LLAMA_TP = {"*.q_proj.weight": "S(0)", "*.k_proj.weight": "S(0)", "*.v_proj.weight": "S(0)", "*.gate_proj.weight": "S(0)",
            "*.up_proj.weight": "S(0)", "*.o_proj.weight": "S(1)", "*.down_proj.weight": "S(1)"}
FSDP = {"*": "S(0)"}  # every parameter and buffer stored sharded, gathered where it is used


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter (a DTensor, or a plain tensor under a data-parallel plan)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _gpt_reference():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty unties; the model on meta stays tied
    torch.manual_seed(SEED)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def _llama_reference(seed: int = SEED):
    with torch.device("meta"):
        model, args, kwargs = hf_llama()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model, args, kwargs


def _sgd(model, step) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = step(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _gpt_step(model):
    return loss_fn("gpt", model(TOKENS), TOKENS)


def _llama_step(model):
    _, args, kwargs = hf_llama()
    return model(*args, **kwargs).loss


def _plan_kwargs(kind: str, name: str) -> dict:
    if kind == "fsdp":
        return {"param_layouts": FSDP, "mesh_shape": (2,)}
    if name == "gpt":
        params, inputs = megatron_layouts("gpt", 1)
        return {"param_layouts": params, "input_layouts": inputs, "mesh_shape": (2,)}
    return {"param_layouts": LLAMA_TP, "mesh_shape": (2,)}


def _worker(rank, world, jobs, path):
    warnings.simplefilter("ignore")
    out = {}
    for name, kind, source in jobs:
        with torch.device("meta"):
            model, args, kwargs = (GPT(GPTConfig()), (TOKENS,), {}) if name == "gpt" else hf_llama()
        torch.manual_seed(SEED)  # every rank the same seed: replicas draw the same weights
        weights = path if source == "file" else None
        pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=args, example_kwargs=kwargs, weights=weights,
                                           **_plan_kwargs(kind, name))
        assert all(p.device.type == "cpu" for p in pmodel.parameters())
        shards = {k: local_of(v.detach()).clone() for k, v in pmodel.state_dict().items()}
        layouts = {f: p.layout for p in pmodel.plan.params for f in p.fqns}
        losses = _sgd(pmodel, _gpt_step if name == "gpt" else _llama_step)
        out[(name, kind, source)] = (shards, layouts, pmodel.plan.mesh, losses)
    return out


@pytest.mark.multiprocess
def test_meta_models_materialise_their_shards_and_train(tmp_path):
    saved, _, _ = _llama_reference(seed=99)  # weights unlike the ranks' initialisation: the file, not the init, must win
    saved.save_pretrained(tmp_path)
    jobs = [("gpt", "tp", "init"), ("gpt", "fsdp", "init"), ("llama", "tp", "init"), ("llama", "tp", "file"), ("llama", "fsdp", "file")]
    results = run_local(2, _worker, jobs, str(tmp_path), timeout=900)
    for name, kind, source in jobs:
        if name == "gpt":
            reference = _gpt_reference()
        elif source == "init":
            reference = _llama_reference()[0]
        else:
            reference = _llama_reference(seed=99)[0]  # what the file holds (a fresh copy: training changes it)
        whole = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        ref_losses = _sgd(reference, _gpt_step if name == "gpt" else _llama_step)
        for rank, result in enumerate(results):
            shards, layouts, mesh, losses = result[(name, kind, source)]
            where = f"{name} {kind} from {source}, rank {rank}"
            assert set(whole) <= set(shards), (where, set(whole) - set(shards))
            for fqn, value in whole.items():  # every shard is its slice of the one-process weights (or of the file)
                assert torch.equal(shards[fqn], shard_tensor(value, layouts[fqn], mesh, rank)), f"{where}: {fqn}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {m}")
        if kind == "tp":
            assert any(layouts[f] != (meshplan.Replicate(),) for f in whole), f"{name} {kind} must shard something"


# ---------------------------------------------------------------- bad input: a clear ValueError, nothing half-loaded


class _Uncovered(torch.nn.Module):
    """A parameter no reset_parameters() initialises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.lin(x) * self.scale


def _bad_worker(rank, world, path, other):
    warnings.simplefilter("ignore")
    messages = []
    x = torch.randn(4, 8)
    with torch.device("meta"):
        model = _Uncovered()
    try:
        meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), mode="data_parallel")
    except ValueError as e:
        messages.append(str(e))
    # an init_fn that covers it
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), mode="data_parallel",
                                       init_fn=lambda m: (m.lin.reset_parameters(), torch.nn.init.ones_(m.scale)))
    assert torch.equal(_whole(pmodel.scale), torch.ones(8))
    torch.manual_seed(rank)  # different seeds: replicas would differ
    with torch.device("meta"):
        model = GPT(GPTConfig())
    try:
        meshplan.auto_parallelize(model, devices=world, example_inputs=(TOKENS,), mode="data_parallel")
    except ValueError as e:
        messages.append(str(e))
    for file in (path, other):  # a file of another model, a file with a tensor of another shape
        with torch.device("meta"):
            model, args, kwargs = hf_llama()
        try:
            meshplan.auto_parallelize(model, devices=world, example_inputs=args, example_kwargs=kwargs, weights=file, mode="data_parallel")
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.multiprocess
def test_meta_models_with_missing_init_or_wrong_files_are_value_errors(tmp_path):
    from safetensors.torch import save_file

    model = GPT(GPTConfig())
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(tmp_path / "gpt.safetensors"))
    llama = hf_llama()[0]
    state = {k: v.contiguous() for k, v in llama.state_dict().items()}
    state["model.norm.weight"] = torch.ones(32)
    save_file(state, str(tmp_path / "llama.safetensors"))
    results = run_local(2, _bad_worker, str(tmp_path / "gpt.safetensors"), str(tmp_path / "llama.safetensors"), timeout=600)
    for messages in results:
        assert len(messages) == 4, messages
        assert messages[0].startswith("reset_parameters() does not initialise ['scale'] of the model on the meta device")
        assert "different random generator states" in messages[1]
        assert "gpt.safetensors lacks" in messages[2] and "it was saved from another model" in messages[2], messages[2]
        assert messages[3].startswith("model.norm.weight in ") and "has shape [32] but the model's is [64]" in messages[3], messages[3]


def _checkpoint_worker(rank, world, path):
    warnings.simplefilter("ignore")
    torch.manual_seed(SEED)
    pmodel = meshplan.auto_parallelize(GPT(GPTConfig()), devices=world, example_inputs=(TOKENS,), **_plan_kwargs("tp", "gpt"))
    _sgd(pmodel, _gpt_step)
    meshplan.save_checkpoint(path, pmodel)
    saved = {k: _whole(v) for k, v in pmodel.state_dict().items()}
    with torch.device("meta"):
        model = GPT(GPTConfig())
    loaded = meshplan.auto_parallelize(model, devices=world, example_inputs=(TOKENS,), weights=path, **_plan_kwargs("fsdp", "gpt"))
    return all(torch.equal(_whole(v), saved[k]) for k, v in loaded.state_dict().items()), set(saved) == set(loaded.state_dict())


@pytest.mark.multiprocess
def test_meta_model_loads_a_meshplan_checkpoint_saved_under_another_plan(tmp_path):
    assert run_local(2, _checkpoint_worker, str(tmp_path / "ckpt"), timeout=600) == [(True, True)] * 2


# ---------------------------------------------------------------- pipelined plans: each rank materialises its stages' shards


def _pipeline_plan():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    options = meshplan.PipelineOptions(degrees=(2,), microbatch_sizes=(4,), schedules=("gpipe",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(model, 2, (TOKENS,), cluster="cpu", pipeline=options)


def _pipeline_worker(rank, world, plan, path):
    warnings.simplefilter("ignore")
    out = {}
    for source in ("init", "file"):
        with torch.device("meta"):
            model = GPT(GPTConfig())
        torch.manual_seed(SEED)
        runner = meshplan.auto_parallelize(model, example_inputs=(TOKENS,), plan=plan, weights=path if source == "file" else None,
                                           loss_fn=lambda out, y: loss_fn("gpt", out, y))
        shards = {k: local_of(v.detach()).clone() for k, v in runner.state_dict().items()}
        opt = torch.optim.SGD(runner.parameters(), lr=0.1)
        losses = []
        for _ in range(STEPS):
            losses.append(runner.step(TOKENS, target=TOKENS))
            opt.step()
            opt.zero_grad()
        out[source] = (shards, [None if x is None else float(x) for x in losses])
    return out


@pytest.mark.multiprocess
def test_meta_model_on_a_pipelined_plan_materialises_only_its_stages(tmp_path):
    from safetensors.torch import save_model

    plan = _pipeline_plan()
    assert plan.pipeline is not None and plan.pipeline.degree == 2
    saved = GPT(GPTConfig())  # the file holds weights unlike the initialisation's: the file must win
    save_model(saved, str(tmp_path / "model.safetensors"))
    results = run_local(2, _pipeline_worker, plan, str(tmp_path), timeout=600)
    layouts = {f: p.layout for p in plan.params for f in p.fqns}
    for source, reference in (("init", _gpt_reference()), ("file", saved)):
        whole = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        ref_losses = _sgd(reference, _gpt_step)
        held, compared = set(), 0
        for rank, result in enumerate(results):
            shards, losses = result[source]
            assert set(shards) < set(whole), f"{source}, rank {rank} holds every tensor: {len(shards)} of {len(whole)}"
            for fqn, value in shards.items():
                assert torch.equal(value, shard_tensor(whole[fqn], layouts[fqn], plan.mesh, 0)), f"{source}, rank {rank}: {fqn}"
            held |= set(shards)
            if losses[0] is not None:  # the last stage's rank returns the losses
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
                compared += 1
        assert held == set(whole), set(whole) - held
        assert compared == 1, f"{source}: {compared} ranks returned losses"
