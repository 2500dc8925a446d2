"""ParallelModule: the user's model, sharded by a Plan, trained with the user's own loop."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from meshplan.ir.graph import Graph
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Placements, Shard, local_shape
from meshplan.planner.plan import Plan
from meshplan.planner.rules.random import is_random
from meshplan.runtime import collectives
from meshplan.runtime.collectives import MeshComm
from meshplan.runtime.grad_buckets import GradBuckets
from meshplan.runtime.offload import make_optimizer
from meshplan.runtime.rewrite import local_program


def shard_tensor(t: torch.Tensor, layout: Placements, mesh: MeshSpec, rank: int) -> torch.Tensor:
    """Rank `rank`'s block of a whole tensor (outer mesh axes take the outer blocks, as in DTensor)."""
    coord = mesh.coordinate(rank)
    for a, p in enumerate(layout):
        if isinstance(p, Shard):
            t = t.chunk(mesh.shape[a], dim=p.dim)[coord[a]]
    return t


class ParallelModule(nn.Module):
    """Runs `plan` on this rank. Parameters are local shards registered under the model's own FQNs.

    `state_dict()` holds those local shards; `meshplan.runtime.checkpoint` views them as DTensors
    so a checkpoint saved under one plan loads under another. `timeout` bounds every collective
    (see `collectives.resolve_timeout`).
    """

    def __init__(self, model: nn.Module, graph: Graph, plan: Plan, *, group=None, timeout: timedelta | float | None = None) -> None:
        super().__init__()
        if plan.graph_fingerprint != graph.fingerprint():
            raise ValueError(
                f"plan was made for a different graph (fingerprint {plan.graph_fingerprint}, this model traces to "
                f"{graph.fingerprint()}); re-plan or load the plan made for this model"
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.comm = MeshComm(plan.mesh, rank, world, timeout)
        self.comm.create_groups([tuple(range(plan.mesh.ndim))])  # first: the plan check runs on it
        check_same_plan(plan, self.comm, group=self.comm.world, rank=self.comm.rank)
        self.plan = plan
        self._traced = graph.fx
        self._inputs = {i.name: i for i in plan.inputs}
        self._placeholders = [n.name for n in graph.fx.gm.graph.nodes if n.op == "placeholder"]

        axis_sets = [(a,) for a in range(plan.mesh.ndim)] + [b.axes for b in plan.buckets]
        self.comm.create_groups(axis_sets)

        full = dict(model.named_parameters(remove_duplicate=False))
        full.update(dict(model.named_buffers(remove_duplicate=False)))
        persistent = set(model.state_dict(keep_vars=True))  # so state_dict() has the model's own keys
        self._leaf: dict[str, torch.Tensor] = {}
        for p in plan.params:
            whole = full[p.fqns[0]].detach()
            # every rank starts from rank 0's weights, as DDP does
            whole = whole.clone()
            with self.comm.guard(f"broadcasting {p.fqns[0]} from rank 0"):
                dist.broadcast(whole, src=0, group=self.comm.world)
            # a copy, not a view: a dim-0 chunk is already contiguous and would keep the whole tensor alive
            local = shard_tensor(whole, p.layout, plan.mesh, rank).clone(memory_format=torch.contiguous_format)
            if p.is_buffer:
                tensor: torch.Tensor = local
                for fqn in p.fqns:
                    _owner(self, fqn).register_buffer(fqn.rsplit(".", 1)[-1], local, persistent=fqn in persistent)
            else:
                tensor = nn.Parameter(local, requires_grad=full[p.fqns[0]].requires_grad)
                for fqn in p.fqns:
                    setattr(_owner(self, fqn), fqn.rsplit(".", 1)[-1], tensor)
            self._leaf[p.node] = tensor
        self._buffer_node = {f: p.node for p in plan.params if p.is_buffer for f in p.fqns}
        self._layout = {p.node: p.layout for p in plan.params}
        self._fqns = {p.node: p.fqns for p in plan.params}
        if any(is_random(n.target) for n in graph.nodes if n.kind == "op"):
            _share_rng_state(self.comm)
        self._grad_buckets = GradBuckets(plan.buckets, self._leaf, self.comm)
        self.program = local_program(graph.fx, plan, self.comm)

    def forward(self, *args, **kwargs):
        leaves, _ = pytree.tree_flatten((args, kwargs))
        user = iter(leaves)
        call = []
        for name in self._placeholders:
            if name in self._leaf:
                call.append(self._leaf[name])
            elif name in self._traced.constants:
                call.append(self._traced.constants[name])
            else:
                call.append(self._localise_input(name, next(user)))
        out = list(self.program(*call))
        mutated = self._traced.mutations
        # running statistics (batch norm): this rank's part becomes the buffer. A new tensor, not an
        # in-place copy: the step's backward may still read the old one.
        for fqn, value in zip(mutated, out):
            node = self._buffer_node[fqn]
            new = shard_tensor(value.detach(), self._layout[node], self.plan.mesh, self.comm.rank).contiguous()
            for alias in self._fqns[node]:
                _owner(self, alias)._buffers[alias.rsplit(".", 1)[-1]] = new
            self._leaf[node] = new
        out = out[len(mutated):]
        return pytree.tree_unflatten(out, self._traced.out_spec)

    def _localise_input(self, name: str, x):
        choice = self._inputs.get(name)
        if choice is None or not isinstance(x, torch.Tensor):
            return x
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
    t = torch.tensor([h, -h], dtype=torch.int64)
    with comm.guard("comparing plan hashes"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t[0].item() != h or -t[1].item() != h:
        raise ValueError(
            f"ranks computed different plans (rank {rank} has plan hash {plan.hash()}); all ranks must plan the same "
            "model with the same inputs and options, or load one plan file"
        )


def _share_rng_state(comm: MeshComm) -> None:
    """Every rank takes rank 0's CPU generator state: random ops draw whole tensors (planner/rules/random.py),
    so identical states give every rank the single-device model's masks."""
    state = torch.get_rng_state()
    with comm.guard("broadcasting rank 0's random generator state"):
        dist.broadcast(state, src=0, group=comm.world)
    torch.set_rng_state(state)
