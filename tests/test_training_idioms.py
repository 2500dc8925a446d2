"""The training loop users write, unchanged on a ParallelModule, gives one process's numbers.

One loop, under a data-parallel, a Megatron tensor-parallel, a 2-D plan and a data x context-parallel plan in
head-tail token order (`token_order=True`) on 4 gloo ranks:
gradient accumulation over two micro-batches with `no_sync()` on the first, `clip_grad_norm_`
with a limit small enough to bite, AdamW with weight decay, a StepLR scheduler,
`zero_grad(set_to_none=True)` and `(set_to_none=False)` in turn, and `torch.no_grad()` inference.
Each rank's losses, clip norms, gradient shards, parameters and inference outputs are compared with
the same loop on the plain model in one process, and the collectives of the deferred micro-step are
counted.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from _parity import loss_fn, megatron_layouts

import meshplan
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig
from meshplan.models.resnet import ResNet
from meshplan.regions.context_parallel import force_context_parallel
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor

MICRO = 2
STEPS = 2
MAX_NORM = 0.02  # the reference's gradient norms are ~0.5: clipping scales every step


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    data = torch.randint(0, 128, (STEPS * MICRO + 1, 8, 16), generator=torch.Generator().manual_seed(1))
    return model, data


def train(model, data, *, no_sync=None, counts=None, use_step=False):
    """The user's loop. Returns losses, clip norms, the gradients seen by the last step, inference output.
    `use_step`: forward and backward through `pmodel.step()`, the call every plan (pipelined or not) takes."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            deferred = micro < MICRO - 1
            with no_sync() if (deferred and no_sync) else contextlib.nullcontext():
                if counts is not None:
                    counts.reset_collective_counts()
                tokens = data[step * MICRO + micro]
                if use_step:
                    loss = model.step(tokens, target=tokens, loss_fn=lambda out, y: loss_fn("gpt", out, y) / MICRO)
                else:
                    loss = loss_fn("gpt", model(tokens), tokens) / MICRO
                    loss.backward()
                if counts is not None:
                    counts.log.append((deferred, dict(counts.collective_counts())))
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        grads = {k: (v.grad.to_local() if hasattr(v.grad, "to_local") else v.grad).clone() for k, v in model.named_parameters()}
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    with torch.no_grad():
        out = model(data[-1])
    return losses, norms, grads, out


class _Counts:
    def __init__(self, pmodel):
        self.reset_collective_counts, self.collective_counts, self.log = pmodel.reset_collective_counts, pmodel.collective_counts, []


def _plans():
    model, data = build()
    tp, tp_inputs = megatron_layouts("gpt", 1)
    tp2, tp2_inputs = megatron_layouts("gpt", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = lambda shape, **kw: meshplan.plan(model, devices=4, example_inputs=(data[0],), mesh_shape=shape, **kw)  # noqa: E731
        with force_context_parallel("headtail"):
            ordered = plan((2, 2), axis_names=("dp", "cp"), input_layouts={"tokens": "S(0)S(1)"}, token_order=True)
        return {
            "data parallel (4,)": plan((4,), mode="data_parallel"),
            "tensor parallel (4,)": plan((4,), param_layouts=tp, input_layouts=tp_inputs),
            "data x tensor parallel (2,2)": plan((2, 2), param_layouts=tp2, input_layouts=tp2_inputs),
            "data x context parallel in token order (2,2)": ordered,
        }


def _worker(rank, world, graph, plans):
    out = {}
    for name, plan in plans.items():
        model, data = build()
        pmodel = ParallelModule(model, graph, plan)
        counts = _Counts(pmodel)
        losses, norms, grads, inferred = train(pmodel, data, no_sync=pmodel.no_sync, counts=counts)
        params = {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}
        out[name] = (losses, norms, grads, params, inferred, counts.log)
    return out


@pytest.mark.multiprocess
def test_user_training_loop_matches_one_process_under_dp_tp_and_2d():
    model, data = build()
    graph = trace(model, (data[0],))
    plans = _plans()
    model, data = build()
    ref_losses, ref_norms, ref_grads, ref_out = train(model, data)
    assert min(ref_norms) > 10 * MAX_NORM, "the limit must make clipping scale the gradients"
    ref_params = dict(model.named_parameters())
    results = run_local(4, _worker, graph, plans, timeout=900)
    for name, plan in plans.items():
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        buckets = len(plan.buckets)
        for rank, result in enumerate(results):
            losses, norms, grads, params, inferred, log = result[name]
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} losses: {m}")
            # one global norm on every rank, as one process computes it
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} clip norms: {m}")
            for fqn, local in grads.items():
                want = shard_tensor(ref_grads[fqn], layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} grad {fqn}: {m}")
            for fqn, local in params.items():
                want = shard_tensor(ref_params[fqn].detach(), layouts[fqn], plan.mesh, rank)
                torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} param {fqn}: {m}")
            torch.testing.assert_close(inferred, ref_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} no_grad output: {m}")
            # no_sync defers every gradient all-reduce to the last micro-step, which runs each bucket once
            for deferred, counts in log:
                synced = counts.get("grad_sync:all_reduce", 0)
                assert synced == (0 if deferred else buckets), f"{where}: {'deferred' if deferred else 'last'} micro-step ran {synced} bucket all-reduces"
        if "data" in name:
            assert buckets > 0, f"{name} must reduce gradients over the data-parallel axis"


# ---------------------------------------------------------------- eval() and train()


def _eval_models():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(dropout=0.2))
    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    resnet = ResNet()
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return {"gpt": (gpt, tokens), "resnet": (resnet, images)}


def _eval_loss(name, out, x):
    return loss_fn("gpt", out, x) if name == "gpt" else out.square().mean()


def _eval_loop(name, model, x):
    """A training step, an evaluation in eval mode, then training again: outputs and losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for evaluate in (False, True, False):
        if evaluate:
            model.eval()
            with torch.no_grad():
                evaluated = model(x)
            model.train()
            continue
        loss = _eval_loss(name, model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, evaluated


def _eval_worker(rank, world, kinds):
    out = {}
    for name, kind in kinds:
        model, x = _eval_models()[name]
        kw = {"mode": "data_parallel"} if kind == "dp" else dict(zip(("param_layouts", "input_layouts"), megatron_layouts("gpt", 1)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), mesh_shape=(world,), **kw)
        losses, evaluated = _eval_loop(name, pmodel, x)
        out[(name, kind)] = (losses, evaluated, {k: local_of(v) for k, v in pmodel.state_dict().items() if "running" in k})
    return out


@pytest.mark.multiprocess
def test_eval_mode_switches_dropout_and_batch_norm():
    kinds = [("gpt", "dp"), ("gpt", "tp"), ("resnet", "dp")]
    results = run_local(2, _eval_worker, kinds, timeout=900)
    for name, kind in kinds:
        model, x = _eval_models()[name]
        ref_losses, ref_eval = _eval_loop(name, model, x)
        for rank, result in enumerate(results):
            losses, evaluated, running = result[(name, kind)]
            where = f"{name} {kind}, rank {rank}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(evaluated, ref_eval, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} eval output: {m}")
            for fqn, value in running.items():  # eval mode leaves the running statistics alone
                torch.testing.assert_close(value, model.state_dict()[fqn], rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} {fqn}: {m}")
        with torch.no_grad():  # eval mode really differs from train mode for these models
            assert (model.eval()(x) - model.train()(x)).abs().max() > 1e-3, name


# ---------------------------------------------------------------- a plan on a sub-group


def _group_worker(rank, world):
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    if rank % 2:  # plan once: only a group's first rank may plan

        def no_planning(*args, **kwargs):
            raise AssertionError(f"rank {rank} planned; it must receive its group's plan")

        meshplan.api.plan = no_planning
    model, data = build()
    if mine == 0:  # each group plans its own way, on its own first rank
        kw = {"mode": "data_parallel"}
    else:
        kw = dict(zip(("param_layouts", "input_layouts"), megatron_layouts("gpt", 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = meshplan.auto_parallelize(model, devices=2, example_inputs=(data[0],), mesh_shape=(2,), group=groups[mine], **kw)
    losses, norms, grads, inferred = train(pmodel, data, no_sync=pmodel.no_sync, use_step=mine == 1)
    return pmodel.plan, losses, norms, grads


@pytest.mark.multiprocess
def test_two_groups_train_their_own_plans():
    model, data = build()
    ref_losses, ref_norms, ref_grads, _ = train(model, data)
    results = run_local(4, _group_worker, timeout=900)
    plans = [results[0][0], results[2][0]]
    assert plans[0].hash() != plans[1].hash(), "the two groups were given different plans"
    for rank, (plan, losses, norms, grads) in enumerate(results):
        assert plan.hash() == plans[rank // 2].hash(), f"rank {rank} runs another plan than its group's first rank"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6)
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        for fqn, local in grads.items():
            torch.testing.assert_close(local, shard_tensor(ref_grads[fqn], layouts[fqn], plan.mesh, rank % 2), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- one loop for a flat and a pipelined plan

PIPE_CFG = dict(layers=4, hidden=32, heads=2, vocab_size=64, seq_len=8)


def _small_gpt(dropout: float = 0.0):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PIPE_CFG, dropout=dropout))
    return model, torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))


def _gpt_loss(out, y):
    return loss_fn("gpt", out, y)


def _pipelined(model, x):
    options = meshplan.PipelineOptions(degrees=(2,), schedules=("1f1b",), microbatch_sizes=(4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meshplan.plan(model, 2, (x,), pipeline=options)


def _one_loop(pmodel, x):
    """The loop every plan takes: `step()`, `pmodel.clip_grad_norm_`, the optimizer; then an evaluation step in eval
    mode. Returns the losses (None where a pipeline rank holds no last stage), the clip norms and the eval loss."""
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = pmodel.step(x, target=x)
        norms.append(float(pmodel.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    pmodel.eval()
    with torch.no_grad():
        evaluated = pmodel.step(x, target=x)
    pmodel.train()
    return losses, norms, None if evaluated is None else float(evaluated)


def _one_loop_worker(rank, world, flat, piped, piped_dropout):
    out = {}
    for name, plan in (("flat", flat), ("pipelined", piped)):
        model, x = _small_gpt()
        pmodel = meshplan.auto_parallelize(model, example_inputs=(x,), plan=plan, loss_fn=_gpt_loss)
        assert type(pmodel) is ParallelModule
        if name == "pipelined":  # what a pipelined plan cannot do raises, on every rank, before any collective
            with pytest.raises(ValueError, match="a pipelined plan runs its whole batch in one step"):
                pmodel.no_sync()
            with pytest.raises(ValueError, match="call pmodel.step"):
                pmodel(x)
            pmodel.step(x, target=x)
            with pytest.raises(ValueError, match="would see only this rank's stages; call pmodel.clip_grad_norm_"):
                torch.nn.utils.clip_grad_norm_(pmodel.parameters(), MAX_NORM)
            pmodel.zero_grad()
        out[name] = _one_loop(pmodel, x)
    # with dropout, the pipelined eval-mode program is the model's eval mode, and train mode is not
    model, x = _small_gpt(dropout=0.2)
    pmodel = meshplan.auto_parallelize(model, example_inputs=(x,), plan=piped_dropout, loss_fn=_gpt_loss)
    with torch.no_grad():
        pmodel.eval()
        evaluated = pmodel.step(x, target=x)
        pmodel.train()
        trained = pmodel.step(x, target=x)
    out["dropout"] = tuple(None if v is None else float(v) for v in (evaluated, trained))
    return out


@pytest.mark.multiprocess
def test_one_loop_trains_and_evaluates_a_flat_and_a_pipelined_plan():
    """`step()`, `pmodel.clip_grad_norm_` (one global norm), the user's optimizer and an evaluation step in eval mode
    give one process's numbers on a data-parallel and a 2-stage pipelined plan alike; the plain
    `torch.nn.utils.clip_grad_norm_` over a pipelined plan's parameters, which would see one rank's stages, raises."""
    model, x = _small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = meshplan.plan(model, 2, (x,), mode="data_parallel")
    piped = _pipelined(model, x)
    dropout_model, _ = _small_gpt(dropout=0.2)
    piped_dropout = _pipelined(dropout_model, x)
    assert flat.pipeline is None and piped.pipeline.degree == 2 and piped_dropout.pipeline.degree == 2
    results = run_local(2, _one_loop_worker, flat, piped, piped_dropout, timeout=900)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses, ref_norms = [], []
    for _ in range(STEPS):
        loss = _gpt_loss(model(x), x)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert min(ref_norms) > 10 * MAX_NORM, "the limit must make clipping scale the gradients"
    with torch.no_grad():
        ref_eval = _gpt_loss(model.eval()(x), x).item()
        dropout_eval = _gpt_loss(dropout_model.eval()(x), x).item()
    for name in ("flat", "pipelined"):
        reported = 0
        for rank, result in enumerate(results):
            losses, norms, evaluated = result[name]
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} rank {rank} clip norms: {m}")
            if losses[0] is None:  # a pipeline rank without the last stage
                assert name == "pipelined" and evaluated is None
                continue
            reported += 1
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} rank {rank} losses: {m}")
            assert abs(evaluated - ref_eval) < 1e-4, (name, rank, evaluated, ref_eval)
        assert reported == (2 if name == "flat" else 1), (name, reported)
    evaluated, trained = next(r["dropout"] for r in results if r["dropout"][0] is not None)
    assert abs(evaluated - dropout_eval) < 1e-4, (evaluated, dropout_eval)
    assert abs(trained - dropout_eval) > 1e-3, "train mode must keep dropout"
