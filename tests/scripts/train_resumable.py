"""Train a small GPT under torchrun, checkpointing every step, and survive a lost rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/scripts/train_resumable.py --work /tmp/run --steps 6 --kill-at 4

The plan is solved once and saved as a JSON strategy file (`WORK/plan.json`); every start after
that, including torchrun's restarts, loads it instead of re-planning. Each step ends with a
checkpoint (`WORK/ckpt/step_NNNNNN`, DCP + meshplan.json) and one line `{"attempt", "step",
"loss"}` in `WORK/log.jsonl`, so a restarted job resumes after the last complete checkpoint. With
`--kill-at K`, rank `--kill-rank` SIGKILLs itself in the middle of step K on the first attempt
(torchrun's TORCHELASTIC_RESTART_COUNT is 0 only then).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys

import torch
import torch.distributed as dist

import meshplan
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.checkpoint import latest_checkpoint
from meshplan.runtime.launch import init_torchrun_group

import token_data

CFG = GPTConfig(layers=1)
BATCH = 4


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batch(step: int) -> torch.Tensor:
    """The global batch of `step`: a function of the step alone, so a resumed run sees the same data."""
    return token_data.batch(step, BATCH, CFG.vocab_size, CFG.seq_len)


loss_of = token_data.next_token_loss


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def reference_losses(steps: int) -> list[float]:
    """One process, no interruption: what the distributed run must log."""
    model = build()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="directory for plan.json, ckpt/ and log.jsonl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=0, help="step in which a rank SIGKILLs itself (first attempt only)")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    args = parser.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_torchrun_group("gloo", timeout=args.timeout)  # init_process_group, safe across torchrun's restarts
    rank = dist.get_rank()
    torch.set_num_threads(1)
    log_path = os.path.join(args.work, "log.jsonl")

    def log(**record) -> None:
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps({"attempt": attempt, **record}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    model, example = build(), batch(1)
    plan_path = os.path.join(args.work, "plan.json")
    source = "file"
    if not os.path.exists(plan_path):  # first start: solve once, save the strategy file
        if rank == 0:
            meshplan.plan(model, devices=dist.get_world_size(), example_inputs=(example,)).save(plan_path + ".tmp")
            os.replace(plan_path + ".tmp", plan_path)
        source = "solved"
        dist.barrier()
    with open(plan_path) as f:
        plan = meshplan.Plan.from_json(f.read())
    log(event="plan", source=source, hash=plan.hash())

    pmodel = meshplan.auto_parallelize(model, example_inputs=(example,), plan=plan, timeout=args.timeout)
    opt = optimizer(pmodel.parameters())
    root = os.path.join(args.work, "ckpt")
    start = 1
    last = latest_checkpoint(root)
    if last is not None:
        info = meshplan.load_checkpoint(last, pmodel, opt)
        start = info.step + 1
        log(event="resume", checkpoint=os.path.basename(last), step=info.step)

    for step in range(start, args.steps + 1):
        opt.zero_grad()
        loss = loss_of(pmodel, batch(step))
        if attempt == 0 and rank == args.kill_rank and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank, mid-step
        loss.backward()
        opt.step()
        meshplan.save_checkpoint(os.path.join(root, f"step_{step:06d}"), pmodel, opt, step=step)
        log(step=step, loss=loss.item())
        if rank == 0:  # keep the two newest checkpoints
            for old in sorted(os.listdir(root))[:-2]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
