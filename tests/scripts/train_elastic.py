"""Train a small GPT elastically under torchrun: the world may shrink and grow between steps.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --nnodes 1:2 --nproc-per-node 2 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job --max-restarts 5 \\
        tests/scripts/train_elastic.py --work /tmp/run --steps 15

Every start logs one line `{"event": "start", "world", ...}` to `WORK/log.jsonl` and every step one line
`{"step", "loss", "world"}` (rank 0). The global batch of step k is a function of k alone. Hooks for the
test (no sleeps racing the training): `--hold-after K` makes every rank wait after step K, once its
checkpoints are complete, until `WORK/release_K` exists or it is sent SIGTERM; each worker writes its pid to
`WORK/pids/$NODE_NAME-<pid>` so that the test can kill one node's processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_PROCESS = time.time()  # before torch is imported: the process's own start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshplan.elastic import ElasticRun  # noqa: E402
from meshplan.models import GPT, GPTConfig  # noqa: E402

import token_data  # noqa: E402

CFG = GPTConfig(layers=1)
GLOBAL_BATCH = 8


def batch(step: int) -> torch.Tensor:
    """The global batch of `step`: a function of the step alone, so every world sees the same data."""
    return token_data.batch(step, GLOBAL_BATCH, CFG.vocab_size, CFG.seq_len)


loss_of = token_data.next_token_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="directory for plans/, ckpt/, log.jsonl")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--micro-batch", type=int, default=2, help="most samples per rank in one forward pass")
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--hold-after", type=int, action="append", default=[])
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(os.path.join(args.work, "pids"), exist_ok=True)
    open(os.path.join(args.work, "pids", f"{os.environ.get('NODE_NAME', 'node')}-{os.getpid()}"), "w").close()

    torch.manual_seed(0)
    run = ElasticRun.start(GPT(CFG), (batch(1),), checkpoint_dir=args.work, global_batch=GLOBAL_BATCH,
                           micro_batch=args.micro_batch, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                           scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
                           checkpoint_every=args.checkpoint_every, timeout=args.timeout)
    rank = dist.get_rank()

    def log(**record) -> None:
        if rank == 0:
            with open(os.path.join(args.work, "log.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    log(event="start", world=dist.get_world_size(), accumulation=run.split.accumulation, plan_source=run.plan_source,
        mesh=list(run.model.plan.mesh.shape), resumed_from=os.path.basename(run.resumed_from or ""), step=run.step,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), process=T_PROCESS, timeline=run.timeline)
    for step in run.steps(args.steps):
        loss = 0.0
        for tokens in run.micro_batches(batch(step)):
            part = loss_of(run.model, tokens) / run.split.accumulation
            part.backward()
            loss += part.item()
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
        log(step=step, loss=loss, world=dist.get_world_size(), time=time.time())
        if step in args.hold_after:
            run.wait_for_checkpoint()
            release = os.path.join(args.work, f"release_{step}")
            log(event="held", step=step, world=dist.get_world_size())
            while not os.path.exists(release) and not run.stop_requested:
                time.sleep(0.05)  # a poll, not a race: the test acts, then releases (or the agent stops us)
    log(event="done", step=run.step, world=dist.get_world_size(), checkpoints=run.checkpoint_timings)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
