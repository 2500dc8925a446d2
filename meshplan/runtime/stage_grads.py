"""Gradient sync of a pipeline rank's stages, overlapped with the last microbatch's backward.

A parameter's gradient is complete once the last microbatch's backward (its weight part, under a
zero-bubble schedule) has passed through every local stage that reads it. torch's schedules say
which backward is a stage's last (`last_backward`); `SyncingStage` runs it inside
`StageGradSync.last_backward`, where a post-accumulate hook marks each parameter complete, and a
bucket whose parameters are all complete is all-reduced asynchronously while backward goes on, as
DDP and Megatron overlap the gradient reduction. Every rank of a bucket's group holds the same
stages, so all of them issue the same collectives in the same order.

`finish()` issues the buckets left (whose parameters got no gradient), waits for every reduction
and writes the sums back. Then a parameter that stages on several pipeline ranks read (a tied
embedding and head) sums its reduced gradient over those ranks: both reductions are sums, so their
order does not change the result, and the buckets holding tied parameters need not wait for the
end of the step.

The microbatches' gradients are summed by autograd; each parameter's is divided by the microbatch
count before its reduction (the loss is a mean over microbatches). The reduction itself is the one every
plan runs (`grad_buckets.BucketQueue`); what is particular to a pipeline is when a bucket is complete.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from meshplan.plans.plan import GradBucket
from meshplan.runtime.collectives import MeshComm, count_collective
from meshplan.runtime.grad_buckets import BucketQueue
from meshplan.runtime.local_view import local_of


class StageGradSync:
    """`params`: this rank's trainable parameters by graph node; `holders`: node -> the local stages that read it;
    `tied`: node -> the pipeline ranks sharing it, with `tied_groups` their process groups; `fqn_of`: node -> its
    name in the model (for error messages)."""

    def __init__(self, buckets: tuple[GradBucket, ...], params: dict[str, nn.Parameter], holders: dict[str, set[int]],
                 tied: dict[str, tuple[int, ...]], tied_groups: dict, microbatches: int, comm: MeshComm,
                 fqn_of: dict[str, str]) -> None:
        self.params, self.tied = params, tied
        self._holders, self._comm, self._fqn_of = holders, comm, fqn_of
        self._tied_groups, self._microbatches = tied_groups, microbatches
        held = [(i, b.axes, [x for x in b.params if x in params]) for i, b in enumerate(buckets)]
        self._names = [names for _, _, names in held if names]
        self._queue = BucketQueue([(i, axes, [params[x] for x in names]) for i, axes, names in held if names], comm)
        self.overlapped = 0
        """Buckets of the last step whose all-reduce started before the schedule ended."""
        for name, p in params.items():
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, name))
        self._earlier: dict[str, torch.Tensor | None] = {}
        self._reset()

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The packed buckets this rank keeps."""
        return [f for f in self._queue.flat if f is not None]

    def _reset(self) -> None:
        self._in_last: int | None = None  # the local stage running its last microbatch's backward
        self._done: dict[str, set[int]] = {}  # node -> the local stages whose last backward it has seen
        self._scaled: set[str] = set()

    @contextlib.contextmanager
    def last_backward(self, stage: int):
        """Around local stage `stage`'s last backward of the step: its parameters' gradients complete."""
        self._in_last = stage
        try:
            yield
        finally:
            self._in_last = None
        for name, holders in self._holders.items():  # the ones that got no gradient are complete too
            if stage in holders:
                self._done.setdefault(name, set()).add(stage)
        self._issue(ready_only=True)

    def _on_grad(self, name: str, param: nn.Parameter) -> None:
        if self._in_last is not None and self._in_last in self._holders[name]:
            self._done.setdefault(name, set()).add(self._in_last)
            self._issue(ready_only=True)

    def _complete(self, name: str) -> bool:
        return self._done.get(name, set()) >= self._holders[name]

    @torch.no_grad()
    def _issue(self, *, ready_only: bool) -> None:
        while self._queue.next < len(self._queue):
            names = self._names[self._queue.next]
            if ready_only and not all(self._complete(x) for x in names):
                return
            self._scale(names)
            self._queue.launch([local_of(self.params[x].grad) for x in names])
            if ready_only:
                self.overlapped += 1

    def _scale(self, names) -> None:
        for x in names:
            if x in self._scaled:
                continue
            p = self.params[x]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self._microbatches > 1:  # one microbatch's gradient is the step's already: no kernel per parameter
                p.grad.div_(self._microbatches)
            self._scaled.add(x)

    @torch.no_grad()
    def start(self) -> None:
        """Before the schedule runs: nothing issued yet. Gradients accumulated by earlier steps are summed already:
        they are set aside, so that only this step's are scaled and summed, and added back by `finish`."""
        self._reset()
        self.overlapped = 0
        for name, p in self.params.items():
            self._earlier[name], p.grad = p.grad, None

    @torch.no_grad()
    def finish(self) -> None:
        """After the schedule: issue the remaining buckets, wait, write back, sum tied gradients over their pipeline
        ranks, add back the earlier steps' gradients."""
        self._scale(self.params)
        self._issue(ready_only=False)
        for p, summed in self._queue.drain():
            local_of(p.grad).copy_(summed)
        for name in sorted(self.tied):
            if name in self.params:
                count_collective("tied_sync", "all_reduce")
                with self._comm.guard(f"summing the gradient of tied {self._fqn_of[name]} over pipeline ranks {self.tied[name]}"):
                    dist.all_reduce(local_of(self.params[name].grad), group=self._tied_groups[self.tied[name]])
        for name, p in self.params.items():
            if self._earlier[name] is not None:
                p.grad = self._earlier[name].add_(p.grad)
        self._earlier = {}
        self._reset()


class SyncingStage(PipelineStage):
    """A `PipelineStage` that runs its last backward of the step inside `sync.last_backward`."""

    def __init__(self, *args, sync: StageGradSync, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sync = sync

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        last = full_backward and last_backward  # else the weights' part comes in backward_weight_one_chunk
        with self._sync.last_backward(self.stage_index) if last else contextlib.nullcontext():
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self._sync.last_backward(self.stage_index) if last_backward else contextlib.nullcontext():
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
