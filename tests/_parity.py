"""Shared harness for parity tests: build a model the same way on every process, train it, compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import meshplan
from meshplan.models import MLP, GPT, GPTConfig, Llama, LlamaConfig
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

BATCH = 8
STEPS = 3

# Megatron tensor parallelism: column-parallel in-projections, row-parallel out-projections
# (nn.Linear weights are [out, in]: colwise shards dim 0, rowwise dim 1)
COLWISE = {
    "mlp": ["layers.0.weight", "layers.0.bias"],
    "gpt": ["*.q_proj.*", "*.k_proj.*", "*.v_proj.*", "*.fc1.*"],
    "llama": ["*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight", "*.gate_proj.weight", "*.up_proj.weight"],
}
COLWISE["llama_dict"] = COLWISE["llama"]
ROWWISE = {
    "mlp": ["layers.1.weight"],
    "gpt": ["*.out_proj.weight", "*.fc2.weight"],
    "llama": ["*.o_proj.weight", "*.down_proj.weight"],
}
ROWWISE["llama_dict"] = ROWWISE["llama"]


def build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP()
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(1))
        y = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(2))
        return model, x, y
    if name == "gpt":
        model = GPT(GPTConfig())
    elif name == "llama_dict":  # torchtitan's layout: blocks in an nn.ModuleDict, enough of them to trace once and copy
        model = Llama(LlamaConfig(layers=4, module_dict=True))
    else:
        model = Llama(LlamaConfig())
    tokens = torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(1))
    return model, tokens, tokens


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1))


def train(model, x, y, name: str, steps: int = STEPS) -> list[float]:
    return run_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y, name, steps)


def run_steps(model, opt, x, y, name: str, steps: int) -> list[float]:
    """`steps` training steps with the given optimizer; the loss of each."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(name, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def megatron_layouts(name: str, mesh_ndim: int) -> tuple[dict, dict]:
    """Param and input layouts of Megatron TP (1-D mesh) or data x tensor parallel (2-D mesh)."""
    lead = "R" * (mesh_ndim - 1)
    params = {p: lead + "S(0)" for p in COLWISE[name]} | {p: lead + "S(1)" for p in ROWWISE[name]}
    inputs = {"x" if name == "mlp" else "tokens": ("S(0)" if mesh_ndim == 2 else "") + "R"}
    return params, inputs


def plan_kwargs(name: str, kind: str, mesh_shape: tuple[int, ...]) -> dict:
    kw: dict = {"mesh_shape": mesh_shape}
    if kind == "data_parallel":
        kw["mode"] = "data_parallel"
    elif kind == "megatron":
        kw["param_layouts"], kw["input_layouts"] = megatron_layouts(name, len(mesh_shape))
    elif kind == "fsdp":  # every parameter stored sharded on every axis, gathered where it is used
        kw["param_layouts"] = {"*": "S(0)" * len(mesh_shape)}
        kw["input_layouts"] = {"x" if name == "mlp" else "tokens": "S(0)" * len(mesh_shape)}
    return kw


def rank_worker(rank: int, world: int, name: str, plan):
    """Runs on every rank: train the planned model, report losses, local params and collective counts."""
    model, x, y = build(name)
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan)
    pmodel.reset_collective_counts()
    losses = train(pmodel, x, y, name)
    return losses, pmodel.collective_counts(), {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}, pmodel.plan.hash()


def check_parity(name: str, plan, results, *, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    model, x, y = build(name)
    reference = train(model, x, y, name)
    ref_params = dict(model.named_parameters())
    layouts = {f: p.layout for p in plan.params for f in p.fqns}
    expected = {k: v * STEPS for k, v in plan.collectives().items()}
    for rank, (losses, counts, params, plan_hash) in enumerate(results):
        assert plan_hash == plan.hash()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=rtol, atol=atol)
        assert set(params) == set(ref_params), "ParallelModule must expose the model's own parameter names"
        for fqn, local in params.items():
            want = shard_tensor(ref_params[fqn].detach(), layouts[fqn], plan.mesh, rank)
            torch.testing.assert_close(local, want, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank} {fqn}: {m}")
        assert dict(counts) == expected, f"rank {rank} executed {dict(counts)} but the plan lists {expected}"
