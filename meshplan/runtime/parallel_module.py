"""ParallelModule: the user's model, sharded by a Plan, trained with the user's own loop; one type for every plan.

Written once here for every plan: the plan check, the parameter and buffer shards (from a weight source,
registered under the model's names), binding and sharding the user's inputs, the program's random
generator, clipping and the eval-mode program. What differs is the program: a plan without a pipeline runs
its per-rank program on each call, with `GradBuckets` reducing gradients after each backward; a pipelined
plan runs its stages under a torch schedule (runtime/pipeline.py), with the same reduction after its last
microbatch (runtime/stage_grads.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from meshplan.ir.graph import Graph
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.op_kinds import is_random
from meshplan.ir.placement import Placements, Shard, local_shape
from meshplan.ir.trace import TracedProgram
from meshplan.plans.plan import InputChoice, Plan
from meshplan.runtime import collectives, token_order
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.grad_buckets import GradBuckets
from meshplan.runtime.init_on_meta import FromInit
from meshplan.runtime.model_state import ModelState
from meshplan.runtime.offload import make_optimizer
from meshplan.runtime.pipeline import Pipeline, cut_program, train_pipeline
from meshplan.runtime.rewrite import local_program
from meshplan.runtime.rng import ProgramRng
from meshplan.runtime.stage_grads import StageGradSync
from meshplan.runtime.weights import FromModel, WeightSource, block_slices
from meshplan.runtime.write_back import Update, refuse_in_pipeline, updates, write_back


def as_dtensor(local: torch.Tensor, layout: Placements, shape: tuple[int, ...], comm: MeshComm) -> DTensor:
    """`local`, this rank's contiguous block of a whole tensor of `shape`, as a DTensor with `layout`."""
    stride = torch.empty(shape, device="meta").stride()  # the whole tensor's, as `local` is contiguous
    return DTensor.from_local(local, comm.device_mesh, list(layout), run_check=False,
                              shape=torch.Size(shape), stride=stride)


def default_weights(model: nn.Module, device: torch.device, *, whole_job: bool = False) -> WeightSource:
    """The model's own tensors (see `FromModel` for `whole_job`), or its own initialisation when it is on the
    meta device."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    if any(t.device.type == "meta" for t in tensors.values()):
        return FromInit(model)
    check_model_device(tensors, device)
    return FromModel(tensors, whole_job=whole_job)


def shard_tensor(t: torch.Tensor, layout: Placements, mesh: MeshSpec, rank: int, head_tail_axis: int | None = None) -> torch.Tensor:
    """Rank `rank`'s block of a whole tensor, a view (outer mesh axes take the outer blocks, as in DTensor). A split
    on `head_tail_axis` takes the place's two chunks in head-tail token order (runtime/token_order.py: a copy), as
    the plan's moves on that axis do, outer axes first."""
    if head_tail_axis is None or not isinstance(layout[head_tail_axis], Shard):
        return t[block_slices(tuple(t.shape), layout, mesh, rank)]
    coord = mesh.coordinate(rank)
    for a, p in enumerate(layout):
        if isinstance(p, Shard):
            n = mesh.shape[a]
            t = token_order.take(t, p.dim, n, coord[a]) if a == head_tail_axis else t.chunk(n, dim=p.dim)[coord[a]]
    return t


class ParallelModule(nn.Module):
    """Runs `plan` on this rank with the user's own training loop: the one runtime type for every plan.

    Parameters and buffers are DTensors on `device_mesh` with the plan's layouts, registered under
    the model's own FQNs; the per-rank program runs on their local tensors, and their gradients
    arrive as DTensors of the same layout. So `torch.optim.*`, `clip_grad_norm_` (one global norm),
    LR schedulers, `state_dict()` / DCP and `named_parameters()` see the whole model, as on one process.
    A plan that replicates every parameter and buffer on every axis (data parallelism) keeps them
    plain tensors, as DDP does (`Plan.plain_params`): each rank then holds the whole model with the
    same values and the same reduced gradients, so those tools give one process's numbers without
    DTensor's per-op dispatch, which made torch's optimizer step several times slower.

    A plan with a pipeline (`plan.pipeline`) runs through `pipeline` (runtime/pipeline.py: this rank's stages
    and the torch schedule); everything else is this class's, as for any plan. Such a module holds the
    parameters its stages read, on its stage's sub-mesh (`device_mesh`); `step()` runs forward and backward
    together, `pmodel(x)` is a `ValueError`, and `clip_grad_norm_` sums the norm over the pipeline ranks.

    `group`: the process group the plan runs on (default: every rank of the job; a pipelined plan takes every
    rank); its size must be the plan's device count, and its ranks take the mesh positions in order.
    `timeout` bounds every collective (see `collectives.resolve_timeout`).

    `eval()` mode runs a second program, traced from the model in eval mode and planned with this
    plan's parameter and input layouts (dropout off, batch norm on running statistics). It is built
    on the first forward in eval mode by `eval_source()`, which returns that (graph, plan), or None
    when eval mode traces to the same program; `auto_parallelize` provides it. Where a forward moves on module
    attributes that change what later forwards compute (Hugging Face RWKV's `layers_are_rescaled`), each mode's
    program for the new attributes comes from `eval_source(training=, attributes=)` (runtime/model_state.py).

    `weights`: where this rank's shards come from (runtime/weights.py): by default the model's own
    tensors, broadcast from the group's first rank, or, for a model on the meta device, the model's
    own initialisation (runtime/init_on_meta.py). `loss_fn`: the loss `step()` uses when given none.
    """

    def __init__(self, model: nn.Module, graph: Graph, plan: Plan, *, group=None, timeout: timedelta | float | None = None,
                 eval_source: Callable[[], tuple[Graph, Plan] | None] | None = None, weights: WeightSource | None = None,
                 loss_fn: Callable | None = None) -> None:
        super().__init__()
        if plan.graph_fingerprint != graph.fingerprint():
            raise ValueError(
                f"plan was made for a different graph (fingerprint {plan.graph_fingerprint}, this model traces to "
                f"{graph.fingerprint()}); re-plan or load the plan made for this model"
                + ("; a pipelined plan's graph is the model traced at one microbatch" if plan.pipeline is not None else "")
            )
        pipe = plan.pipeline
        if pipe is not None and group is not None:
            raise ValueError("a pipelined plan runs on every rank of the job; auto_parallelize(group=...) takes plans "
                             "without a pipeline (pipeline=None)")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        per_stage = plan.mesh.size
        if pipe is None and len(ranks) != per_stage:
            raise ValueError(f"the plan's mesh {plan.mesh} has {per_stage} devices but the process group has "
                             f"{len(ranks)} ranks; pass a group of {per_stage} ranks or plan for {len(ranks)} devices")
        if pipe is not None and len(ranks) != pipe.degree * per_stage:
            raise ValueError(f"the plan runs {pipe.degree} pipeline stages x {per_stage} devices each = {pipe.degree * per_stage} "
                             f"ranks; the world has {len(ranks)}")
        device = group_device(group)
        if plan.precision is not None:
            plan.precision.check_device(device)
        # a pipeline's stages each run the plan's mesh on their own ranks (pipeline axis outermost)
        stage_rank, local = divmod(ranks.index(dist.get_rank()), per_stage)
        self.comm = MeshComm(plan.mesh, local, ranks[stage_rank * per_stage : (stage_rank + 1) * per_stage], timeout=timeout,
                             device=device)
        self.comm.create_groups([tuple(range(plan.mesh.ndim))])  # first: a flat plan's check runs on it
        self.process_group = self.comm.world if pipe is None else None
        """every rank of this plan (the plan check, checkpoints and the program's generator run over it)"""
        check_same_plan(plan, self.comm, group=self.process_group, rank=dist.get_rank())
        self.plan = plan
        self.comm.create_groups([(a,) for a in range(plan.mesh.ndim)] + [b.axes for b in plan.buckets])
        self.device_mesh = self.comm.device_mesh
        self.program = local_program(graph, plan, self.comm)
        """this rank's program of `plan` (a pipelined plan's before it is cut into stages)"""
        cut = cut_program(self.program, graph, plan, stage_rank) if pipe is not None else None

        # parameters and buffers: this rank's blocks (of those its stages read, on a pipelined plan), under the model's names
        full = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        persistent = set(model.state_dict(keep_vars=True))  # so state_dict() has the model's own keys
        weights = weights or default_weights(model, device, whole_job=pipe is not None)
        held = {p.node for p in plan.params} if cut is None else cut.needed
        blocks = weights.blocks(plan.params, self.comm, wanted=held)
        self._leaf: dict[str, torch.Tensor] = {}
        for p in plan.params:
            if p.node not in held:
                continue
            tensor = blocks.pop(p.node) if plan.plain_params else as_dtensor(blocks.pop(p.node), p.layout, p.shape, self.comm)
            if p.is_buffer:
                for fqn in p.fqns:
                    _owner(self, fqn).register_buffer(fqn.rsplit(".", 1)[-1], tensor, persistent=fqn in persistent)
            else:
                tensor = nn.Parameter(tensor, requires_grad=full[p.fqns[0]].requires_grad)
                for fqn in p.fqns:
                    setattr(_owner(self, fqn), fqn.rsplit(".", 1)[-1], tensor)
            self._leaf[p.node] = tensor
        self._node_of = {f: p.node for p in plan.params for f in p.fqns}
        self._layout = {p.node: p.layout for p in plan.params}
        self._rng = None
        if any(is_random(n.target) for n in graph.nodes if n.kind == "op"):
            self._rng = ProgramRng(self.process_group, device, ranks[0], self.comm.guard)
        self._eval_source = eval_source
        self._state = ModelState(graph.fx.attributes)
        """module attributes earlier forwards moved on, and the programs traced from them (runtime/model_state.py)"""
        self._eval: _RankProgram | Pipeline | None = None
        self.loss_fn = loss_fn
        """the loss `step()` uses when given none"""
        self.offload_copies: dict[str, nn.Parameter] = {}
        """FQN -> host copy of each parameter whose optimizer state `make_optimizer` offloads"""
        self.pipeline: Pipeline | None = None
        """a pipelined plan's stages and schedule (train mode's); None for a plan without a pipeline"""
        if cut is None:
            self._grad_sync: GradBuckets | StageGradSync = GradBuckets(plan.buckets, self._leaf, self.comm)
            self._train: _RankProgram | Pipeline = self._rank_program(graph, plan, self.program)
        else:
            refuse_in_pipeline(graph)
            fqn_of = {p.node: p.fqns[0] for p in plan.params}
            self.pipeline = train_pipeline(cut, graph, plan, self.program, self._stage_leaves(graph, plan, cut.needed),
                                           self._localiser(plan), self.comm, stage_rank, fqn_of)
            self._grad_sync = self.pipeline.sync
            self._train = self.pipeline

    def _leaf_of(self, plan: Plan) -> dict[str, str]:
        """`plan`'s parameter and buffer nodes -> this module's (the train plan's) nodes of the same tensors."""
        leaf_of = {}
        for p in plan.params:
            mine = self._node_of.get(p.fqns[0])
            if mine is None or self._layout[mine] != p.layout:
                raise AssertionError(f"{p.fqns[0]}: the eval-mode plan stores it as {p.layout}, this module as "
                                     f"{None if mine is None else self._layout[mine]}")
            leaf_of[p.node] = mine
        return leaf_of

    def _rank_program(self, graph: Graph, plan: Plan, program: fx.GraphModule) -> _RankProgram:
        return _RankProgram(program, graph.fx, {i.name: i for i in plan.inputs},
                            [n.name for n in graph.fx.gm.graph.nodes if n.op == "placeholder"], self._leaf_of(plan),
                            updates(graph, plan, self.plan.params), self._constants(graph))

    def _constants(self, graph: Graph) -> dict[str, torch.Tensor]:
        """The traced program's lifted tensor constants (`x * torch.tensor([...])`) on this rank's device: the trace
        keeps them where the model made them, the host."""
        return {name: t.to(self.comm.device) for name, t in graph.fx.constants.items()}

    def _stage_leaves(self, graph: Graph, plan: Plan, needed: set[str]) -> dict[str, torch.Tensor]:
        """What the stages of `plan`'s program take besides the user's inputs, by placeholder: parameters, buffers, constants."""
        leaf_of, constants = self._leaf_of(plan), self._constants(graph)
        out = {}
        for name in needed:
            if name in constants:
                out[name] = constants[name]
            elif leaf_of.get(name) not in self._leaf:
                raise AssertionError(f"this rank's stages read {name}, which it does not hold")
            else:
                out[name] = self._leaf[leaf_of[name]]
        return out

    def _current(self) -> _RankProgram | Pipeline:
        if self._eval_source is not None:  # traced again where an earlier forward moved attributes on (RWKV's rescaling)
            moved = self._state.program(self.training, lambda training, attributes: self._eval_program(
                *self._eval_source(training=training, attributes=attributes)))
            if moved is not None:
                return moved
        if self.training:
            return self._train
        if self._eval is None:
            source = self._eval_source() if self._eval_source is not None else None
            if source is None and self._eval_source is None and (self._rng is not None or self._train.traced.mutations):
                raise ValueError("this model has dropout or batch norm, which behave differently in eval mode, and this "
                                 "ParallelModule has no eval-mode program; build it with meshplan.auto_parallelize, or pass "
                                 "eval_source=")
            self._eval = self._train if source is None else self._eval_program(*source)
        return self._eval

    def _eval_program(self, graph: Graph, plan: Plan) -> _RankProgram | Pipeline:
        program = local_program(graph, plan, self.comm)
        if self.pipeline is None:
            return self._rank_program(graph, plan, program)
        # the same stages, cut from the eval-mode program; forward only
        refuse_in_pipeline(graph)
        plan = dataclasses.replace(plan, pipeline=self.plan.pipeline)
        cut = cut_program(program, graph, plan, self.pipeline.cut.rank)
        return Pipeline(cut, graph, plan, program, self._stage_leaves(graph, plan, cut.needed), self._localiser(plan),
                        self.comm, self.pipeline.pp_group, None)

    def forward(self, *args, **kwargs):
        if self.pipeline is not None:
            raise ValueError("a pipelined plan runs forward and backward together, over the whole batch, and its outputs "
                             "live on the last stage's ranks: call pmodel.step(*inputs, target=y) (under torch.no_grad() "
                             "or in eval mode for the loss alone), not pmodel(*inputs)")
        program = self._current()
        self._state.check(program.traced, "train" if self.training else "eval")
        user = iter(program.traced.user_inputs(args, kwargs))
        call = []
        for name in program.placeholders:
            if name in program.leaf_of:
                call.append(self._leaf[program.leaf_of[name]])  # the program takes its local view where it is used
            elif name in program.constants:
                call.append(program.constants[name])
            else:
                call.append(self._localise_input(program.inputs.get(name), next(user)))
        with self._rng.active() if self._rng is not None else contextlib.nullcontext():
            out = list(program.gm(*call))
        write_back(self, program.updates, out)  # parameters and buffers the forward updated in place
        self._state.after(program.traced)
        return pytree.tree_unflatten(out[len(program.updates):], program.traced.out_spec)

    def step(self, *inputs, target, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor | None:
        """One batch: forward, `loss_fn(output, target)` and, in train mode with autograd on, backward (with a
        pipeline: over the plan's microbatches, and the gradient sync). The same call for every plan, so one loop
        runs them all. `loss_fn` defaults to the one given to `auto_parallelize`; `kwargs` are the model's keyword
        inputs. In eval mode or under `torch.no_grad()` it is an evaluation step: the loss, no backward.

        Returns the loss, detached; with a pipeline, the mean microbatch loss on the last stage's ranks and None on
        the others. The user's optimizer steps afterwards."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("step() needs a loss: pass step(..., loss_fn=) or auto_parallelize(..., loss_fn=)")
        backward = self.training and torch.is_grad_enabled()
        program = self._current()
        # on the outputs' device, as the inputs are: a GPU loss refuses a target left on the host
        target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.comm.device), target)
        if isinstance(program, Pipeline):  # every rank checks the call: a bad one fails everywhere at once
            with self._rng.active() if self._rng is not None else contextlib.nullcontext():
                return program.step(program.traced.user_inputs(inputs, kwargs), target, loss_fn, backward=backward)
        loss = loss_fn(self(*inputs, **kwargs), target)
        if backward:
            loss.backward()
        return loss.detach()

    def parameters(self, recurse: bool = True):
        # `torch.nn.utils.clip_grad_norm_` over a pipelined plan's parameters would clip by this rank's stages' norm
        # alone: no layout tells torch that the other stages' parameters live on other ranks. Its first act is to
        # list the parameters given, which resumes this generator: a pipelined plan refuses there.
        if self.pipeline is not None and inspect.currentframe().f_back.f_code is _TORCH_CLIP:
            raise ValueError("torch.nn.utils.clip_grad_norm_ over a pipelined plan's parameters would see only this "
                             "rank's stages; call pmodel.clip_grad_norm_(max_norm), whose norm is over every pipeline rank")
        yield from super().parameters(recurse)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model's gradients, for every plan: the norm of a DTensor
        gradient is over all of its shards, and with a pipeline each rank's stages contribute theirs (a tied weight
        once), summed over the pipeline ranks. Returns the norm, the same on every rank."""
        norm_type = float(norm_type)
        params = {node: t for node, t in self._leaf.items() if isinstance(t, nn.Parameter) and t.grad is not None}
        counted = [p for node, p in params.items() if self.pipeline is None or self.pipeline.counts_in_norm(node)]
        if counted:
            local = torch.nn.utils.get_total_norm([p.grad for p in counted], norm_type)
            local = local.full_tensor() if isinstance(local, DTensor) else local
        else:
            local = torch.zeros((), device=self.comm.device)
        total = local if self.pipeline is None else self.pipeline.total_norm(local, norm_type, self.comm.guard)
        torch.nn.utils.clip_grads_with_norm_(list(params.values()), max_norm, total)
        return total

    def rng_state(self) -> list[torch.Tensor]:
        """The generator states of the program's own random stream, which random ops inside the model (dropout) draw
        from (runtime/rng.py); empty for a model without random ops. A checkpoint that keeps them lets a resumed run
        draw the masks an uninterrupted one would."""
        return self._rng.states() if self._rng is not None else []

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        """Continue the program's random stream from `rng_state()`'s states."""
        if self._rng is None:
            if states:
                raise ValueError(f"{len(states)} random generator states given, but this model has no random ops")
            return
        self._rng.load_states(states)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside this block keep their gradients local (no collective); the first
        backward after it reduces everything accumulated since the last reduction, as DDP's `no_sync`."""
        if self.pipeline is not None:
            raise ValueError("no_sync() defers gradient reductions between backward calls, and a pipelined plan runs its whole "
                             "batch in one step() call: pass the accumulated batch to step() instead (the plan splits it into "
                             f"{self.plan.pipeline.microbatches} microbatches)")
        return self._grad_sync.deferred()

    def _localiser(self, plan: Plan) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """A pipeline's first stage's: input `name` of `plan` as this rank's block."""
        inputs = {i.name: i for i in plan.inputs}
        return lambda name, x: self._localise_input(inputs.get(name), x)

    def _localise_input(self, choice: InputChoice | None, x):
        if choice is None or not isinstance(x, torch.Tensor):
            return x
        name = choice.name
        x = x.to(self.comm.device)  # as DDP does with its device: a no-op when the input is there already
        pipe = self.plan.pipeline
        per_step = f" (one of {pipe.microbatches} microbatches per step)" if pipe is not None else ""
        if self.plan.inputs_mode == "global":
            if tuple(x.shape) != choice.shape:
                raise ValueError(
                    f"input {name}{per_step} has shape {list(x.shape)} but the plan was made for {list(choice.shape)}; "
                    "re-plan for the new shape"
                )
            return shard_tensor(x, choice.layout, self.plan.mesh, self.comm.rank, self.plan.head_tail_axis)
        want = local_shape(choice.shape, choice.layout, self.plan.mesh.shape)
        if tuple(x.shape) != want:
            raise ValueError(
                f"with inputs='local' rank {self.comm.rank} must pass its slice of {name}{per_step}: shape {list(want)} "
                f"(layout {choice.layout}), got {list(x.shape)}"
            )
        return x

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        """`optimizer_cls(params, **kwargs)` as the plan wants it: the state of parameters the plan
        offloads lives in host memory (runtime/offload.py). Works for every plan."""
        return make_optimizer(self, self.plan, self._leaf, optimizer_cls, **kwargs)

    # ---------------------------------------------------------------- introspection

    @staticmethod
    def collective_counts() -> Counter:
        """Collectives this process ran since `reset_collective_counts()` (kind by phase)."""
        return Counter(collectives.COUNTS)

    @staticmethod
    def reset_collective_counts() -> None:
        collectives.reset_counts()


_TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_.__wrapped__.__code__
"""The code of `torch.nn.utils.clip_grad_norm_` (under its no-grad wrapper): the caller `parameters()` refuses."""


@dataclasses.dataclass(frozen=True, slots=True)
class _RankProgram:
    """One mode's per-rank program and what its placeholders take."""

    gm: fx.GraphModule
    traced: TracedProgram
    inputs: dict[str, InputChoice]
    placeholders: list[str]
    leaf_of: dict[str, str]
    """placeholder -> the train plan's node of the same parameter or buffer (the key of `_leaf`)"""
    updates: tuple[Update, ...]
    """the parameters and buffers the program writes, one per leading output (runtime/write_back.py)"""
    constants: dict[str, torch.Tensor]
    """placeholder -> the traced program's lifted tensor constant, on this rank's device"""


def _owner(root: nn.Module, fqn: str) -> nn.Module:
    """The (created on demand) submodule that owns `fqn`, mirroring the user's module tree."""
    mod = root
    for part in fqn.split(".")[:-1]:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    return mod


def check_same_plan(plan: Plan, comm: MeshComm, *, group, rank: int) -> None:
    """Every rank of `group` must run the identical plan: compare hashes before the first collective of a step
    (`group` None: every rank of the job, as a pipeline's stages need)."""
    h = int(plan.hash()[:15], 16)
    t = torch.tensor([h, -h], dtype=torch.int64, device=comm.device)
    with comm.guard("comparing plan hashes"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t[0].item() != h or -t[1].item() != h:
        raise ValueError(
            f"ranks computed different plans (rank {rank} has plan hash {plan.hash()}); all ranks must plan the same "
            "model with the same inputs and options, or load one plan file"
        )


def check_model_device(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """The model's real tensors must be on the host or on this rank's device (they are copied there)."""
    for fqn, t in tensors.items():
        if t.device.type not in ("cpu", "meta") and t.device != device:
            where = "the CPU" if device.type == "cpu" else f"the CPU or to {device}"
            raise ValueError(f"{fqn} is on {t.device} but this rank runs on {device} (from the process group's backend "
                             f"and the current device); move the model to {where} first")


def group_device(group=None) -> torch.device:
    """The device `group`'s collectives take tensors on: the host for gloo, else the current accelerator, which must be
    this process's own under torchrun: local rank i drives device i of its node (modulo the devices it sees, so one
    visible device per process is device 0). `init_torchrun_group` sets it; a group made by hand without `set_device`
    would put every rank of the node on device 0."""
    backend = dist.get_backend(group)
    if backend in ("gloo", "fake"):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ValueError(f"process group backend {backend!r} needs an accelerator, and none is available")
    index, local_rank = torch.accelerator.current_device_index(), os.environ.get("LOCAL_RANK")
    if local_rank is not None and index != int(local_rank) % torch.accelerator.device_count():
        own = int(local_rank) % torch.accelerator.device_count()
        raise ValueError(
            f"this process has LOCAL_RANK={local_rank}, so its device is {accelerator.type}:{own}, but the current device "
            f"is {accelerator.type}:{index}, where a {backend!r} group would run it: call "
            f"torch.accelerator.set_device_index({own}) (torch.cuda.set_device) before init_process_group, or let "
            "meshplan initialise the group (under torchrun, auto_parallelize does when none exists)")
    return torch.device(accelerator.type, index)
