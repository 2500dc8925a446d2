"""`meshplan demo`: plan a small model for N devices, print the plan, run it on N local gloo
processes and compare loss and parameters with the same model trained on one process."""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from meshplan.api import auto_parallelize, plan
from meshplan.models import GPT, GPTConfig, Llama, LlamaConfig
from meshplan.plans.plan import Plan
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

MODELS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}


def _build(model: str, batch: int):
    torch.manual_seed(0)
    cls, cfg = MODELS[model]
    net = cls(cfg())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, net.cfg.vocab_size, (batch, net.cfg.seq_len), generator=gen)
    return net, tokens


def _train(net, tokens, steps: int) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = net(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _rank(rank: int, world: int, model: str, batch: int, steps: int, the_plan: Plan):
    net, tokens = _build(model, batch)
    pmodel = auto_parallelize(net, devices=world, example_inputs=(tokens,), plan=the_plan)
    pmodel.reset_collective_counts()
    losses = _train(pmodel, tokens, steps)
    return losses, pmodel.collective_counts(), {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}


def run_demo(devices: int = 4, steps: int = 3, model: str = "gpt", batch: int = 8) -> bool:
    if model not in MODELS:
        raise ValueError(f"unknown demo model {model!r}; allowed: {', '.join(MODELS)}")
    net, tokens = _build(model, batch)
    print(f"planning {model} ({sum(p.numel() for p in net.parameters()):,} parameters, batch {list(tokens.shape)}) for {devices} devices ...")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        the_plan = plan(net, devices=devices, example_inputs=(tokens,))
    print(f"planned in {time.perf_counter() - t0:.1f} s\n")
    print(the_plan)
    print(f"\nrunning {steps} steps on {devices} gloo processes and on one process ...")
    reference = _train(net, tokens, steps)
    results = run_local(devices, _rank, model, batch, steps, the_plan, timeout=600)
    losses, counts, _ = results[0]
    worst = 0.0
    ref_params = dict(net.named_parameters())
    layouts = {f: p.layout for p in the_plan.params for f in p.fqns}
    for rank, (_, _, params) in enumerate(results):
        for name, local in params.items():
            want = shard_tensor(ref_params[name].detach(), layouts[name], the_plan.mesh, rank)
            worst = max(worst, ((local - want).abs() / (want.abs() + 1e-6)).max().item())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    expected = {k: v * steps for k, v in the_plan.collectives().items()}
    print(f"{'step':>4} {'1 process':>12} {f'{devices} processes':>14}")
    for i, (a, b) in enumerate(zip(reference, losses)):
        print(f"{i:>4} {a:>12.6f} {b:>14.6f}")
    print(f"max relative loss difference {loss_err:.2e}; max relative parameter difference {worst:.2e}")
    print(f"collectives executed {dict(sorted(counts.items()))}")
    print(f"collectives planned  {dict(sorted(expected.items()))}")
    ok = loss_err < 1e-4 and worst < 1e-3 and dict(counts) == expected
    print("PARITY OK" if ok else "PARITY FAILED")
    return ok
