"""One start of an elastic job under torchrun: plan for this world, resume from the last checkpoint, train.

torchrun's elastic agent (`--nnodes MIN:MAX`, c10d rendezvous, `--max-restarts`) restarts the workers
whenever the world changes: a node lost (its peers' collectives fail and they exit) or a node come
(the agent stops its workers with SIGTERM to admit it). Each start calls `ElasticRun.start`, which

1. joins the process group of the new world;
2. cuts the constant global batch for it (`split_batch`: micro-batches and accumulation);
3. takes the plan for this world from the plan store beside the checkpoints, or has the first rank make
   and store it (every rank runs the first rank's plan);
4. loads the newest complete checkpoint into the new plan's shards (model, optimizer, scheduler, step,
   random generator state, the user's `extra`), resharded by DCP;

and `steps()` then yields the steps left, checkpointing every `checkpoint_every` steps in the background
and, when any rank was sent SIGTERM, saving at the end of the step on every rank and exiting.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from meshplan.api import auto_parallelize, plan_once
from meshplan.elastic.batch import BatchSplit, split_batch
from meshplan.elastic.plans import PlanStore, model_key, plan_for_world
from meshplan.elastic.saver import AsyncSaver, discard_partial
from meshplan.runtime.checkpoint import latest_checkpoint, load_checkpoint
from meshplan.runtime.collectives import resolve_timeout
from meshplan.runtime.launch import init_torchrun_group, is_torchrun

__all__ = ["ElasticRun"]


def _join_group(timeout: timedelta) -> None:
    if dist.is_initialized():
        return
    if not is_torchrun():
        raise ValueError("meshplan.elastic runs under torchrun (RANK and WORLD_SIZE unset here), or in a process group "
                         "you initialised")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The shared store outlives rounds, and torch keys each attempt by the restart count, which differs between
        # agents once one has restarted more often than another (a node that joined later): their workers never meet.
        raise ValueError(
            "meshplan.elastic needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (got the agent's "
            f"shared store, TORCHELASTIC_RESTART_COUNT={os.environ.get('TORCHELASTIC_RESTART_COUNT')}): with it each "
            "round's ranks meet in a store of their own, whatever each node's restart count")
    init_torchrun_group(timeout=timeout)


def _text(state: torch.Tensor) -> str:
    """A generator state (bytes) as JSON text: nothing in a checkpoint is pickled."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _slice(value, lo: int, hi: int):
    return value[lo:hi] if isinstance(value, torch.Tensor) else value


class ElasticRun:
    """A training run that survives world-size changes; make it with `ElasticRun.start(...)` on every rank."""

    model: nn.Module
    """The `ParallelModule` of this world's plan."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    """The LR scheduler (None without `scheduler=`)."""
    split: BatchSplit
    """How this world cuts the global batch (`split.accumulation` micro-batches per step)."""
    step: int
    """Steps completed (0 before the first; the checkpoint's step after a resume)."""
    extra: dict
    """The user's JSON state saved with every checkpoint (a data loader's position, say) and restored on resume."""
    resumed_from: str | None
    """The checkpoint this start loaded, or None for a fresh run."""
    plan_source: str
    """'store' (a plan made earlier for this world) or 'planned' (made by this start)."""
    timeline: dict[str, float]
    """Wall-clock times (`time.time()`) at which this start finished joining the group, planning, building the
    model, loading the checkpoint and its first step: what a world change costs, phase by phase."""

    @classmethod
    def start(cls, model: nn.Module, example_inputs: tuple, *, checkpoint_dir: str | os.PathLike, global_batch: int,
              optimizer: Callable[[Any], torch.optim.Optimizer], scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
              micro_batch: int | None = None, checkpoint_every: int = 100, keep: int = 2, max_world: int | None = None,
              timeout: timedelta | float | None = None, **plan_options: Any) -> ElasticRun:
        """Join this world, plan for it (or take its stored plan), build the model and resume from the newest checkpoint.

        `model`: the same model on every rank (its weights start a fresh run). `example_inputs`: one global batch
        (`global_batch` samples on dim 0 of every tensor). `optimizer(params)` and `scheduler(optimizer)` build them.
        `micro_batch`: most samples per rank in one forward pass (None: no limit); the step accumulates as many
        micro-batches as this world needs. `checkpoint_every`: steps between background checkpoints; `keep`: complete
        checkpoints kept. `max_world`: largest world tried when naming the smallest world a plan fits (default 8 x
        this one). Other keywords go to `meshplan.plan` (`memory_budget=`, `mesh_shape=`, ...).
        """
        self = cls()
        self.timeline = {}
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be a positive int (steps); got {checkpoint_every!r}")
        timeout = resolve_timeout(timeout)
        _join_group(timeout)
        self.timeline["group"] = time.time()
        world = dist.get_world_size()
        self.split = split_batch(global_batch, world, micro_batch)
        batches = {t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor)}
        if batches != {global_batch}:
            raise ValueError(f"example_inputs must be one global batch: tensors of {global_batch} samples on dim 0; "
                             f"got batch sizes {sorted(batches)}")
        plan_options.setdefault("pipeline", None)  # micro-batches accumulate through the model's own forward

        def example_for(w: int) -> tuple:
            micro = split_batch(global_batch, w, micro_batch).micro_batch
            return tuple(_slice(t, 0, micro) for t in example_inputs)

        store = PlanStore(os.path.join(os.fspath(checkpoint_dir), "plans"))
        key = model_key(model, example_for(world), plan_options)
        mesh_shape = plan_options.get("mesh_shape")
        self.plan_source = "store"

        def make():
            found = store.get(world, mesh_shape, key)
            if found is None:
                found = plan_for_world(model, world, example_for, global_batch=global_batch, micro_batch=micro_batch,
                                       max_world=max_world or 8 * world, **plan_options)
                store.put(world, mesh_shape, key, found)
                self.plan_source = "planned"
            return found

        plan = plan_once(make)
        self.timeline["plan"] = time.time()
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        sources = [self.plan_source]
        dist.broadcast_object_list(sources, src=0, group=self._control)
        self.plan_source = sources[0]
        self.model = auto_parallelize(model, example_inputs=example_for(world), plan=plan, timeout=timeout)
        self.optimizer = optimizer(self.model.parameters())
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.timeline["model"] = time.time()
        self.step, self.extra, self.resumed_from = 0, {}, None
        root = os.path.join(os.fspath(checkpoint_dir), "ckpt")
        last = [None]
        if dist.get_rank() == 0:  # one choice for every rank; no save runs yet: the last world's ranks are gone
            discard_partial(root)
            last = [latest_checkpoint(root)]
        dist.broadcast_object_list(last, src=0, group=self._control)
        if last[0] is not None:
            self._resume(last[0])
        self.timeline["load"] = time.time()
        self.checkpoint_every = checkpoint_every
        self._saver = AsyncSaver(root, self.model, self.optimizer, keep=keep, timeout=timeout)
        self._saver.saved_step = self.step if last[0] is not None else None
        self._signalled = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _resume(self, path: str) -> None:
        info = load_checkpoint(path, self.model, self.optimizer)
        saved = info.extra.get("elastic", {}) if isinstance(info.extra, dict) else {}
        if saved.get("global_batch") != self.split.global_batch:
            raise ValueError(f"checkpoint {path} was trained with global batch {saved.get('global_batch')} and this run has "
                             f"{self.split.global_batch}: step k would no longer consume the same samples; resume with "
                             f"global_batch={saved.get('global_batch')} or start a new run in another directory")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(_tensor(saved["rng"]))
        self.model.set_rng_state([_tensor(t) for t in saved["program_rng"]])
        self.step, self.extra, self.resumed_from = info.step, dict(info.extra.get("user", {})), path

    def _state(self) -> dict:
        elastic = {"global_batch": self.split.global_batch, "world": self.split.world, "rng": _text(torch.get_rng_state()),
                   "program_rng": [_text(t) for t in self.model.rng_state()],
                   "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        return {"elastic": elastic, "user": self.extra}

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True  # acted on at the end of the step, on every rank together

    @property
    def stop_requested(self) -> bool:
        """Whether this rank was sent SIGTERM (the run stops, after saving, at the end of the current step)."""
        return self._signalled

    def micro_batches(self, *batch) -> Iterator:
        """Step k's global batch (every tensor `global_batch` samples on dim 0) cut into `split.accumulation`
        micro-batches; gradient reductions are deferred (`no_sync`) until the last one's backward. Scale each
        micro-batch's loss by `1 / split.accumulation` to keep the global batch's mean."""
        for t in batch:
            if isinstance(t, torch.Tensor) and t.shape[0] != self.split.global_batch:
                raise ValueError(f"step {self.step + 1}'s batch has {t.shape[0]} samples on dim 0 but the global batch is "
                                 f"{self.split.global_batch}: every step consumes one whole global batch, whatever the world")
        m = self.split.micro_batch
        for i in range(self.split.accumulation):
            part = tuple(_slice(t, i * m, (i + 1) * m) for t in batch)
            last = i == self.split.accumulation - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                yield part[0] if len(part) == 1 else part

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps after the resumed one up to `total` (1-based). After each: a background checkpoint every
        `checkpoint_every` steps, and a blocking one plus `SystemExit` when a rank was sent SIGTERM; the last step's
        checkpoint is complete when the loop ends."""
        while self.step < total:
            yield self.step + 1
            self.step += 1
            self.timeline.setdefault("first_step", time.time())
            if self._stop_agreed():
                self._saver.save_now(self.step, self._state())
                who = "this rank" if self._signalled else "another rank"
                raise SystemExit(f"rank {dist.get_rank()}: {who} was sent SIGTERM; checkpoint of step {self.step} saved "
                                 f"in {self._saver.root}; exiting so that torchrun can restart the group")
            if self.step % self.checkpoint_every == 0 or self.step == total:
                self._saver.save(self.step, self._state())
        self._saver.wait()
        if self._saver.saved_step != self.step:
            self._saver.save_now(self.step, self._state())

    def wait_for_checkpoint(self) -> None:
        """Block until the background checkpoint in flight (if any) is complete."""
        self._saver.wait()

    @property
    def checkpoint_timings(self) -> list[dict[str, float]]:
        """Per background checkpoint: `step`, `start` (`time.perf_counter()`), `blocking_s` (time the loop waited),
        `total_s` (until written)."""
        return self._saver.timings

    def _stop_agreed(self) -> bool:
        flag = torch.tensor([1 if self._signalled else 0])
        with self.model.comm.guard("agreeing whether a rank was sent SIGTERM (end of step)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control)
        return bool(flag.item())
