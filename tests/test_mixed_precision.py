"""bf16 mixed precision: traced as casts, priced in bf16 with fp32 state, run with one process's numbers.

The reference is one process running the same policy by hand: each step casts the fp32 parameters
to bf16 (`functional_call`), runs the model, casts the logits to fp32 for the loss, and SGD steps
the fp32 parameters with the fp32 gradients. meshplan must give the same losses, gradients and
parameters under a data-parallel and a Megatron tensor-parallel plan on 2 gloo ranks, and on
pipelines of 2 stages (1F1B and ZB-V), and its matmuls must really run in bf16.

Tolerances. A parallel plan sums in another order than one process (the tensor-parallel plan adds
two bf16 partial products of every row-parallel matmul, each rounded; the data-parallel plan
averages two half-batch gradients), and each bf16 rounding moves a result by up to 2**-8 of itself.
How far that carries differs per tensor: a layer-norm bias's gradient is a sum with cancellation, a
key bias's gradient is zero up to rounding. So each tensor's tolerance is its own bf16 noise: the
distance between the bf16 reference and fp32 training of the same model. meshplan's distance from
the reference is another draw of that noise: it must stay within 3 times it (measured: at most 1.79
times for gradients and 1.80 for parameters, both under the tensor-parallel plan; 1.05 on the
pipelines), plus 1e-3 of the norm for tensors bf16 reproduces almost exactly. A real fault (a
gradient not reduced, a wrong collective) is off by tens of percent where the noise is below 2 %.
Losses: rtol 2**-8 (measured at most 2.2e-4).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _parity import build, loss_fn, megatron_layouts
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

import meshplan
from meshplan.ir.precision import MixedPrecision
from meshplan.ir.trace import trace
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

STEPS = 3
CURVE_STEPS = 20
LR = 0.1
LOSS_RTOL = 2.0**-8
NOISE_FACTOR = 3.0


def batches(steps: int) -> torch.Tensor:
    """Two fixed batches in turn: the model learns them, so the loss curve falls."""
    return torch.randint(0, 128, (2, 8, 16), generator=torch.Generator().manual_seed(1)).repeat(steps // 2 + 1, 1, 1)[:steps]


def reference_forward(model, tokens, dtype):
    """One process's mixed precision, by hand: parameters cast to `dtype`, logits back to fp32."""
    return functional_call(model, {n: p.to(dtype) for n, p in model.named_parameters()}, (tokens,)).float()


def train(model, data, steps, forward=None):
    """SGD with momentum on fp32 parameters (linear in the gradients: Adam's first steps move each element by
    lr times the sign of its gradient, so rounding noise in a near-zero gradient becomes a whole step);
    returns the losses and the first step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, first = [], None
    for i in range(steps):
        opt.zero_grad()
        out = model(data[i]) if forward is None else forward(model, data[i])
        loss = loss_fn("gpt", out, data[i])
        loss.backward()
        if first is None:
            first = {k: (v.grad.to_local() if hasattr(v.grad, "to_local") else v.grad).clone() for k, v in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first


class MatmulDtypes(TorchDispatchMode):
    """Records the dtypes the matmuls run under it produce."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.seen.add(out.dtype)
        return out


def _plans():
    model, tokens, _ = build("gpt")
    layouts, input_layouts = megatron_layouts("gpt", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = lambda **kw: meshplan.plan(model, 2, (tokens,), mesh_shape=(2,), mixed_precision="bf16", **kw)  # noqa: E731
        return {"data parallel": plan(mode="data_parallel"), "tensor parallel": plan(param_layouts=layouts, input_layouts=input_layouts)}


def _worker(rank, world, plans):
    out = {}
    for name, plan in plans.items():
        model, tokens, _ = build("gpt")
        pmodel = meshplan.auto_parallelize(model, example_inputs=(tokens,), plan=plan)
        steps = CURVE_STEPS if name == "data parallel" else STEPS
        with MatmulDtypes() as matmuls:
            pmodel(tokens)
        losses, grads = train(pmodel, batches(steps), steps)
        dtypes = {k: v.dtype for k, v in pmodel.named_parameters()}
        out[name] = (losses, grads, {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}, dtypes, matmuls.seen)
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.multiprocess
def test_bf16_training_matches_one_process_with_the_same_policy():
    plans = _plans()
    results = run_local(2, _worker, plans, timeout=900)
    for name, plan in plans.items():
        steps = CURVE_STEPS if name == "data parallel" else STEPS
        initial = dict(build("gpt")[0].named_parameters())
        model, _, _ = build("gpt")
        ref_losses, ref_grads = train(model, batches(steps), steps, lambda m, x: reference_forward(m, x, torch.bfloat16))
        model32, _, _ = build("gpt")
        _, grads32 = train(model32, batches(steps), steps)
        ref_params, params32 = dict(model.named_parameters()), dict(model32.named_parameters())
        layouts = {f: p.layout for p in plan.params for f in p.fqns}
        for rank, result in enumerate(results):
            losses, grads, params, dtypes, matmuls = result[name]
            where = f"{name}, rank {rank}"
            assert matmuls == {torch.bfloat16}, f"{where}: the program's matmuls ran in {matmuls}"
            assert set(dtypes.values()) == {torch.float32}, f"{where}: master weights must stay fp32, got {dtypes}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0,
                                       msg=lambda m: f"{where} losses: {m}")
            shard = lambda t, fqn: shard_tensor(t.detach(), layouts[fqn], plan.mesh, rank)  # noqa: B023, E731
            for fqn, local in grads.items():
                assert local.dtype == torch.float32, f"{where}: gradient of {fqn} is {local.dtype}"
                err, noise = relative(local, shard(ref_grads[fqn], fqn)), relative(ref_grads[fqn], grads32[fqn])
                assert err <= NOISE_FACTOR * noise + 1e-3, f"{where} grad {fqn}: relative error {err:.2e}, bf16's own {noise:.2e}"
            for fqn, local in params.items():  # measured against how far training moved the parameter
                moved = (ref_params[fqn] - initial[fqn]).detach().norm()
                err = float((local - shard(ref_params[fqn], fqn)).norm() / moved)
                noise = float((ref_params[fqn] - params32[fqn]).detach().norm() / moved)
                assert err <= NOISE_FACTOR * noise + 1e-3, f"{where} param {fqn}: error {err:.2e} of its update, bf16's own {noise:.2e}"
    # the 20-step curve stays within 1 % of fp32 training, and it really learns
    model, _, _ = build("gpt")
    fp32, _ = train(model, batches(CURVE_STEPS), CURVE_STEPS)
    bf16 = torch.tensor(results[0]["data parallel"][0])
    assert fp32[-1] < 0.8 * fp32[0], f"the curve must fall for the comparison to mean anything: {fp32}"
    worst = float(((bf16 - torch.tensor(fp32)).abs() / torch.tensor(fp32)).max())
    assert worst <= 0.01, f"bf16 losses leave fp32's by {worst:.2%}: {bf16.tolist()} vs {fp32}"


# ---------------------------------------------------------------- tracing and planning (no processes)


def test_trace_casts_parameters_and_inputs_and_keeps_fp32_masters():
    model, tokens, _ = build("gpt")
    graph = trace(model, (tokens,), precision=MixedPrecision())
    assert {n.out.dtype for n in graph.nodes if n.kind == "param"} == {"float32"}
    dense = [n for n in graph.nodes if n.kind == "op" and n.target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")]
    assert dense and {n.outputs[0].dtype for n in dense} == {"bfloat16"}
    out = graph[graph.nodes[-1].inputs[0].node]
    assert graph.meta(graph.nodes[-1].inputs[0]).dtype == "float32", out
    # the user's model is left as it was
    assert "forward" not in model.__dict__ and next(model.parameters()).dtype == torch.float32


def test_default_precision_follows_the_cluster_and_is_recorded():
    model, tokens, _ = build("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu = meshplan.plan(model, 2, (tokens,), mesh_shape=(2,))
        gpu = meshplan.plan(model, 2, (tokens,), mesh_shape=(2,), cluster="h100")
        gpu32 = meshplan.plan(model, 2, (tokens,), mesh_shape=(2,), cluster="h100", mixed_precision="fp32")
    assert cpu.precision is None and "precision: fp32" in cpu.summary()
    assert gpu.precision == MixedPrecision("bfloat16") and "precision: bf16 mixed precision" in gpu.summary()
    assert meshplan.Plan.from_json(gpu.to_json()).precision == gpu.precision
    # priced in bf16: compute at the bf16 peak, activations in 2 bytes; fp32 master weights, gradients and state
    assert gpu.compute_s < gpu32.compute_s
    assert gpu.memory.activations < gpu32.memory.activations
    assert gpu.memory.optimizer == gpu32.memory.optimizer  # (gradients held at the peak depend on where the peak is)
    # the fp32 masters plus the bf16 working copies still held at the peak (in backward: those not yet freed)
    assert gpu32.memory.params < gpu.memory.params < gpu32.memory.params * 3 // 2, (gpu.memory, gpu32.memory)
    assert gpu.peak_flops == 989e12 and gpu32.peak_flops == 67e12
    assert "MFU" in gpu.summary() and 0 < gpu.mfu < 1


def test_bad_precision_is_a_value_error():
    model, tokens, _ = build("gpt")
    with pytest.raises(ValueError, match="mixed_precision='int8' is not supported; allowed"):
        meshplan.plan(model, 2, (tokens,), mixed_precision="int8")
    with pytest.raises(ValueError, match="reduce_dtype='bfloat16' is not supported"):
        MixedPrecision(reduce_dtype="bfloat16")
    with pytest.raises(ValueError, match="param_dtype='float8' is not supported"):
        MixedPrecision(param_dtype="float8")


def test_policy_takes_torch_dtypes_and_rejects_a_device_without_bf16(monkeypatch):
    assert MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32) == MixedPrecision()
    MixedPrecision().check_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "an old GPU")
    with pytest.raises(ValueError, match=r"computes in bfloat16 but cuda:0 \(an old GPU\) has no bf16 support; plan with mixed_precision='fp32'"):
        MixedPrecision().check_device(torch.device("cuda", 0))


# ---------------------------------------------------------------- pipelined plans: one bf16 copy of the weights per step


def _pipeline_plans():
    model, tokens, _ = build("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {schedule: meshplan.plan(model, 2, (tokens,), cluster="cpu", mixed_precision="bf16", pipeline=meshplan.PipelineOptions(
                    degrees=(2,), microbatch_sizes=(2,), schedules=(schedule,))) for schedule in ("1f1b", "zbv")}


def _pipeline_worker(rank, world, plans):
    out = {}
    for schedule, plan in plans.items():
        model, tokens, _ = build("gpt")
        runner = meshplan.auto_parallelize(model, example_inputs=(tokens,), plan=plan, loss_fn=lambda o, y: loss_fn("gpt", o, y))
        hoisted = sum(len(m._cast_of) for m in runner.pipeline.stages.values())
        opt = torch.optim.SGD(runner.parameters(), lr=LR, momentum=0.9)
        losses = []
        for i in range(STEPS):
            losses.append(runner.step(batches(STEPS)[i], target=batches(STEPS)[i]))
            opt.step()
            opt.zero_grad()
        out[schedule] = ([None if x is None else float(x) for x in losses], hoisted,
                         {k: local_of(v.detach()) for k, v in runner.named_parameters()})
    return out


@pytest.mark.multiprocess
def test_bf16_pipeline_matches_one_process_and_casts_each_weight_once_per_step():
    plans = _pipeline_plans()
    results = run_local(2, _pipeline_worker, plans, timeout=900)
    model, _, _ = build("gpt")
    ref_losses, _ = train(model, batches(STEPS), STEPS, lambda m, x: reference_forward(m, x, torch.bfloat16))
    model32, _, _ = build("gpt")
    train(model32, batches(STEPS), STEPS)
    initial, ref, ref32 = dict(build("gpt")[0].named_parameters()), dict(model.named_parameters()), dict(model32.named_parameters())
    for schedule, plan in plans.items():
        assert plan.pipeline.schedule == schedule and plan.pipeline.degree == 2
        compared = 0
        for rank, result in enumerate(results):
            losses, hoisted, params = result[schedule]
            where = f"{schedule}, rank {rank}"
            assert hoisted >= len(params), f"{where}: {hoisted} casts made once per step for {len(params)} parameters"
            if losses[0] is not None:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{where}: {m}")
                compared += 1
            for fqn, local in params.items():  # the stage mesh is one device: the local tensor is the whole parameter
                moved = (ref[fqn] - initial[fqn]).detach().norm()
                err = float((local - ref[fqn].detach()).norm() / moved)
                noise = float((ref[fqn] - ref32[fqn]).detach().norm() / moved)
                assert err <= NOISE_FACTOR * noise + 1e-3, f"{where} param {fqn}: error {err:.2e} of its update, bf16's own {noise:.2e}"
        assert compared == 1, f"{schedule}: {compared} ranks returned losses"
