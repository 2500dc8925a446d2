"""ParallelModule: the user's model, sharded by a Plan, trained with the user's own loop."""

from __future__ import annotations

import contextlib
import dataclasses
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
from meshplan.ir.placement import Placements, local_shape
from meshplan.ir.trace import TracedProgram
from meshplan.plans.plan import InputChoice, Plan
from meshplan.runtime import collectives
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.grad_buckets import GradBuckets
from meshplan.runtime.init_on_meta import FromInit
from meshplan.runtime.offload import make_optimizer
from meshplan.runtime.rewrite import local_program
from meshplan.runtime.rng import ProgramRng
from meshplan.runtime.weights import FromModel, WeightSource, block_slices


def distribute(whole: torch.Tensor, layout: Placements, comm: MeshComm) -> DTensor:
    """This rank's block of `whole` as a DTensor with `layout` on `comm`'s mesh (a copy: a chunk view
    would keep `whole` alive)."""
    local = shard_tensor(whole, layout, comm.mesh, comm.rank).clone(memory_format=torch.contiguous_format)
    return as_dtensor(local, layout, tuple(whole.shape), comm)


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


def shard_tensor(t: torch.Tensor, layout: Placements, mesh: MeshSpec, rank: int) -> torch.Tensor:
    """Rank `rank`'s block of a whole tensor, a view (outer mesh axes take the outer blocks, as in DTensor)."""
    return t[block_slices(tuple(t.shape), layout, mesh, rank)]


class ParallelModule(nn.Module):
    """Runs `plan` on this rank with the user's own training loop.

    Parameters and buffers are DTensors on `device_mesh` with the plan's layouts, registered under
    the model's own FQNs; the per-rank program runs on their local tensors, and their gradients
    arrive as DTensors of the same layout. So `torch.optim.*`, `clip_grad_norm_` (one global norm),
    LR schedulers, `state_dict()` / DCP and `named_parameters()` see the whole model, as on one process.
    A plan that replicates every parameter and buffer on every axis (data parallelism) keeps them
    plain tensors, as DDP does (`Plan.plain_params`): each rank then holds the whole model with the
    same values and the same reduced gradients, so those tools give one process's numbers without
    DTensor's per-op dispatch, which made torch's optimizer step several times slower.

    `group`: the process group the plan runs on (default: every rank of the job); its size must be
    the plan's mesh size, and its ranks take the mesh positions in order. `timeout` bounds every
    collective (see `collectives.resolve_timeout`).

    `eval()` mode runs a second program, traced from the model in eval mode and planned with this
    plan's parameter and input layouts (dropout off, batch norm on running statistics). It is built
    on the first forward in eval mode by `eval_source()`, which returns that (graph, plan), or None
    when eval mode traces to the same program; `auto_parallelize` provides it.

    `weights`: where this rank's shards come from (runtime/weights.py): by default the model's own
    tensors, broadcast from the group's first rank, or, for a model on the meta device, the model's
    own initialisation (runtime/init_on_meta.py).
    """

    def __init__(self, model: nn.Module, graph: Graph, plan: Plan, *, group=None, timeout: timedelta | float | None = None,
                 eval_source: Callable[[], tuple[Graph, Plan] | None] | None = None, weights: WeightSource | None = None) -> None:
        super().__init__()
        if plan.graph_fingerprint != graph.fingerprint():
            raise ValueError(
                f"plan was made for a different graph (fingerprint {plan.graph_fingerprint}, this model traces to "
                f"{graph.fingerprint()}); re-plan or load the plan made for this model"
            )
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) != plan.mesh.size:
            raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.size} devices but the process group has "
                             f"{len(ranks)} ranks; pass a group of {plan.mesh.size} ranks or plan for {len(ranks)} devices")
        device = group_device(group)
        if plan.precision is not None:
            plan.precision.check_device(device)
        full = dict(model.named_parameters(remove_duplicate=False))
        full.update(dict(model.named_buffers(remove_duplicate=False)))
        weights = weights or default_weights(model, device)
        self.comm = MeshComm(plan.mesh, dist.get_rank(group), ranks, timeout=timeout, device=device)
        self.comm.create_groups([tuple(range(plan.mesh.ndim))])  # first: the plan check runs on it
        check_same_plan(plan, self.comm, group=self.comm.world, rank=self.comm.rank)
        self.plan = plan

        axis_sets = [(a,) for a in range(plan.mesh.ndim)] + [b.axes for b in plan.buckets]
        self.comm.create_groups(axis_sets)
        self.device_mesh = self.comm.device_mesh

        persistent = set(model.state_dict(keep_vars=True))  # so state_dict() has the model's own keys
        self._leaf: dict[str, torch.Tensor] = {}
        blocks = weights.blocks(plan.params, self.comm)
        plain = plan.plain_params
        for p in plan.params:
            tensor = blocks.pop(p.node) if plain else as_dtensor(blocks.pop(p.node), p.layout, p.shape, self.comm)
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
        self._fqns = {p.node: p.fqns for p in plan.params}
        self._rng = None
        if any(is_random(n.target) for n in graph.nodes if n.kind == "op"):
            self._rng = ProgramRng(self.comm.world, device, ranks[0], self.comm.guard)
        self._grad_buckets = GradBuckets(plan.buckets, self._leaf, self.comm)
        self._train = self._rank_program(graph, plan)
        self.program = self._train.gm
        self._eval_source = eval_source
        self._eval: _RankProgram | None = None
        self.loss_fn: Callable | None = None
        """the loss `step()` uses when given none"""
        self.process_group = self.comm.world
        """every rank of this plan (checkpoints are saved and loaded over it)"""
        self.offload_copies: dict[str, nn.Parameter] = {}
        """FQN -> host copy of each parameter whose optimizer state `make_optimizer` offloads"""

    def _rank_program(self, graph: Graph, plan: Plan) -> _RankProgram:
        leaf_of = {}
        for p in plan.params:
            mine = self._node_of.get(p.fqns[0])
            if mine is None or self._layout[mine] != p.layout:
                raise AssertionError(f"{p.fqns[0]}: the eval-mode plan stores it as {p.layout}, this module as "
                                     f"{None if mine is None else self._layout[mine]}")
            leaf_of[p.node] = mine
        return _RankProgram(local_program(graph.fx, plan, self.comm), graph.fx, {i.name: i for i in plan.inputs},
                            [n.name for n in graph.fx.gm.graph.nodes if n.op == "placeholder"], leaf_of)

    def _current(self) -> _RankProgram:
        if self.training:
            return self._train
        if self._eval is None:
            source = self._eval_source() if self._eval_source is not None else None
            if source is None and self._eval_source is None and (self._rng is not None or self._train.traced.mutations):
                raise ValueError("this model has dropout or batch norm, which behave differently in eval mode, and this "
                                 "ParallelModule has no eval-mode program; build it with meshplan.auto_parallelize, or pass "
                                 "eval_source=")
            self._eval = self._train if source is None else self._rank_program(*source)
        return self._eval

    def forward(self, *args, **kwargs):
        program = self._current()
        user = iter(program.traced.user_inputs(args, kwargs))
        call = []
        for name in program.placeholders:
            if name in program.leaf_of:
                call.append(self._leaf[program.leaf_of[name]])  # the program takes its local view where it is used
            elif name in program.traced.constants:
                call.append(program.traced.constants[name])
            else:
                call.append(self._localise_input(program.inputs.get(name), next(user)))
        with self._rng.active() if self._rng is not None else contextlib.nullcontext():
            out = list(program.gm(*call))
        mutated = program.traced.mutations
        # running statistics (batch norm): this rank's part becomes the buffer. A new tensor, not an
        # in-place copy: the step's backward may still read the old one.
        for fqn, value in zip(mutated, out):
            node = self._node_of[fqn]
            new = distribute(value.detach(), self._layout[node], self.comm)
            for alias in self._fqns[node]:
                _owner(self, alias)._buffers[alias.rsplit(".", 1)[-1]] = new
            self._leaf[node] = new
        out = out[len(mutated):]
        return pytree.tree_unflatten(out, program.traced.out_spec)

    def step(self, *inputs, target, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one batch: the training-step call a `PipelineRunner` takes too, so one loop
        runs every plan. `loss_fn(output, target)` (default: the one given to `auto_parallelize`); `kwargs` are
        the model's keyword inputs. Returns the loss, detached; the user's optimizer steps afterwards."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("step() needs a loss: pass step(..., loss_fn=) or auto_parallelize(..., loss_fn=)")
        loss = loss_fn(self(*inputs, **kwargs), target)
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over this module's parameters (the same call a `PipelineRunner` takes)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block keep their gradients local (no collective); the first
        backward after it reduces everything accumulated since the last reduction, as DDP's `no_sync`."""
        with self._grad_buckets.deferred():
            yield

    def _localise_input(self, choice: InputChoice | None, x):
        if choice is None or not isinstance(x, torch.Tensor):
            return x
        name = choice.name
        x = x.to(self.comm.device)  # as DDP does with its device: a no-op when the input is there already
        if self.plan.inputs_mode == "global":
            if tuple(x.shape) != choice.shape:
                raise ValueError(
                    f"input {name} has shape {list(x.shape)} but the plan was made for {list(choice.shape)}; "
                    "re-plan for the new shape"
                )
            return shard_tensor(x, choice.layout, self.plan.mesh, self.comm.rank)
        want = local_shape(choice.shape, choice.layout, self.plan.mesh.shape)
        if tuple(x.shape) != want:
            raise ValueError(
                f"with inputs='local' rank {self.comm.rank} must pass its slice of {name}: shape {list(want)} "
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


@dataclasses.dataclass(frozen=True, slots=True)
class _RankProgram:
    """One mode's per-rank program and what its placeholders take."""

    gm: fx.GraphModule
    traced: TracedProgram
    inputs: dict[str, InputChoice]
    placeholders: list[str]
    leaf_of: dict[str, str]
    """placeholder -> the train plan's node of the same parameter or buffer (the key of `_leaf`)"""


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
    """The device `group`'s collectives take tensors on: the host for gloo, else the current accelerator
    (`torch.cuda.set_device(LOCAL_RANK)` under torchrun, which `init_torchrun_group` does)."""
    if dist.get_backend(group) in ("gloo", "fake"):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ValueError(f"process group backend {dist.get_backend(group)!r} needs an accelerator, and none is available")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
