"""The pipeline of a pipelined plan: this rank's stages and the torch schedule that runs them.

A `ParallelModule` whose plan has a pipeline runs it through a `Pipeline` (runtime/parallel_module.py holds
everything else: parameters, inputs, the plan check, weights, clipping). The world is `degree` pipeline
ranks x `plan.mesh.size` sub-mesh ranks, pipeline axis outermost: global rank = stage_rank * mesh.size +
sub-mesh rank. Every rank builds its per-rank program with the plan's collectives (runtime/rewrite.py) on
its stage's sub-mesh, cuts it at the planned stage boundaries (`cut_program`, runtime/stage_split.py) and
wraps the stages it owns in `PipelineStage`s; the plan's schedule class (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, ...) sends the activations crossing a cut between ranks with the same sub-mesh
coordinate, which hold the same block of the crossing tensor.

Gradients are finished the way the plan lists (runtime/stage_grads.py): every gradient bucket of
the plan is all-reduced over its mesh axes (data parallel, and tensor-parallel replicas) once per
step, as soon as the last microbatch's backward has completed its gradients, overlapping the rest
of backward; at the end of the step, a parameter used by stages on several pipeline ranks (a tied
embedding and head) sums its gradient over them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.microbatch import TensorChunkSpec, sum_reducer
from torch.utils import _pytree as pytree

from meshplan.cost_model.schedule_kinds import TORCH_SCHEDULE_CLASS
from meshplan.ir.graph import Graph
from meshplan.plans.plan import Plan
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.local_view import local_view
from meshplan.runtime.rewrite import output_layouts
from meshplan.runtime.stage_grads import StageGradSync, SyncingStage
from meshplan.runtime.stage_split import StageProgram, example_values, node_stages, split_program, unit_stages


def stage_device(k: int, p: int, schedule: str) -> int:
    """Pipeline rank of virtual stage k: round robin, or down and back up for ZB-V's V."""
    return (k if k < p else 2 * p - 1 - k) if schedule == "zbv" else k % p


@dataclasses.dataclass(frozen=True, slots=True)
class StageCut:
    """One rank's per-rank program cut at the planned stages."""

    programs: list[StageProgram]
    """Every stage's program (stage k at index k), this rank's and the others'."""
    stage_of_node: dict[str, int]
    """Traced node -> the stage that runs it."""
    owner: dict[int, int]
    """Stage -> the pipeline rank that runs it."""
    rank: int
    """This rank's pipeline rank."""

    @property
    def mine(self) -> list[int]:
        """The stages this rank runs."""
        return [k for k, r in self.owner.items() if r == self.rank]

    @property
    def needed(self) -> set[str]:
        """Placeholders (parameters, buffers, constants) this rank's stages read."""
        return {name for k in self.mine for name in self.programs[k].locals_in}


def cut_program(program: fx.GraphModule, graph: Graph, plan: Plan, stage_rank: int) -> StageCut:
    """`program` (this rank's, from `graph`) cut at `plan`'s stages; `stage_rank`: this rank's pipeline rank."""
    pipe = plan.pipeline
    of_traced = unit_stages(graph, pipe)
    n_stages = len(pipe.stages)
    leaf_nodes = {prm.node for prm in plan.params}
    placeholders = [x.name for x in graph.fx.gm.graph.nodes if x.op == "placeholder"]
    user_inputs = [x for x in placeholders if x not in leaf_nodes and x not in graph.fx.constants]
    programs = split_program(program, node_stages(program, of_traced, n_stages - 1), n_stages, user_inputs)
    owner = {k: stage_device(k, pipe.degree, pipe.schedule) for k in range(n_stages)}
    return StageCut(programs, of_traced, owner, stage_rank)


class StageModule(nn.Module):
    """One stage's program with the local parameter shards it reads (registered so that torch's stage finds them).

    Mixed precision: the program casts parameters to the compute dtype (ir/precision.py). Cast per
    microbatch, every microbatch in flight would keep its own copy of the stage's weights for its
    backward; so each cast of a parameter becomes an input of the program, computed once per step
    (`new_step()`) and shared by the step's microbatches, as Megatron keeps one bf16 copy of the weights."""

    def __init__(self, program: StageProgram, leaves: dict[str, torch.Tensor],
                 localise: Callable[[str, torch.Tensor], torch.Tensor] | None, out_spec) -> None:
        super().__init__()
        self.program, self.index = program.gm, program.index
        self._carried = program.carried_in
        self._leaves = [leaves[name] for name in program.locals_in]
        self._cast_of = _hoist_weight_casts(self.program, program.locals_in)
        self._casts: list[torch.Tensor] | None = None
        self._localise, self._out_spec = localise, out_spec
        for i, t in enumerate(self._leaves):
            if isinstance(t, nn.Parameter):  # torch's stage steps the weight part of backward over submod.parameters()
                self.register_parameter(f"local_{i}", t)

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


class Pipeline:
    """This rank's stages of a pipelined plan, driven by the plan's torch schedule: one per mode of the module
    (the eval-mode program is cut at the same stages and runs forward only).

    `leaves`: program placeholder -> the parameter, buffer or constant it takes (those of this rank's stages);
    `localise(name, x)`: the user's input `name` as this rank's block; `comm`: this rank's place on the stage sub-mesh;
    `pp_group`: the ranks at this rank's sub-mesh position on every pipeline rank; `sync`: the gradient sync (None:
    forward only)."""

    def __init__(self, cut: StageCut, graph: Graph, plan: Plan, program: fx.GraphModule, leaves: dict[str, torch.Tensor],
                 localise: Callable, comm: MeshComm, pp_group, sync: StageGradSync | None) -> None:
        pipe = plan.pipeline
        n_stages = len(pipe.stages)
        device = comm.device
        self.cut, self.plan, self.comm, self.pp_group, self.sync = cut, plan, comm, pp_group, sync
        self._handed_out = {i: layout for i, layout in enumerate(output_layouts(graph, plan)) if any(p != Replicate() for p in layout)}
        """flat output index -> its layout, for the outputs the last stage hands the loss function as blocks
        (`PlanOptions.loss_only`)"""
        self.traced = graph.fx
        """the traced program the stages were cut from (it binds the user's calls)"""
        self.loss_fn: Callable | None = None
        """the loss of the step running (`step` sets it)"""
        self.stages = {k: StageModule(cut.programs[k], leaves, localise if k == 0 else None,
                                      graph.fx.out_spec if k == n_stages - 1 else None) for k in cut.mine}
        """stage index -> this rank's module running it"""
        torch_stages = []
        for k in cut.mine:
            args = dict(group=pp_group, input_args=example_values(program, cut.programs[k].carried_in, graph, plan, whole_inputs=k == 0),
                        output_args=example_values(program, cut.programs[k].carried_out if k < n_stages - 1 else None, graph, plan))
            torch_stages.append(SyncingStage(self.stages[k], k, n_stages, device, sync=sync, **args) if sync is not None
                                else PipelineStage(self.stages[k], k, n_stages, device, **args))
        cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASS[pipe.schedule])
        # gradients are scaled once per parameter by StageGradSync (a parameter two local stages share would be scaled twice by torch)
        kwargs = dict(n_microbatches=pipe.microbatches, loss_fn=self._loss, scale_grads=False,
                      output_merge_spec=output_merge_spec(example_values(program, None, graph, plan), graph.fx.out_spec))
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        self.schedule = cls(torch_stages[0], **kwargs) if single else cls(torch_stages, **kwargs)
        self.is_first, self.is_last = 0 in cut.mine, (n_stages - 1) in cut.mine

    def _loss(self, out, target) -> torch.Tensor:
        """The user's loss of one microbatch. Zero-bubble schedules detach the loss in place after its input
        backward (torch's `stage_backward_input`), which fails on a view (a model that returns its own loss
        can hand back one): such a loss is cloned first."""
        if not self._handed_out:
            loss = self.loss_fn(out, target)
        else:  # blocks of the model's other outputs reach the user's loss as the DTensors they are
            flat, spec = pytree.tree_flatten(out)
            mesh = self.comm.device_mesh
            for i, layout in self._handed_out.items():
                flat[i] = DTensor.from_local(flat[i], mesh, layout, run_check=False)
            # the target is whole on every rank: a replicated DTensor (also for the backward of ops that save it); a
            # plain tensor the loss meets, the model's own loss, is the same on every rank too
            whole = [Replicate()] * mesh.ndim
            target = pytree.tree_map_only(torch.Tensor, lambda t: DTensor.from_local(t, mesh, whole, run_check=False), target)
            with implicit_replication():
                loss = self.loss_fn(pytree.tree_unflatten(flat, spec), target)
            if isinstance(loss, DTensor):  # a loss computed from them: the same value on every rank
                loss = loss.full_tensor()
        return loss.clone() if loss._is_view() else loss

    def step(self, inputs: list, target, loss_fn: Callable, *, backward: bool) -> torch.Tensor | None:
        """One step over the whole batch (`inputs`, bound as traced): forward, the loss and, if `backward`, backward
        and the gradient sync. Returns the mean microbatch loss on the last stage's ranks, None elsewhere."""
        if backward and self.sync is None:
            raise AssertionError("a forward-only pipeline (the eval-mode program) was asked for a backward step")
        if not backward and self.plan.pipeline.schedule == "zbv":
            raise ValueError("an evaluation step (eval mode or torch.no_grad()) runs the pipeline forward only, which torch's "
                             "ScheduleZBVZeroBubble cannot do (it runs its backward actions all the same); evaluate under a "
                             "plan with another schedule")
        self.loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        ends = {"target": target, "losses": losses} if self.is_last else {}
        if backward:
            self.sync.start()
        try:  # the losses are what step() returns: no output kept
            (self.schedule.step if backward else self.schedule.eval)(*args, return_outputs=False, **ends)
        finally:
            for module in self.stages.values():
                module.new_step()  # the step's weight copies are not kept: the next step casts the updated weights
        if backward:
            self.sync.finish()
        return torch.stack([x.detach() for x in losses]).mean() if self.is_last else None

    def counts_in_norm(self, node: str) -> bool:
        """Whether this rank's part of parameter `node`'s gradient counts in the norm: a tied weight's, reduced
        over the pipeline ranks sharing it, counts on the first of them only."""
        return self.sync.tied.get(node, (self.cut.rank,))[0] == self.cut.rank

    @torch.no_grad()
    def total_norm(self, local: torch.Tensor, norm_type: float, guard) -> torch.Tensor:
        """The gradient norm over every pipeline rank from this rank's `local` one (a tied weight counted on one rank)."""
        if norm_type == float("inf"):
            total = local.clone()
            with guard("the gradient norm's maximum over pipeline ranks"):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.pp_group)
            return total
        total = local.pow(norm_type)
        with guard("the gradient norm's sum over pipeline ranks"):
            dist.all_reduce(total, group=self.pp_group)
        return total.pow(1.0 / norm_type)

    def expected_collectives(self) -> Counter:
        """What the plan lists for this rank's stages in one step: each microbatch's moves (forward, backward,
        recompute) of the ops its stages hold and those ops' own collectives, its gradient buckets and tied-weight sums."""
        plan, cut = self.plan, self.cut
        m, last = plan.pipeline.microbatches, len(plan.pipeline.stages) - 1
        mine = set(cut.mine)
        c: Counter = Counter()
        recomputed = set(plan.recompute)
        per_microbatch = [t.collectives() for t in plan.transfers
                          if (last if t.consumer == "output" else cut.stage_of_node[t.consumer]) in mine]
        per_microbatch += [n.collectives(recomputed) for n in plan.nodes if cut.stage_of_node[n.name] in mine]  # region ops' own
        for kinds in per_microbatch:
            for k in kinds:
                c[k] += m
        held = set(self.sync.params)
        c["grad_sync:all_reduce"] += sum(1 for b in plan.buckets if held & set(b.params))
        c["tied_sync:all_reduce"] += sum(1 for name in self.sync.tied if name in held)
        return +c

    @property
    def overlapped_buckets(self) -> int:
        """Gradient buckets of the last step whose all-reduce started before the schedule ended."""
        return self.sync.overlapped


def train_pipeline(cut: StageCut, graph: Graph, plan: Plan, program: fx.GraphModule, leaves: dict[str, torch.Tensor],
                   localise: Callable, comm: MeshComm, stage_rank: int, fqn_of: dict[str, str]) -> Pipeline:
    """The training pipeline: its process groups (created by every rank of the job, in the same order) and its
    gradient sync over the trainable parameters among `leaves`."""
    n, p = plan.mesh.size, plan.pipeline.degree
    pp_groups = [dist.new_group([s * n + j for s in range(p)], timeout=comm.timeout) for j in range(n)]
    # a parameter read on several pipeline ranks (tied embedding / head) sums its gradient over them
    leaf_nodes = {prm.node for prm in plan.params}
    ranks_of: dict[str, set[int]] = {}
    for prog in cut.programs:
        for name in prog.locals_in:
            if name in leaf_nodes:
                ranks_of.setdefault(name, set()).add(cut.owner[prog.index])
    tied = {name: tuple(sorted(r)) for name, r in ranks_of.items() if len(r) > 1}
    tied_groups = {}
    for devs in sorted(set(tied.values())):
        for j in range(n):
            g = dist.new_group([s * n + j for s in devs], timeout=comm.timeout)
            if j == comm.rank and stage_rank in devs:
                tied_groups[devs] = g
    trainable = {k: v for k, v in leaves.items() if isinstance(v, nn.Parameter) and v.requires_grad}
    holders = {name: {k for k in cut.mine if name in cut.programs[k].locals_in} for name in trainable}
    sync = StageGradSync(plan.buckets, trainable, holders, tied, tied_groups, plan.pipeline.microbatches, comm, fqn_of)
    return Pipeline(cut, graph, plan, program, leaves, localise, comm, pp_groups[comm.rank], sync)


__all__ = ["Pipeline", "StageCut", "cut_program", "stage_device", "train_pipeline"]
