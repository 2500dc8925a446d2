"""Bucketed gradient all-reduce, overlapped with the rest of backward (what DDP does).

The plan fixes the buckets (`Plan.buckets`): which parameters share one all-reduce and the order
the all-reduces are issued in. `BucketQueue` launches them asynchronously in that order and waits for
them, for every plan; when a bucket is complete depends on how the plan runs. Here, for a plan without
a pipeline (`GradBuckets`): as soon as one backward pass has accumulated all of its gradients and
every earlier bucket has been launched, so all ranks issue the same collectives in the same order;
the end of backward waits for them and writes the sums back into `.grad`. (A pipeline's: after its
last microbatch, runtime/stage_grads.py.)

Only gradients not reduced yet are summed over ranks. With gradient accumulation (several
`backward()` calls before `step()`), `.grad` already holds the earlier micro-steps' gradients,
summed before; summing them again would count them once per rank. A tensor hook sees each new
gradient before autograd adds it: the bucket reduces that, and the end of backward writes
`earlier + sum` into `.grad` (what one process accumulates).

Inside `deferred()` (ParallelModule.no_sync) nothing is reduced: autograd accumulates local
gradients into `.grad`, and the first reducing backward after it sums those together with its own
(`.grad` minus what was already reduced when the deferral began).

Parameters are DTensors (plain tensors under a data-parallel plan); every sum works on their local tensors.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from meshplan.plans.plan import GradBucket
from meshplan.runtime.collectives import MeshComm, count_collective
from meshplan.runtime.local_view import local_of


_NONE = object()


class BucketQueue:
    """The gradient reduction every plan runs, written once: the plan's buckets, launched strictly in the plan's
    order (`launch`, one all-reduce per bucket over its mesh axes, so every rank issues the same collectives in
    the same order), then waited for together (`drain`). When a bucket is complete is the caller's to say:
    after each backward pass (`GradBuckets`), or after a pipeline's last microbatch (runtime/stage_grads.py).

    `buckets`: (the bucket's index in the plan, its mesh axes, the parameters it holds on this rank)."""

    def __init__(self, buckets: list[tuple[int, tuple[int, ...], list[torch.Tensor]]], comm: MeshComm) -> None:
        self.buckets, self._comm = buckets, comm
        self.flat: list[torch.Tensor | None] = [None] * len(buckets)
        """Each bucket's packed gradients, allocated on first use and kept for the whole run, as DDP keeps its
        buckets: a fresh multi-MB tensor can cost page faults (a 13 MB cat in isolation here: ~10 ms fresh, 1.5 ms
        into a kept buffer). Safe: `drain` waits for a bucket before it is packed again."""
        self.next = 0
        """the first bucket not launched yet"""
        self._pending: list[tuple[int, object]] = []

    def __len__(self) -> int:
        return len(self.buckets)

    def _what(self, i: int) -> str:
        index, axes, _ = self.buckets[i]
        return f"gradient bucket {index} all_reduce over mesh axes {[self._comm.mesh.axis_names[a] for a in axes]}"

    def launch(self, grads: list[torch.Tensor]) -> None:
        """Start the all-reduce of bucket `next`, whose parameters contribute `grads` (local tensors, in order)."""
        i = self.next
        if self.flat[i] is None:
            dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
            self.flat[i] = grads[0].new_empty(sum(g.numel() for g in grads), dtype=dtype)
        torch.cat([g.reshape(-1) for g in grads], out=self.flat[i])
        count_collective("grad_sync", "all_reduce")
        with self._comm.guard(self._what(i)):
            self._pending.append((i, dist.all_reduce(self.flat[i], group=self._comm.group(self.buckets[i][1]), async_op=True)))
        self.next += 1

    def drain(self):
        """Wait for every launched bucket; yields (parameter, its summed local block), then starts over."""
        for i, work in self._pending:
            with self._comm.guard(self._what(i)):
                work.wait(self._comm.timeout)
            offset = 0
            for p in self.buckets[i][2]:
                n = local_of(p).numel()
                yield p, self.flat[i][offset : offset + n].view_as(local_of(p))
                offset += n
        self._pending, self.next = [], 0


class GradBuckets:
    """The flat plan's gradient reduction: a bucket launches as soon as one backward pass has accumulated all of its
    gradients (post-accumulate hooks), the end of the backward pass waits for every bucket and writes the sums back."""

    def __init__(self, buckets: tuple[GradBucket, ...], params: dict[str, torch.Tensor], comm: MeshComm) -> None:
        self._queue = BucketQueue([(i, b.axes, [params[n] for n in b.params]) for i, b in enumerate(buckets)], comm)
        self._where = {id(params[n]): i for i, b in enumerate(buckets) for n in b.params}
        self._deferring = False
        self._reduced_before: dict[int, torch.Tensor | None] = {}  # id(param) -> its reduced .grad when the deferral began
        self._reset()
        for _, _, group in self._queue.buckets:
            for p in group:
                p.register_hook(functools.partial(self._on_new_grad, p))
                p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The packed buckets this rank keeps."""
        return [f for f in self._queue.flat if f is not None]

    @contextlib.contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def _reset(self) -> None:
        self._ready = [0] * len(self._queue)
        self._armed = False
        self._new: dict[int, torch.Tensor] = {}  # id(param) -> this backward's local gradient, until its bucket launches
        self._earlier: dict[int, torch.Tensor | None] = {}  # id(param) -> what .grad held before this backward
        self._kept: dict[int, torch.Tensor | None] = {}  # id(param) -> the reduced part its new .grad adds the sum to

    @torch.no_grad()
    def _on_new_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Runs before autograd adds `grad` into `param.grad` (returns None: it is added as usual)."""
        if self._deferring:
            if id(param) not in self._reduced_before:
                self._reduced_before[id(param)] = None if param.grad is None else local_of(param.grad).clone()
            return
        if param.grad is None:  # autograd stores `grad` itself as .grad (holding it here would make it store a copy)
            self._new[id(param)] = None
            self._earlier[id(param)] = None
            return
        self._new[id(param)] = local_of(grad)
        self._earlier[id(param)] = local_of(param.grad).clone()

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._deferring:
            return
        if not self._armed:
            # runs once the whole backward pass is done, on the thread that started it
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._armed = True
        self._ready[self._where[id(param)]] += 1
        queue = self._queue
        while queue.next < len(queue) and self._ready[queue.next] == len(queue.buckets[queue.next][2]):
            self._launch()

    @torch.no_grad()
    def _unreduced(self, p: torch.Tensor) -> torch.Tensor:
        """What `p` contributes to this reduction, and (in `_kept`) the reduced part its `.grad` keeps."""
        fresh = id(p) in self._new
        new = self._new.pop(id(p), None)
        if fresh and new is None:  # the first gradient of this backward is .grad itself
            new = local_of(p.grad)
        earlier = self._earlier[id(p)] if id(p) in self._earlier else local_of(p.grad)
        part = torch.zeros_like(local_of(p)) if new is None else new
        reduced = self._reduced_before.pop(id(p), _NONE)
        if reduced is not _NONE and earlier is not None:  # local gradients accumulated under no_sync
            part = part + (earlier if reduced is None else earlier - reduced)
            self._kept[id(p)] = reduced
        elif new is not None:
            self._kept[id(p)] = earlier
        return part

    def _launch(self) -> None:
        self._queue.launch([self._unreduced(p) for p in self._queue.buckets[self._queue.next][2]])

    @torch.no_grad()
    def _finish(self) -> None:
        # parameters that got no gradient this step still take part: every rank must issue every bucket
        while self._queue.next < len(self._queue):
            self._launch()
        for p, summed in self._queue.drain():
            if id(p) in self._kept:  # it has a gradient to write (on every rank: one program)
                kept = self._kept[id(p)]
                local_of(p.grad).copy_(summed if kept is None else kept.add_(summed))
        self._reset()
