"""Elastic training: lose ranks, re-plan for the survivors, reshard, resume; grow back when they return.

    run = ElasticRun.start(model, (tokens,), checkpoint_dir="run", global_batch=64, micro_batch=8,
                           optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4), checkpoint_every=50)
    for step in run.steps(10_000):
        for tokens in run.micro_batches(global_batch_of(step)):
            (loss_fn(run.model(tokens)) / run.split.accumulation).backward()
        run.optimizer.step(); run.optimizer.zero_grad()

under `torchrun --nnodes MIN:MAX --rdzv-backend c10d ...` (docs/elastic.md). It sits on the public API
(`auto_parallelize`, `plan`, checkpoints); nothing below imports it.
"""

from meshplan.elastic.batch import BatchSplit, split_batch
from meshplan.elastic.plans import PlanStore, plan_for_world
from meshplan.elastic.run import ElasticRun

__all__ = ["BatchSplit", "ElasticRun", "PlanStore", "plan_for_world", "split_batch"]
