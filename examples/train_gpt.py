"""Train the small GPT with a plan meshplan picks: gloo on CPU, NCCL on GPUs.

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 20 --accumulate 2

Every rank builds the same model (same seed) and feeds the same global batch; meshplan shards
the work as its plan says. The loop is an ordinary PyTorch one: AdamW, gradient accumulation with
`no_sync()`, `clip_grad_norm_`, a cosine LR schedule, a DCP checkpoint at the end. Plain
`python examples/train_gpt.py` runs it on one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshplan
from meshplan.models import GPT, GPTConfig
from meshplan.runtime.launch import free_port, init_torchrun_group, is_torchrun


def batch(gen: torch.Generator, size: int, cfg: GPTConfig) -> torch.Tensor:
    """Counting sequences (random start, random step 1-4) mod vocab: the next token is learnable."""
    start = torch.randint(0, cfg.vocab_size, (size, 1), generator=gen)
    step = torch.randint(1, 5, (size, 1), generator=gen)
    return (start + step * torch.arange(cfg.seq_len)) % cfg.vocab_size  # int64 [size, seq_len]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="global batch size (sequences per step)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--checkpoint", default=None, help="directory to save a checkpoint to at the end")
    args = parser.parse_args()

    if not is_torchrun():  # plain `python`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_torchrun_group()  # NCCL (and this rank's GPU) where CUDA is available, else gloo
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # same on every rank: all ranks build the same model
    cfg = GPTConfig()
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(0)  # same on every rank: inputs are global
    tokens = batch(gen, args.batch, cfg)

    pmodel = meshplan.auto_parallelize(model, devices=world_size, example_inputs=(tokens,))
    if rank == 0:
        print(pmodel.plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    for step in range(1, args.steps + 1):
        for micro in range(args.accumulate):
            # the gradient all-reduce runs once, after the last micro-batch
            with pmodel.no_sync() if micro < args.accumulate - 1 else contextlib.nullcontext():
                logits = pmodel(tokens)  # [batch, seq, vocab]
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
                (loss / args.accumulate).backward()
            tokens = batch(gen, args.batch, cfg)
        norm = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 1.0)  # one global norm, the same on every rank
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step == 1 or step % 5 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}")

    if args.checkpoint:
        meshplan.save_checkpoint(args.checkpoint, pmodel, opt, step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
