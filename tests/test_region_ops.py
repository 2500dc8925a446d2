"""Region ops are plugins: the built-in ones are registered objects, and a region op written outside
meshplan (trace hook, rule, cost and per-rank module, registered with `meshplan.register_region_op`)
is traced, planned, priced, listed in the plan and trains with parity on gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import meshplan
from meshplan.cost_model.estimate import steps_time
from meshplan.cost_model.memory import MemoryBreakdown
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost
from meshplan.ir.placement import Shard
from meshplan.ir.regions import REGION_OPS, KernelRow, RegionOp, region_op
from meshplan.ir.trace import trace
from meshplan.plans.pipeline import PipelinePlan, PipelineStage
from meshplan.runtime.collectives import all_reduce_axes, forward_phase
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import ParallelModule, shard_tensor

STEPS = 3


# ---------------------------------------------------------------- a user's op: rows divided by their sums

@torch.library.custom_op("meshplan_test::row_normalize", mutates_args=())
def row_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


@row_normalize.register_fake
def _row_normalize_fake(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], output)


def _backward(ctx, grad):
    x, y = ctx.saved_tensors  # y = x / s: dx = (grad - sum(grad * y)) / s
    return (grad - (grad * y).sum(-1, keepdim=True)) / x.sum(-1, keepdim=True)


row_normalize.register_autograd(_backward, setup_context=_setup)
ROW_NORMALIZE = torch.ops.meshplan_test.row_normalize.default


class RowNormalize(nn.Module):
    """What the user's model holds: plain torch, traced as one call of the op."""

    def forward(self, x):
        return x / x.sum(-1, keepdim=True)


class _SplitRowNormalize(torch.autograd.Function):
    """The rows split along their last dim over `axes`: the sums are all-reduced (forward and backward)."""

    @staticmethod
    def forward(ctx, x, comm, axes):
        s = all_reduce_axes(x.sum(-1, keepdim=True), comm, axes, forward_phase(), "row sums")
        y = x / s
        ctx.save_for_backward(y, s)
        ctx.comm, ctx.axes = comm, axes
        return y

    @staticmethod
    def backward(ctx, grad):
        y, s = ctx.saved_tensors
        t = all_reduce_axes((grad * y).sum(-1, keepdim=True), ctx.comm, ctx.axes, "backward", "row sums of grad * y")
        return (grad - t) / s, None, None


class SplitRowNormalize(nn.Module):
    def __init__(self, comm, axes) -> None:
        super().__init__()
        self.comm, self.axes = comm, axes

    def forward(self, x):
        return _SplitRowNormalize.apply(x, self.comm, self.axes)


def _split_axes(strategy) -> tuple[int, ...]:
    """Mesh axes that split the kernel's dim ('row_normalize(dim=d)')."""
    dim = int(strategy.kernel.removeprefix("row_normalize(dim=").rstrip(")"))
    return tuple(a for a, p in enumerate(strategy.inputs[0]) if p == Shard(dim))


class RowNormalizeRegion(RegionOp):
    name = "row_normalize"
    ops = (ROW_NORMALIZE,)

    def matches(self, module):
        return isinstance(module, RowNormalize)

    def traced_forward(self, module, x):
        return ROW_NORMALIZE(x)

    def rule(self, args, kwargs):
        x = args[0]
        rows = [[Shard(d), Shard(d)] for d in range(x.ndim - 1)]
        rows.append(KernelRow([Shard(x.ndim - 1), Shard(x.ndim - 1)], f"row_normalize(dim={x.ndim - 1})"))
        return rows

    def cost(self, node, in_metas, strategy, mesh_shape, cluster, *, backward):
        if not strategy.kernel:
            return None
        x = in_metas[0]
        nbytes = x.numel // x.shape[-1] * x.itemsize  # one sum per row
        fwd = tuple(CommStep("all_reduce", a, nbytes=nbytes) for a in _split_axes(strategy))
        bwd = fwd if backward else ()
        return RegionCost(compute_s=1e-6, forward=fwd, backward=bwd,
                          comm_s=steps_time(list(fwd), mesh_shape, cluster) + steps_time(list(bwd), mesh_shape, cluster))

    def local_module(self, strategy, comm, args):
        return SplitRowNormalize(comm, _split_axes(strategy)) if strategy.kernel else None


meshplan.register_region_op(RowNormalizeRegion())  # module level: every spawned rank imports this file and registers it too


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = RowNormalize()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.norm(torch.sigmoid(self.fc1(x)) + 0.5))


def _net_and_data():
    torch.manual_seed(0)
    net = Net()
    g = torch.Generator().manual_seed(1)
    return net, torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _train(model, x, y) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _kernel_plan():
    net, x, _ = _net_and_data()
    meshplan.shard(net.norm, in_strategy=((1, 2),))  # the rows split along their last dim: only the kernel can run that
    return meshplan.plan(net, devices=2, example_inputs=(x,))


# ---------------------------------------------------------------- tests

def test_builtin_region_ops_are_registered_objects():
    names = {r.name for r in REGION_OPS.values()}
    assert {"moe", "batch_norm", "log_softmax", "masked_embedding", "masked_gather"} <= names
    assert region_op("aten._log_softmax.default").name == "log_softmax"
    assert region_op(torch.ops.aten.mm.default) is None


def test_bad_registrations_are_value_errors():
    with pytest.raises(ValueError, match="takes a RegionOp instance; got type"):
        meshplan.register_region_op(RowNormalizeRegion)
    nameless = RegionOp()
    with pytest.raises(ValueError, match="needs a name and at least one op"):
        meshplan.register_region_op(nameless)
    with pytest.raises(ValueError, match="'row_normalize' is already registered"):
        meshplan.register_region_op(RowNormalizeRegion())
    clash = RowNormalizeRegion()
    clash.name = "another"
    with pytest.raises(ValueError, match=r"'another': ops \['meshplan_test.row_normalize.default'\] already belong to 'row_normalize'"):
        meshplan.register_region_op(clash)


def test_a_user_region_op_is_traced_planned_and_priced():
    plan = _kernel_plan()
    (node,) = [n for n in plan.nodes if n.target == str(ROW_NORMALIZE)]
    assert node.strategy.kernel == "row_normalize(dim=1)" and node.strategy.source == "meshplan"
    assert [s.kind for s in node.forward_comm] == ["all_reduce"] and [s.kind for s in node.backward_comm] == ["all_reduce"]
    assert node.forward_comm[0].nbytes == 6 * 4  # one fp32 sum per row of the [6, 16] input
    assert node.time_s == pytest.approx(1e-6)  # the region op's own compute price
    assert plan.collectives()["forward:all_reduce"] >= 1 and plan.collectives()["backward:all_reduce"] >= 1


def _rank(rank: int, world: int, plan):
    net, x, y = _net_and_data()
    pmodel = meshplan.auto_parallelize(net, devices=world, example_inputs=(x,), plan=plan)
    pmodel.reset_collective_counts()
    losses = _train(pmodel, x, y)
    return losses, pmodel.collective_counts(), {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}


@pytest.mark.multiprocess
def test_a_user_region_op_trains_with_parity_and_runs_what_the_plan_lists():
    plan = _kernel_plan()
    net, x, y = _net_and_data()
    reference = _train(net, x, y)
    expected = {k: v * STEPS for k, v in plan.collectives().items()}
    layouts = {f: p.layout for p in plan.params for f in p.fqns}
    for rank, (losses, counts, params) in enumerate(run_local(2, _rank, plan, timeout=300)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
        for fqn, local in params.items():
            want = shard_tensor(dict(net.named_parameters())[fqn].detach(), layouts[fqn], plan.mesh, rank)
            torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {fqn}: {m}")
        assert dict(counts) == expected


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = RowNormalize()

    def forward(self, x):
        return self.norm(torch.sigmoid(self.fc(x)) + 0.5)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _stack_and_data():
    torch.manual_seed(0)
    model = Stack()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


MICROBATCHES = 2


def _pipelined_kernel_plan():
    """Two 1F1B stages of 2 devices each; in both, the rows reach the op split along their last dim (the kernel).
    The pipeline search refuses annotations, so the stage plan is planned at the microbatch size and cut by hand."""
    model, x, _ = _stack_and_data()
    for layer in model.layers:
        meshplan.shard(layer.norm, in_strategy=((1, 2),))
    stage_plan = meshplan.plan(model, 2, (x[: len(x) // MICROBATCHES],), cluster="cpu")
    zero = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0)
    stages = tuple(PipelineStage(index=k, device=k, units=units, modules=(units[0],), time_s=0.0, recompute=False, memory=zero)
                   for k, units in enumerate((("pre", "layers.0"), ("layers.1", "post"))))
    pipe = PipelinePlan(degree=2, schedule="1f1b", microbatches=MICROBATCHES, chunks=1, stages=stages, step_s=0.0, bubble_s=0.0,
                        bubble_fraction=0.0, p2p_s=0.0)
    return dataclasses.replace(stage_plan, pipeline=pipe)


def _pipeline_rank(rank: int, world: int, plan):
    model, x, y = _stack_and_data()
    runner = ParallelModule(model, trace(model, (x[: len(x) // MICROBATCHES],)), plan, loss_fn=nn.functional.mse_loss)
    runner.reset_collective_counts()
    loss = runner.step(x, target=y)
    grads = {n: local_of(p.grad).clone() for n, p in runner.named_parameters()}
    return None if loss is None else float(loss), grads, runner.comm.rank, runner.collective_counts(), runner.pipeline.expected_collectives()


@pytest.mark.multiprocess
def test_a_region_op_in_pipeline_stages_runs_what_the_stage_plans_list():
    plan = _pipelined_kernel_plan()
    assert [n.strategy.kernel for n in plan.nodes if n.target == str(ROW_NORMALIZE)] == ["row_normalize(dim=1)"] * 2
    model, x, y = _stack_and_data()
    reference = nn.functional.mse_loss(model(x), y)
    reference.backward()
    layouts = {p.fqns[0]: p.layout for p in plan.params}
    results = run_local(4, _pipeline_rank, plan, timeout=300)
    losses = [r[0] for r in results if r[0] is not None]
    assert losses and all(abs(v - reference.item()) < 1e-5 for v in losses)
    seen = set()
    for rank, (_, grads, local, counts, expected) in enumerate(results):
        for name, g in grads.items():
            want = shard_tensor(dict(model.named_parameters())[name].grad, layouts[name], plan.mesh, local)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
            seen.add(name)
        assert expected["forward:all_reduce"] >= plan.pipeline.microbatches  # the kernel's own, once per microbatch
        assert dict(counts) == dict(expected), f"rank {rank} ran {dict(counts)}, the plan lists {dict(expected)}"
    assert seen == {n for n, _ in model.named_parameters()}
