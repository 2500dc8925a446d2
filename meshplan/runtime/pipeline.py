"""Run a plan's pipeline: cut the model at the planned stage boundaries and drive torch's schedules.

The cut is `torch.distributed.pipelining.pipeline` (it traces the model with torch.export and
splits the graph at `SplitPoint`s placed before each stage's first module); every stage becomes a
`PipelineStage`, and the plan's schedule class (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, ...) runs the microbatches. Ranks form a (pipeline, data) grid with the
pipeline axis outermost, as the planner assumed: rank = stage_rank * data + data_rank.

After the schedule, two gradient reductions complete the step: parameters that several stages
hold (a tied embedding and head: torch gives each stage a copy) sum their gradients over the
ranks holding them, and every gradient is averaged over the data-parallel group.

Not yet: the intra-op plan inside a stage (tensor parallelism in a stage); stages here run whole
on their rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.pipelining import schedules as torch_schedules

from meshplan.cost_model.schedules import TORCH_SCHEDULE_CLASS
from meshplan.planner.pipeline_plan import PipelinePlan
from meshplan.planner.stage_profile import POST, PRE


def split_spec(model: nn.Module, pipe: PipelinePlan) -> dict[str, SplitPoint]:
    """A SplitPoint before the first module of every stage but the first."""
    names = {n for n, _ in model.named_modules()}
    spec = {}
    for st in pipe.stages[1:]:
        first = st.modules[0] if st.modules else None
        if first is None or first not in names:
            raise ValueError(f"stage {st.index} starts at {first!r}, which is no submodule of {type(model).__name__}")
        spec[first] = SplitPoint.BEGINNING
    return spec


def stage_device(k: int, p: int, schedule: str) -> int:
    return (k if k < p else 2 * p - 1 - k) if schedule == "zbv" else k % p


class PipelineRunner:
    """This rank's stages of a pipeline plan; `step(x, y)` runs one training step's forward and backward."""

    def __init__(self, model: nn.Module, pipe: PipelinePlan, example_microbatch: tuple, loss_fn: Callable, *, data: int = 1,
                 device: torch.device | str = "cpu") -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != pipe.degree * data:
            raise ValueError(f"the pipeline needs {pipe.degree} x {data} = {pipe.degree * data} ranks; the world has {world}")
        self.pipe, self.data, self.loss_fn = pipe, data, loss_fn
        self.stage_rank, self.data_rank = divmod(rank, data)
        # process groups: every rank creates every group, in the same order
        pp_groups = [dist.new_group([s * data + j for s in range(pipe.degree)]) for j in range(data)]
        dp_groups = [dist.new_group([s * data + j for j in range(data)]) for s in range(pipe.degree)]
        self.pp_group, self.dp_group = pp_groups[self.data_rank], dp_groups[self.stage_rank]
        ir = pipeline(model, mb_args=example_microbatch, split_spec=split_spec(model, pipe))
        assert ir.num_stages == len(pipe.stages), f"torch cut {ir.num_stages} stages, the plan has {len(pipe.stages)}"
        self.owner = {k: stage_device(k, pipe.degree, pipe.schedule) for k in range(ir.num_stages)}
        mine = [k for k in range(ir.num_stages) if self.owner[k] == self.stage_rank]
        self.modules = {k: ir.get_stage_module(k) for k in mine}
        # tied parameters have several names in the model; the stages may hold a copy under any of them
        first_name: dict[int, str] = {}
        self.canonical: dict[str, str] = {}
        for name, prm in model.named_parameters(remove_duplicate=False):
            self.canonical[name] = first_name.setdefault(id(prm), name)
        holders: dict[str, list[int]] = {}
        for k in range(ir.num_stages):
            for name, _ in ir.get_stage_module(k).named_parameters(remove_duplicate=False):
                holders.setdefault(self.canonical.get(name, name), []).append(k)
        self.tied = {n: sorted({self.owner[k] for k in ks}) for n, ks in holders.items() if len({self.owner[k] for k in ks}) > 1}
        self.tied_groups = {
            tuple(devs): [dist.new_group([s * data + j for s in devs]) for j in range(data)] for devs in sorted({tuple(v) for v in self.tied.values()})
        }
        stages = [PipelineStage(self.modules[k], k, ir.num_stages, torch.device(device), group=self.pp_group) for k in mine]
        cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASS[pipe.schedule])
        kwargs = dict(n_microbatches=pipe.microbatches, loss_fn=loss_fn)
        self.schedule = cls(stages[0], **kwargs) if issubclass(cls, torch_schedules.PipelineScheduleSingle) else cls(stages, **kwargs)
        self.is_first = 0 in mine
        self.is_last = (ir.num_stages - 1) in mine

    def parameters(self):
        for m in self.modules.values():
            yield from m.parameters()

    def named_parameters(self):
        """(model FQN, parameter) of this rank's stages; a tied weight under its first name."""
        for m in self.modules.values():
            for name, prm in m.named_parameters():
                yield self.canonical.get(name, name), prm

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward of one batch (this data rank's share); the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.is_first else ()
        kwargs = {"target": y, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, **kwargs)
        self._reduce_grads()
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return None

    def _reduce_grads(self) -> None:
        aliases: dict[str, list[nn.Parameter]] = {}
        for m in self.modules.values():
            for name, prm in m.named_parameters(remove_duplicate=False):
                group = aliases.setdefault(self.canonical.get(name, name), [])
                if all(prm is not q for q in group):
                    group.append(prm)
        for name in sorted(aliases):
            prms = aliases[name]
            grads = [q.grad for q in prms if q.grad is not None]
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(prms[0])
            if name in self.tied:  # the embedding's and the head's shares of a tied weight's gradient
                dist.all_reduce(total, group=self.tied_groups[tuple(self.tied[name])][self.data_rank])
            if self.data > 1:
                dist.all_reduce(total, group=self.dp_group)
                total /= self.data
            for q in prms:
                q.grad = total.clone() if len(prms) > 1 else total


__all__ = ["PipelineRunner", "split_spec", "PRE", "POST"]
