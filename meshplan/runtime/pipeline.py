"""Run a plan with a pipeline: each stage runs its intra-op plan on its sub-mesh, torch's schedules drive the stages.

The world is `degree` pipeline ranks x `plan.mesh.size` sub-mesh ranks, pipeline axis outermost:
global rank = stage_rank * mesh.size + sub-mesh rank. Every rank builds its per-rank program with
the plan's collectives (runtime/rewrite.py) on its stage's sub-mesh, cuts it at the planned stage
boundaries (runtime/stage_split.py) and wraps the stages it owns in `PipelineStage`s; the plan's
schedule class (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, ...) sends the
activations crossing a cut between ranks with the same sub-mesh coordinate, which hold the same
block of the crossing tensor.

Gradients are finished the way the plan lists (runtime/stage_grads.py): every gradient bucket of
the plan is all-reduced over its mesh axes (data parallel, and tensor-parallel replicas) once per
step, as soon as the last microbatch's backward has completed its gradients, overlapping the rest
of backward; at the end of the step, a parameter used by stages on several pipeline ranks (a tied
embedding and head) sums its gradient over them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.microbatch import TensorChunkSpec, sum_reducer
from torch.utils import _pytree as pytree

from meshplan.cost_model.schedule_kinds import TORCH_SCHEDULE_CLASS
from meshplan.ir.graph import Graph
from meshplan.ir.op_kinds import is_random
from meshplan.ir.placement import local_shape
from meshplan.plans.plan import Plan
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.local_view import local_view
from meshplan.runtime.offload import make_optimizer
from meshplan.runtime.parallel_module import (
    ParallelModule, _owner, as_dtensor, check_same_plan, default_weights, group_device, shard_tensor,
)
from meshplan.runtime.rewrite import local_program
from meshplan.runtime.rng import ProgramRng
from meshplan.runtime.stage_grads import StageGradSync, SyncingStage
from meshplan.runtime.stage_split import StageProgram, example_values, node_stages, split_program, unit_stages
from meshplan.runtime.weights import WeightSource


def stage_device(k: int, p: int, schedule: str) -> int:
    """Pipeline rank of virtual stage k: round robin, or down and back up for ZB-V's V."""
    return (k if k < p else 2 * p - 1 - k) if schedule == "zbv" else k % p


class StageModule(nn.Module):
    """One stage's program with the local parameter shards it reads (registered under the model's FQNs).

    Mixed precision: the program casts parameters to the compute dtype (ir/precision.py). Cast per
    microbatch, every microbatch in flight would keep its own copy of the stage's weights for its
    backward; so each cast of a parameter becomes an input of the program, computed once per step
    (`new_step()`) and shared by the step's microbatches, as Megatron keeps one bf16 copy of the weights."""

    def __init__(self, program: StageProgram, leaves: dict[str, torch.Tensor], fqns: dict[str, tuple[str, ...]],
                 localise: Callable[[str, torch.Tensor], torch.Tensor] | None, out_spec) -> None:
        super().__init__()
        self.program, self.index = program.gm, program.index
        self._carried = program.carried_in
        self._leaves = [leaves[name] for name in program.locals_in]
        self._cast_of = _hoist_weight_casts(self.program, program.locals_in)
        self._casts: list[torch.Tensor] | None = None
        self._localise, self._out_spec = localise, out_spec
        for name in program.locals_in:
            for fqn in fqns.get(name, ()):
                t = leaves[name]
                if isinstance(t, nn.Parameter):
                    setattr(_owner(self, fqn), fqn.rsplit(".", 1)[-1], t)
                else:
                    _owner(self, fqn).register_buffer(fqn.rsplit(".", 1)[-1], t, persistent=False)

    def forward(self, *carried):
        if self._localise is not None:  # stage 0: the user's (global) microbatch, sharded as the plan says
            carried = tuple(self._localise(n, x) for n, x in zip(self._carried, carried))
        # DTensor parameters and buffers: the program takes their local views where it uses them
        if self._casts is None:
            self._casts = [local_view(self._leaves[i]).to(dtype) for i, dtype in self._cast_of]
        out = self.program(*carried, *self._leaves, *self._casts)
        if self._out_spec is not None:
            return pytree.tree_unflatten(list(out), self._out_spec)
        return out if len(out) != 1 else out[0]

    def new_step(self) -> None:
        """Drop this step's weight copies; the next forward casts the (updated) parameters again."""
        self._casts = None


def _hoist_weight_casts(gm: fx.GraphModule, locals_in: tuple[str, ...]) -> list[tuple[int, torch.dtype]]:
    """Turn every cast of a local's view (a parameter's) in `gm` into a new trailing placeholder; returns, per
    new placeholder, the local's index and the dtype to cast it to."""
    index = {name: i for i, name in enumerate(locals_in)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[tuple[int, torch.dtype]] = []
    for n in list(gm.graph.nodes):
        view = n.args[0] if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) else None
        if not (n.target is torch.ops.aten._to_copy.default and len(n.args) == 1 and set(n.kwargs) <= {"dtype"}
                and view is not None and view.target is local_view and view.args[0].name in index):
            continue
        out.append((index[view.args[0].name], n.kwargs["dtype"]))
        with gm.graph.inserting_after(placeholders[-1]):
            cast = gm.graph.placeholder(f"{n.name}_once")
        cast.meta.update(n.meta)
        placeholders.append(cast)
        n.replace_all_uses_with(cast)
        gm.graph.erase_node(n)
        if not view.users:
            gm.graph.erase_node(view)
    if out:
        gm.graph.lint()
        gm.recompile()
    return out


def output_merge_spec(outputs: tuple[torch.Tensor, ...], out_spec):
    """How torch's schedule merges the last stage's microbatch outputs: along the batch dim, but a scalar (a model
    that returns its loss) as the microbatches' sum, which `torch.cat` cannot do."""
    flat = [sum_reducer if t.dim() == 0 else TensorChunkSpec(0) for t in outputs]
    return pytree.tree_unflatten(flat, out_spec) if out_spec is not None else (flat[0] if len(flat) == 1 else tuple(flat))


class PipelineRunner:
    """This rank's stages of a pipelined plan. `step(x, y)` runs one training step (forward, backward, gradient sync)
    over the whole batch; the user's optimizer steps `parameters()` afterwards, as with any module."""

    def __init__(self, model: nn.Module, graph: Graph, plan: Plan, loss_fn: Callable, *, timeout: timedelta | float | None = None,
                 weights: WeightSource | None = None) -> None:
        pipe = plan.pipeline
        if pipe is None:
            raise ValueError("PipelineRunner needs a plan with a pipeline (plan.pipeline is None); use ParallelModule for single-stage plans")
        if plan.graph_fingerprint != graph.fingerprint():
            raise ValueError(f"plan was made for a different graph (fingerprint {plan.graph_fingerprint}, this model traces to "
                             f"{graph.fingerprint()}); trace the model at the plan's microbatch or re-plan")
        n, p = plan.mesh.size, pipe.degree
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != p * n:
            raise ValueError(f"the plan runs {p} pipeline stages x {n} devices each = {p * n} ranks; the world has {world}")
        self.plan, self.pipe, self.loss_fn = plan, pipe, loss_fn
        self.stage_rank, self.local = divmod(rank, n)
        axis_sets = [tuple(range(plan.mesh.ndim))] + [(a,) for a in range(plan.mesh.ndim)] + [b.axes for b in plan.buckets]
        device = group_device()
        if plan.precision is not None:
            plan.precision.check_device(device)
        self.comm = MeshComm(plan.mesh, self.local, range(self.stage_rank * n, (self.stage_rank + 1) * n), timeout=timeout, device=device)
        self.comm.create_groups(axis_sets)  # each stage's groups, by its own ranks only
        check_same_plan(plan, self.comm, group=None, rank=rank)
        pp_groups = [dist.new_group([s * n + j for s in range(p)], timeout=self.comm.timeout) for j in range(n)]

        # cut this rank's program at the planned stages
        program = local_program(graph.fx, plan, self.comm)
        of_traced = unit_stages(graph, pipe)
        n_stages = len(pipe.stages)
        self.stage_of_node = of_traced
        traced = self._traced = graph.fx
        leaf_nodes = {prm.node for prm in plan.params}
        placeholders = [x.name for x in traced.gm.graph.nodes if x.op == "placeholder"]
        user_inputs = [x for x in placeholders if x not in leaf_nodes and x not in traced.constants]
        programs = split_program(program, node_stages(program, of_traced, n_stages - 1), n_stages, user_inputs)
        self.owner = {k: stage_device(k, p, pipe.schedule) for k in range(n_stages)}
        self.mine = [k for k in range(n_stages) if self.owner[k] == self.stage_rank]

        # parameters: this rank's blocks of those its stages read, as DTensors on its stage's sub-mesh (the
        # model's own tensors are rank 0's, as one job; a meta model's come from its initialisation or `weights`).
        # Data-parallel stages keep plain tensors, as ParallelModule does: a DTensor gradient accumulated once per
        # microbatch made a tiny 2-stage GPT's 1F1B step 2.7x slower (61.8 vs 20.2 ms at 8 microbatches, gloo, CPU)
        needed = {name for k in self.mine for name in programs[k].locals_in}
        full = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        weights = weights or default_weights(model, device, whole_job=True)
        self.device_mesh = self.comm.device_mesh
        self.leaves: dict[str, torch.Tensor] = {}
        blocks = weights.blocks(plan.params, self.comm, wanted=needed)
        plain = plan.plain_params
        for prm in plan.params:
            if prm.node in needed:
                local = blocks.pop(prm.node) if plain else as_dtensor(blocks.pop(prm.node), prm.layout, prm.shape, self.comm)
                self.leaves[prm.node] = local if prm.is_buffer else nn.Parameter(local, requires_grad=full[prm.fqns[0]].requires_grad)
        self.leaves.update({k: v for k, v in traced.constants.items() if k in needed})
        fqns = {prm.node: prm.fqns for prm in plan.params}
        self.fqn_of = {prm.node: prm.fqns[0] for prm in plan.params}
        self._fqns = fqns
        self.process_group = None
        """every rank of the job (checkpoints are saved and loaded over it)"""
        self.offload_copies: dict[str, nn.Parameter] = {}
        """FQN -> host copy of each parameter whose optimizer state `make_optimizer` offloads"""
        self.pp_group = pp_groups[self.local]
        self._rng = ProgramRng(None, device, 0, self.comm.guard) if any(is_random(x.target) for x in graph.nodes if x.kind == "op") else None

        # a parameter read on several pipeline ranks (tied embedding / head) sums its gradient over them
        holders: dict[str, set[int]] = {}
        for prog in programs:
            for name in prog.locals_in:
                if name in leaf_nodes:
                    holders.setdefault(name, set()).add(self.owner[prog.index])
        self.tied = {name: tuple(sorted(h)) for name, h in holders.items() if len(h) > 1}
        self.tied_groups = {}
        for devs in sorted(set(self.tied.values())):
            for j in range(n):
                g = dist.new_group([s * n + j for s in devs], timeout=self.comm.timeout)
                if j == self.local and self.stage_rank in devs:
                    self.tied_groups[devs] = g

        inputs = {i.name: i for i in plan.inputs}
        self.modules = {
            k: StageModule(programs[k], self.leaves, fqns, self._localiser(inputs) if k == 0 else None,
                           traced.out_spec if k == n_stages - 1 else None)
            for k in self.mine
        }
        trainable = self._params()
        holders = {name: {k for k in self.mine if name in programs[k].locals_in} for name in trainable}
        self._grad_sync = StageGradSync(plan.buckets, trainable, holders, self.tied, self.tied_groups, pipe.microbatches,
                                        self.comm, self.fqn_of)
        stages = [
            SyncingStage(self.modules[k], k, n_stages, device, group=pp_groups[self.local],
                         input_args=example_values(program, programs[k].carried_in, graph, plan),
                         output_args=example_values(program, programs[k].carried_out if k < n_stages - 1 else None, graph, plan),
                         sync=self._grad_sync)
            for k in self.mine
        ]
        cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASS[pipe.schedule])
        # gradients are scaled once per parameter by StageGradSync (a parameter two local stages share would be scaled twice by torch)
        kwargs = dict(n_microbatches=pipe.microbatches, loss_fn=self._loss, scale_grads=False,
                      output_merge_spec=output_merge_spec(example_values(program, None, graph, plan), traced.out_spec))
        self.schedule = cls(stages[0], **kwargs) if issubclass(cls, torch_schedules.PipelineScheduleSingle) else cls(stages, **kwargs)
        self.is_first, self.is_last = 0 in self.mine, (n_stages - 1) in self.mine

    def _loss(self, out, target) -> torch.Tensor:
        """The user's loss of one microbatch. Zero-bubble schedules detach the loss in place after its input
        backward (torch's `stage_backward_input`), which fails on a view (a model that returns its own loss
        can hand back one): such a loss is cloned first."""
        loss = self.loss_fn(out, target)
        return loss.clone() if loss._is_view() else loss

    def _localiser(self, inputs: dict):
        mesh, local = self.plan.mesh, self.local
        global_inputs = self.plan.inputs_mode == "global"

        def localise(name: str, x):
            choice = inputs.get(name)
            if choice is None or not isinstance(x, torch.Tensor):
                return x
            x = x.to(self.comm.device)
            want = choice.shape if global_inputs else local_shape(choice.shape, choice.layout, mesh.shape)
            if tuple(x.shape) != tuple(want):
                raise ValueError(f"microbatch input {name} has shape {list(x.shape)} but the plan was made for {list(want)} "
                                 f"({self.pipe.microbatches} microbatches per step); re-plan for the new batch")
            return shard_tensor(x, choice.layout, mesh, local) if global_inputs else x

        return localise

    # ------------------------------------------------------------------ training

    def parameters(self):
        return iter(self._params().values())

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by model FQN (every alias of a tied weight), as DTensors on its
        stage's sub-mesh: `meshplan.save_checkpoint` / `load_checkpoint` take a runner like a ParallelModule,
        and a checkpoint saved under one plan (pipelined or not) loads under any other."""
        out = {}
        for node, t in self.leaves.items():
            for fqn in self._fqns.get(node, ()):
                out[fqn] = t if keep_vars else t.detach()
        return out

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        """`optimizer_cls(self.parameters(), **kwargs)`, with host-memory state for parameters the plan offloads."""
        return make_optimizer(self, self.plan, self.leaves, optimizer_cls, **kwargs)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`clip_grad_norm_` over the whole model's gradients, which live on several pipeline ranks: each rank's
        stages contribute their norm (a tied weight once, on its first holder), summed over the pipeline.
        `torch.nn.utils.clip_grad_norm_(runner.parameters())` would see this rank's stages only."""
        params = self._params()
        counted = [p for name, p in params.items() if p.grad is not None and self.tied.get(name, (self.stage_rank,))[0] == self.stage_rank]
        norm_type = float(norm_type)
        if counted:
            local = torch.nn.utils.get_total_norm([p.grad for p in counted], norm_type)
            local = local.full_tensor() if isinstance(local, DTensor) else local  # over the stage's sub-mesh
        else:
            local = torch.zeros((), device=self.comm.device)
        if norm_type == float("inf"):
            total = local.clone()
            with self.comm.guard("the gradient norm's maximum over pipeline ranks"):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.pp_group)
        else:
            total = local.pow(norm_type)
            with self.comm.guard("the gradient norm's sum over pipeline ranks"):
                dist.all_reduce(total, group=self.pp_group)
            total = total.pow(1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_([p for p in params.values() if p.grad is not None], max_norm, total)
        return total

    def named_parameters(self):
        """(model FQN, local shard) of the parameters this rank's stages hold; a tied weight under its first name."""
        return iter((self.fqn_of[k], v) for k, v in self._params().items())

    def _params(self) -> dict[str, nn.Parameter]:
        return {k: v for k, v in self.leaves.items() if isinstance(v, nn.Parameter) and v.requires_grad}

    def step(self, *inputs, target: torch.Tensor, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor | None:
        """Forward and backward of one whole batch (split into the plan's microbatches) and the gradient sync.

        Every rank passes the same batch, `inputs` and the model's keyword inputs `kwargs` as traced (the first stage
        needs them, the target the last). `loss_fn` replaces the one given at construction. Returns the mean microbatch
        loss on the last stage's ranks, None elsewhere."""
        if loss_fn is not None:
            self.loss_fn = loss_fn
        tensors = self._traced.user_inputs(inputs, kwargs)  # every rank checks the call: a bad one fails everywhere at once
        losses: list[torch.Tensor] = []
        args = tuple(tensors) if self.is_first else ()
        ends = {"target": target, "losses": losses} if self.is_last else {}
        # gradient accumulation over steps: earlier steps' gradients are summed already; only this step's are scaled and summed
        earlier = {}
        for name, prm in self._params().items():
            earlier[name], prm.grad = prm.grad, None
        self._grad_sync.start()
        try:
            with self._rng.active() if self._rng is not None else contextlib.nullcontext():
                self.schedule.step(*args, return_outputs=False, **ends)  # the losses are what step() returns: no output kept
        finally:
            for module in self.modules.values():
                module.new_step()  # the step's weight copies are not kept: the next step casts the updated weights
        self._grad_sync.finish()
        for name, prm in self._params().items():
            if earlier[name] is not None:
                prm.grad = earlier[name].add_(prm.grad)
        return torch.stack([x.detach() for x in losses]).mean() if self.is_last else None

    @property
    def overlapped_buckets(self) -> int:
        """Gradient buckets of the last step whose all-reduce started before the schedule ended."""
        return self._grad_sync.overlapped

    def no_sync(self):
        raise ValueError("no_sync() defers gradient reductions between backward calls, and a pipelined plan runs its whole "
                         "batch in one step() call: pass the accumulated batch to step() instead (the plan splits it into "
                         f"{self.pipe.microbatches} microbatches)")

    # ------------------------------------------------------------------ the plan is the truth

    def expected_collectives(self) -> Counter:
        """What the plan lists for this rank's stages in one step: each microbatch's moves (forward, backward,
        recompute) of the ops its stages hold and those ops' own collectives, its gradient buckets and tied-weight sums."""
        m, last = self.pipe.microbatches, len(self.pipe.stages) - 1
        mine = set(self.mine)
        c: Counter = Counter()
        recomputed = set(self.plan.recompute)
        per_microbatch = [t.collectives() for t in self.plan.transfers
                    if (last if t.consumer == "output" else self.stage_of_node[t.consumer]) in mine]
        per_microbatch += [n.collectives(recomputed) for n in self.plan.nodes if self.stage_of_node[n.name] in mine]  # region ops' own
        for kinds in per_microbatch:
            for k in kinds:
                c[k] += m
        held = set(self._params())
        c["grad_sync:all_reduce"] += sum(1 for b in self.plan.buckets if held & set(b.params))
        c["tied_sync:all_reduce"] += sum(1 for name in self.tied if name in held)
        return +c

    # the process-wide counters, read and reset as a ParallelModule does
    collective_counts = staticmethod(ParallelModule.collective_counts)
    reset_collective_counts = staticmethod(ParallelModule.reset_collective_counts)


__all__ = ["PipelineRunner", "stage_device"]
