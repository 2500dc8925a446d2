"""Context parallelism as a region op: scaled-dot-product attention with the sequence split over a `cp` mesh axis.

`aten.scaled_dot_product_attention(q, k, v, ...)` takes q, k and v as [batch, heads, seq, head_dim]. Its rows
are the plain op's (batch or heads split, `planner/rules/attention.py`) plus five kernels with q, k, v and the
output split on the sequence (dim 2), offered only on a mesh axis named `cp` (torchtitan's name):

- `cp_attention(allgather)`: k and v are all-gathered over the axis, stacked in one collective (backward: their
  gradients reduce-scattered home in one); each rank attends its own query rows to the keys it needs, placed by the true
  token positions: rank r holds rows r*L .. r*L+L-1, so keys before r*L are whole to it, the next L a causal
  diagonal, and later ones unused. `BlockAttention` (`regions/attention_blocks.py`: the flash kernel on the CPU,
  on CUDA the one SDPA picks: flash, cuDNN or memory-efficient) runs each block and merges them by their
  log-sum-exp, so no mask tensor or score matrix exists.
- `cp_attention(balanced)`: the same with load balancing for causal masks. Of 2P query chunks rank r holds
  2r and 2r+1; it swaps the second with rank P-1-r's (one point-to-point exchange of half its queries), computes
  chunks 2r and 2P-1-2r (the same work on every rank: the chunk indices of every rank sum to 2P-1, against the
  rank-r-heavy split above), and swaps the borrowed chunk's output back. Outside the op the sequence stays split
  contiguously, so positions, RoPE tables, labels and the loss are untouched by the balancing (nothing else has
  to follow a token order), at the price of two exchanges of half a rank's queries (and two in backward).
- `cp_attention(ring)`: the same split and blocks, but K and V travel P-1 times to the next rank (point to
  point) instead of being gathered, so a rank holds one other block at a time and saves only its own K and V;
  backward sends them round again while the dK/dV of each block accumulate on the way home, every exchange
  hidden behind a block's compute (`RingAttention`).
- `cp_attention(ring_balanced)`: the ring over the balanced kernel's two query chunks, with the same swap of half
  the queries and their output with the mirrored rank around it (causal masks).
- `cp_attention(headtail)` and `cp_attention(ring_headtail)`: the all-gather kernel and the ring in a plan that
  holds its `cp` splits in head-tail token order (`Plan.token_order`, runtime/token_order.py): rank r already
  holds chunks r and 2P-1-r of 2P, whose causal work is the same on every rank, so nothing is swapped; the gather
  puts the keys back in sequence order, and the ring's blocks are two chunks each.
- `cp_attention(ulysses)`: all-to-all from sequence-split to heads-split (q, k, v), the plain op over the whole
  sequence and the local heads, all-to-all back (DeepSpeed-Ulysses); needs the heads and the KV heads on
  this rank divisible by P.
- `cp_attention(torch_ring)`: the token-order ring run by torch's own context-parallel templates
  (`regions/torch_ring.py`: `_templated_ring_attention` and its backward, load balanced, all-to-all rotation), the
  blocks this module's kernels run handed to them as their attention op. It passes what `ring_headtail` passes but
  its dK/dV sums in fp32, so it is offered only when asked for (`force_context_parallel("torch_ring")`, `SEARCHED`).
- `cp_attention(ulysses_headtail)`: Ulysses in a plan in head-tail token order. Its all-to-alls join the sequence
  in sequence order and cut it back into the token order (the runtime's token-order all-to-all), so the plain op
  sees the sequence as one process does; they cut the heads the same way (chunks r and 2P-1-r of 2P: query heads
  and key/value heads alike, so a query head's key/value head stays on its rank), which needs the heads and the KV
  heads on this rank divisible by 2P. Same collectives, bytes and work as Ulysses.

Each kernel's name carries `,causal` when the op is causal, so its cost knows the mask shape. Not offered, with
the reason `explain` prints: an explicit mask tensor, dropout, a sequence not divisible by 2P or no causal mask
(the balanced and token-order kernels), heads not divisible by P (ulysses; 2P in token order). `force_context_parallel` makes a plan
use them. Every collective is counted when issued (`StepFunction`, whose backward is the dual step, or
`collective` for the exchanges): the steps priced here are the steps the plan lists and the runtime runs.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from meshplan.cost_model.attention_memory import flash_cpu_bytes, on_cpu
from meshplan.cost_model.compute import attention_pairs, op_flops
from meshplan.cost_model.estimate import compute_time, measured_seconds, profiled_seconds, steps_time
from meshplan.cost_model.profile import op_key
from meshplan.cost_model.redistribution import CommStep
from meshplan.cost_model.regions import RegionCost
from meshplan.ir.graph import TensorMeta
from meshplan.ir.mesh import CP_AXIS
from meshplan.ir.placement import Replicate, Shard, local_shape
from meshplan.ir.regions import KernelRow, RegionOp, Row
from meshplan.planner.rules.attention import sdpa_rule
from meshplan.planner.strategies import clear_strategy_cache
from meshplan.regions.attention_blocks import (SEQ, BlockAttention, block_backward, block_forward, check_device, merge_blocks, repeat_heads,
                                               sum_heads)
from meshplan.regions.torch_ring import torch_ring_attention
from meshplan.runtime.collectives import MeshComm, StepFunction, collective, forward_phase, wait
from meshplan.runtime.token_order import owned_chunks

SDPA = torch.ops.aten.scaled_dot_product_attention.default
VARIANTS = ("allgather", "balanced", "ring", "ring_balanced", "ulysses", "headtail", "ring_headtail", "ulysses_headtail", "torch_ring")
SEARCHED = tuple(v for v in VARIANTS if v != "torch_ring")
"""The kernels a plan chooses among unless `force_context_parallel` names others: torch's ring (`regions/torch_ring.py`)
passes what `ring_headtail` passes, its dK/dV in fp32, so it never prices below it; it runs when asked for."""
BALANCED = ("balanced", "ring_balanced")
"""The kernels that swap half the queries with the mirrored rank (`MirrorSwap`): causal masks only."""
ULYSSES = ("ulysses", "ulysses_headtail")
"""The kernels that run the plain op over the whole sequence and 1/P of the heads, between all-to-alls."""
TOKEN_ORDER = ("headtail", "ring_headtail", "ulysses_headtail", "torch_ring")
"""The kernels of a plan in head-tail token order (`Plan.token_order`), and only of such a plan (planner/token_order.py):
the block kernels' ranks already hold two chunks of equal causal work, so nothing is swapped (causal masks only)."""
EVEN = BALANCED + ("headtail", "ring_headtail", "torch_ring")
"""The kernels whose ranks compute equal causal work in blocks."""
RINGS = ("ring", "ring_balanced", "ring_headtail", "torch_ring")
"""The kernels that pass K and V round the ring (`RingAttention`; torch's templates, `TorchRingAttention`) instead of
gathering them."""


def kernel_name(variant: str, causal: bool) -> str:
    return f"cp_attention({variant}{',causal' if causal else ''})"


def parse_kernel(kernel: str) -> tuple[str, bool]:
    """`'cp_attention(balanced,causal)'` -> ('balanced', True)."""
    m = re.fullmatch(r"cp_attention\((\w+)(,causal)?\)", kernel)
    if not m or m.group(1) not in VARIANTS:
        raise AssertionError(f"not a context-parallel attention kernel: {kernel!r}")
    return m.group(1), bool(m.group(2))


def sdpa_arguments(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False) -> dict:
    """The op's arguments by name (its schema, so positional and keyword calls read alike)."""
    return dict(q=q, k=k, v=v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def cp_axis(strategy) -> int:
    """The mesh axis that splits the sequence (the kernel row's axis)."""
    axes = [a for a, p in enumerate(strategy.inputs[0]) if p == Shard(SEQ)]
    if len(axes) != 1:
        raise AssertionError(f"a context-parallel kernel splits the sequence over exactly one mesh axis: {strategy}")
    return axes[0]


def balanced_chunks(rank: int, n: int) -> tuple[int, int]:
    """The two of 2n sequence chunks rank `rank` computes when balanced: its own first (2 rank) and the second of the
    rank at the mirrored place (2 (n - 1 - rank) + 1), whose indices sum to 2n - 1 on every rank."""
    return 2 * rank, 2 * n - 1 - 2 * rank


def query_chunks(variant: str, rank: int, n: int) -> tuple[int, ...]:
    """The chunks of 2n whose queries rank `rank` computes under an even kernel (`EVEN`): the balanced kernels' after
    their swap, the token-order kernels' as held (`token_order.owned_chunks`)."""
    return owned_chunks(rank, n) if variant in TOKEN_ORDER else balanced_chunks(rank, n)


def key_chunks(variant: str, rank: int, n: int, keys: int) -> tuple[tuple[int, int, int], ...]:
    """(offset in the block, first position, count) of the key chunks in rank `rank`'s block of `keys` keys: one
    contiguous chunk, or two in head-tail token order."""
    if variant not in TOKEN_ORDER:
        return ((0, rank * keys, keys),)
    half = keys // 2
    return tuple((i * half, c * half, half) for i, c in enumerate(owned_chunks(rank, n)))


def causal_pairs(variant: str, n: int, rows: int) -> int:
    """Query-key pairs the busiest rank computes under a causal mask, the sequence split over `n` ranks of `rows`
    query rows. A chunk of c rows starting at position f sees f whole keys and a c x c causal diagonal. Split
    contiguously (allgather, ring) rank n-1 has f = (n-1)L: (n - 1/2)L^2, (2n-1)/n of the average; balancing gives
    every rank two chunks of c = L/2 whose indices sum to 2n-1 (`balanced_chunks`): n L^2 / 2, the average."""
    if variant in EVEN:
        c = rows // 2
        return sum(j * c * c + attention_pairs(c, c, True) for j in balanced_chunks(0, n))
    return (n - 1) * rows * rows + attention_pairs(rows, rows, True)


def shared_cores_seconds(works: list[float], cores: float) -> float:
    """When the last of `works` (seconds each of one rank's compute alone) ends if the ranks share `cores` cores
    evenly, a rank never faster than alone: while k are busy each runs at min(1, cores / k). `cores` is the ranks
    over the measured contention (`Profile.slowdown`: how much slower each computes when all compute at once)."""
    elapsed = done = 0.0
    for i, w in enumerate(sorted(works)):
        elapsed += (w - done) / min(1.0, cores / (len(works) - i))
        done = w
    return elapsed


def is_causal(node) -> bool:
    """Whether an SDPA node was traced with `is_causal=True` (`Node.attrs`)."""
    return dict(node.attrs).get("is_causal", False)


# ---------------------------------------------------------------- this rank's part

def _step(x: torch.Tensor, step: CommStep, comm: MeshComm, head_tail: bool = False) -> torch.Tensor:
    return StepFunction.apply(x, step, comm, head_tail)


def _attend(q, k, v, first: int, causal: bool, scale) -> torch.Tensor:
    """Query rows at sequence positions first .. first+len(q)-1 against keys 0 .. len(k)-1. Causal: the keys
    before `first` are whole to every row and the next len(q) a causal diagonal; later keys are not needed."""
    if not causal:
        return BlockAttention.apply(q, scale, (False,), k, v)
    rows = q.shape[SEQ]
    blocks: list[tuple[bool, torch.Tensor, torch.Tensor]] = [(True, k.narrow(SEQ, first, rows), v.narrow(SEQ, first, rows))]
    if first:
        blocks.insert(0, (False, k.narrow(SEQ, 0, first), v.narrow(SEQ, 0, first)))
    return BlockAttention.apply(q, scale, tuple(c for c, _, _ in blocks), *(t for _, kb, vb in blocks for t in (kb, vb)))


def _start_rotate(x: torch.Tensor, comm: MeshComm, axis: int, phase: str):
    """Start sending `x` to the next rank along `axis` and receiving the previous rank's; `_finish_exchange` waits."""
    n, me = comm.mesh.shape[axis], comm.coord[axis]
    return _start_exchange(x, comm, axis, phase, (me + 1) % n, (me - 1) % n, "ring attention")


def _start_exchange(x: torch.Tensor, comm: MeshComm, axis: int, phase: str, to: int, source: int, what: str):
    """Start sending `x` to place `to` on `axis` and receiving as much from place `source` (one point-to-point
    exchange, as an all-to-all with one non-empty piece each way). Counted as a send_recv when started."""
    n = comm.mesh.shape[axis]
    send, recv = [0] * n, [0] * n
    send[to] = recv[source] = x.numel()
    return collective(comm, phase, "send_recv", lambda: _what(comm, axis, phase, what),
                      lambda: funcol.all_to_all_single(x.contiguous().view(-1), recv, send, comm.group_name(axis)))


def _finish_exchange(pending, like: torch.Tensor, comm: MeshComm, axis: int, phase: str, what: str = "ring attention") -> torch.Tensor:
    if torch.compiler.is_compiling():
        return wait(pending).view(like.shape)
    with comm.guard(_what(comm, axis, phase, what)):
        return wait(pending).view(like.shape)


def _rotate(x: torch.Tensor, comm: MeshComm, axis: int, phase: str) -> torch.Tensor:
    return _finish_exchange(_start_rotate(x, comm, axis, phase), x, comm, axis, phase)


def _what(comm: MeshComm, axis: int, phase: str, what: str) -> str:
    return f"{phase} {what} send/recv over mesh axis {comm.mesh.axis_names[axis]}"


class MirrorSwap(torch.autograd.Function):
    """`x` exchanged with the rank at the mirrored place on `axis` (place r with place P-1-r; the middle place of an odd
    P with itself), for balanced attention; its backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, comm: MeshComm, axis: int):
        ctx.comm, ctx.axis = comm, axis
        return _mirror(x, comm, axis, forward_phase())

    @staticmethod
    def backward(ctx, grad):
        return _mirror(grad, ctx.comm, ctx.axis, "backward"), None, None


def _mirror(x: torch.Tensor, comm: MeshComm, axis: int, phase: str) -> torch.Tensor:
    partner = comm.mesh.shape[axis] - 1 - comm.coord[axis]
    what = "balanced attention"
    return _finish_exchange(_start_exchange(x, comm, axis, phase, partner, partner, what), x, comm, axis, phase, what)


def _balanced(q: torch.Tensor, comm: MeshComm, axis: int, attend) -> torch.Tensor:
    """This rank's output of balanced causal attention: the second half of its queries swapped with the mirrored rank's
    (`MirrorSwap`), `attend(own, lent, starts)` giving the outputs of its own first chunk and of the lent one (chunks
    `balanced_chunks`, at sequence positions `starts`), and the lent chunk's output swapped back."""
    c = q.shape[SEQ] // 2
    own, borrowed = balanced_chunks(comm.coord[axis], comm.mesh.shape[axis])
    lent = MirrorSwap.apply(q.narrow(SEQ, c, c), comm, axis)  # the partner's second chunk
    out_own, out_lent = attend(q.narrow(SEQ, 0, c), lent, (own * c, borrowed * c))
    return torch.cat([out_own, MirrorSwap.apply(out_lent, comm, axis)], dim=SEQ)


class RingAttention(torch.autograd.Function):
    """Ring attention over mesh axis `axis`: K and V (packed) travel P-1 times to the next rank, each exchange
    overlapping the current block's compute. The rank's queries are `len(starts)` equal chunks, chunk i at sequence
    positions starts[i] onwards (one chunk, r L, split contiguously; two when balanced); rank s holds keys s L ..
    s L + L - 1. At step t a rank holds the block of rank (r - t) mod P, and each chunk attends to the part of it
    that `_segments` says (under a causal mask: keys before the chunk whole, its own positions a causal diagonal,
    later keys unused). Blocks merge by log-sum-exp per chunk. Only the rank's own K and V are saved: backward
    sends them round again, the next block travelling while this one's gradients are computed, and each block's
    dK/dV sum travels after the block with one exchange more (the last brings it home): the sum for the block a
    rank holds arrives while the rank computes its own share of it, so both exchanges hide behind a block's
    compute as forward's does.
    Grouped-query heads are repeated per block (and their gradients summed back), so K and V travel with their own
    heads."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal: bool, axis: int, comm: MeshComm, starts: tuple[int, ...], variant: str = "ring"):
        n, me = comm.mesh.shape[axis], comm.coord[axis]
        ctx.scale, ctx.causal, ctx.axis, ctx.comm, ctx.starts, ctx.variant = scale, causal, axis, comm, starts, variant
        phase = forward_phase()
        rows, keys = q.shape[SEQ] // len(starts), k.shape[SEQ]
        packed, ctx.blocks = torch.stack([k, v]), {}
        outs: list[list[torch.Tensor]] = [[] for _ in starts]
        lses: list[list[torch.Tensor]] = [[] for _ in starts]
        for t in range(n):
            # the next block travels while this one is computed (gloo and NCCL progress on their own threads/streams)
            pending = _start_rotate(packed, comm, axis, phase) if t < n - 1 else None
            kb, vb = (repeat_heads(x, q.shape[1]) for x in packed.unbind(0))
            for i, start in enumerate(starts):
                for j, (first, count, diagonal) in enumerate(_block_segments(variant, start, rows, (me - t) % n, n, keys, causal)):
                    o, lse, ctx.blocks[t, i, j] = block_forward(q.narrow(SEQ, i * rows, rows), kb.narrow(SEQ, first, count),
                                                               vb.narrow(SEQ, first, count), diagonal, scale)
                    outs[i].append(o)
                    lses[i].append(lse)
            if pending is not None:
                packed = _finish_exchange(pending, packed, comm, axis, phase)
        merged = [merge_blocks(o, l, q.dtype) for o, l in zip(outs, lses)]
        out, lse = torch.cat([o for o, _ in merged], dim=SEQ), torch.cat([l for _, l in merged], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        comm, axis, starts = ctx.comm, ctx.axis, ctx.starts
        n, me = comm.mesh.shape[axis], comm.coord[axis]
        rows, keys = q.shape[SEQ] // len(starts), k.shape[SEQ]
        grad, grad_q = grad.contiguous(), torch.zeros_like(q, dtype=torch.float32)
        held, summed = torch.stack([k, v]), None  # the block held; the dK, dV sum of the block before it, on its way
        for t in range(n):
            coming = _start_rotate(held, comm, axis, "backward") if t < n - 1 else None  # the next block, while this one's gradients are computed
            kb, vb = (repeat_heads(x, q.shape[1]) for x in held.unbind(0))
            share = torch.zeros_like(held)  # this rank's part of the held block's dK, dV
            for i, start in enumerate(starts):
                mine = slice(i * rows, (i + 1) * rows)
                for j, (first, count, diagonal) in enumerate(_block_segments(ctx.variant, start, rows, (me - t) % n, n, keys,
                                                                             ctx.causal)):
                    dq, dk, dv = block_backward(grad[:, :, mine], q[:, :, mine], kb.narrow(SEQ, first, count),
                                                vb.narrow(SEQ, first, count), out[:, :, mine], lse[..., mine],
                                                ctx.blocks[t, i, j], diagonal, ctx.scale)
                    grad_q[:, :, mine] += dq
                    share[0].narrow(SEQ, first, count).add_(sum_heads(dk, k.shape[1]))
                    share[1].narrow(SEQ, first, count).add_(sum_heads(dv, v.shape[1]))
            # the previous ranks' sum for this block arrives (sent after their step t-1) and goes on with ours added
            total = share if summed is None else _finish_exchange(summed, share, comm, axis, "backward").add_(share)
            summed = _start_rotate(total, comm, axis, "backward")
            if coming is not None:
                held = _finish_exchange(coming, held, comm, axis, "backward")
        home = _finish_exchange(summed, held, comm, axis, "backward")  # rank r holds block r+1's sum: its own block's arrives
        return grad_q.to(q.dtype), home[0], home[1], None, None, None, None, None, None


@torch.compiler.disable(reason="ring attention runs eagerly: traced, AOTAutograd moves its backward exchanges of K and V")
def ring_attention(q, k, v, scale, causal: bool, axis: int, comm: MeshComm, starts: tuple[int, ...], variant: str = "ring"):
    """`RingAttention`, run eagerly under `torch.compile` (a graph break on each side). Traced (2 gloo ranks, GPT of 2
    layers, the min-cut partitioner inductor uses), the compiled graphs did not run the plan's exchanges: AOTAutograd's
    common-subexpression pass merged backward's exchanges of K and V into forward's equal ones (4 of the plan's 6
    backward exchanges ran, the blocks received in forward saved for backward: memory the plan does not count), and
    with backward's stack made unequal forward ran 4 exchanges where the plan lists 2. Eagerly they are the plan's."""
    return RingAttention.apply(q, k, v, scale, causal, axis, comm, starts, variant)


def _block_segments(variant: str, start: int, rows: int, src: int, n: int, keys: int, causal: bool) -> list[tuple[int, int, bool]]:
    """`_segments` of query rows at `start` .. over the key block rank `src` holds (`key_chunks`), offsets within the
    block."""
    return [(offset + first, count, diagonal) for offset, position, length in key_chunks(variant, src, n, keys)
            for first, count, diagonal in _segments(start, rows, position, length, causal)]


def _segments(start: int, rows: int, first_key: int, keys: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(offset, count, diagonal) of the parts of a block of `keys` keys at positions first_key.. that query rows at
    positions start .. start + rows - 1 attend to: without a causal mask the whole block; with one, the keys before
    `start` whole and those from `start` on a causal diagonal (query i sees keys up to start + i), later keys none.
    A diagonal must begin at `start` itself: the chunks and blocks of the kernels here always align so."""
    if not causal:
        return [(0, keys, False)]
    before, end = start - first_key, min(keys, start + rows - first_key)
    if end <= 0:
        return []
    if before < 0:
        raise AssertionError(f"query rows from {start} start inside the key block at {first_key}: not a causal diagonal")
    whole = [(0, min(before, keys), False)] if before > 0 else []
    return whole + ([(before, end - before, True)] if end > before else [])


def busiest_rank(variant: str, n: int, causal: bool) -> int:
    """The rank with the most query-key pairs: the last of a contiguous causal split, any one otherwise (rank 0)."""
    return n - 1 if causal and variant not in EVEN + ULYSSES else 0


def rank_attention(variant: str, q, k, v, rank: int, n: int, causal: bool, scale=None) -> torch.Tensor:
    """Rank `rank`'s attention rows under kernel `variant` (not Ulysses) of `n` ranks, computed on one device from
    the whole-sequence q, k, v without collectives: the same blocks, in the same order and shapes, that rank runs
    (the rings: its query chunks against every rank's key block as `_segments` cuts them; the gathered kernels: its
    chunks against the gathered keys, `_attend`). The profiler times the busiest rank's this way
    (`ContextParallel.timed_work`); benchmarks/gpu_cp_blocks.py times every rank's."""
    seq, heads = q.shape[SEQ], q.shape[1]
    rows = seq // n
    size = rows // 2 if variant in EVEN else rows
    starts = [j * size for j in query_chunks(variant, rank, n)] if variant in EVEN else [rank * rows]
    outs = []
    for start in starts:
        if variant in RINGS:
            flags, kv = [], []
            for t in range(n):
                src = (rank - t) % n
                for _, position, length in key_chunks(variant, src, n, rows):
                    for first, count, diagonal in _segments(start, size, position, length, causal):
                        flags.append(diagonal)
                        kv += [repeat_heads(x.narrow(SEQ, position + first, count), heads) for x in (k, v)]
            outs.append(BlockAttention.apply(q.narrow(SEQ, start, size), scale, tuple(flags), *kv))
        else:
            keys, values = (repeat_heads(x, heads) for x in (k, v))
            outs.append(_attend(q.narrow(SEQ, start, size), keys, values, start, causal, scale))
    return torch.cat(outs, dim=SEQ)


class ContextParallelAttention(nn.Module):
    """This rank's part of one attention node whose sequence is split over mesh axis `axis`."""

    def __init__(self, variant: str, causal: bool, axis: int, comm: MeshComm) -> None:
        super().__init__()
        self.variant, self.causal, self.axis, self.comm = variant, causal, axis, comm

    def forward(self, *args, **kwargs):
        a = sdpa_arguments(*args, **kwargs)
        if a["attn_mask"] is not None or a["dropout_p"] != 0.0:
            raise AssertionError("context-parallel attention was planned for an op with a mask tensor or dropout")
        q, k, v, scale, gqa = a["q"], a["k"], a["v"], a["scale"], a["enable_gqa"]
        if self.variant not in ULYSSES:  # before any collective, so every rank stops at the same point
            check_device(q.device, kernel_name(self.variant, self.causal),
                         ". Plan with force_context_parallel('ulysses') there, or without a cp axis")
        if self.variant in ULYSSES:
            to_heads, ordered = CommStep("all_to_all", self.axis, SEQ, 1), self.variant in TOKEN_ORDER
            q, k, v = (_step(t, to_heads, self.comm, ordered) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=scale, enable_gqa=gqa)
            return _step(out, to_heads.dual(), self.comm, ordered)
        me, rows = self.comm.coord[self.axis], q.shape[SEQ]
        n = self.comm.mesh.shape[self.axis]
        if self.variant == "torch_ring":
            return torch_ring_attention(q, k, v, scale, self.axis, self.comm)
        if self.variant == "ring":
            return ring_attention(q, k, v, scale, self.causal, self.axis, self.comm, (me * rows,))
        if self.variant == "ring_headtail":  # the rank's two chunks as it holds them, the blocks too
            starts = tuple(c * (rows // 2) for c in query_chunks(self.variant, me, n))
            return ring_attention(q, k, v, scale, True, self.axis, self.comm, starts, self.variant)
        if self.variant == "ring_balanced":
            return _balanced(q, self.comm, self.axis, lambda own, lent, starts: ring_attention(
                torch.cat([own, lent], dim=SEQ), k, v, scale, True, self.axis, self.comm, starts).chunk(2, dim=SEQ))
        # K and V gathered together (one collective, as the ring passes them packed), in sequence order; its backward one
        # reduce-scatter
        keys, values = _step(torch.stack([k, v]), CommStep("all_gather", self.axis, SEQ + 1), self.comm,
                             self.variant == "headtail").unbind(0)
        if gqa and keys.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group of query heads
            keys, values = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (keys, values))
        if self.variant == "allgather":
            return _attend(q, keys, values, me * rows, self.causal, scale)
        if self.variant == "headtail":
            half = rows // 2
            return torch.cat([_attend(q.narrow(SEQ, i * half, half), keys, values, c * half, True, scale)
                              for i, c in enumerate(query_chunks(self.variant, me, n))], dim=SEQ)
        return _balanced(q, self.comm, self.axis, lambda own, lent, starts: (
            _attend(own, keys, values, starts[0], True, scale), _attend(lent, keys, values, starts[1], True, scale)))

    def extra_repr(self) -> str:
        return f"{kernel_name(self.variant, self.causal)} over mesh axis {self.comm.mesh.axis_names[self.axis]}"


# ---------------------------------------------------------------- the region op

def _blocks_key(node, in_metas, strategy, mesh_shape) -> tuple[str, list[TensorMeta]]:
    """The profile key of a kernel's busiest-rank blocks (`ContextParallel.timed_work`), and q, k, v's local metas."""
    local = [TensorMeta(local_shape(m.shape, p, mesh_shape), m.dtype) for m, p in zip(in_metas[:3], strategy.inputs)]
    out = TensorMeta(local_shape(node.outputs[0].shape, strategy.outputs[0], mesh_shape), node.outputs[0].dtype)
    return op_key(f"{node.target}[{strategy.kernel} of {mesh_shape[cp_axis(strategy)]}]", local, [out]), local


def _local_bytes(meta: TensorMeta, layout, mesh_shape) -> int:
    return meta.itemsize * math.prod(local_shape(meta.shape, layout, mesh_shape))


def _gathered_working_bytes(balanced: bool, causal: bool, n: int, batch: int, heads: int, repeat: int, rows: int, dim: int,
                            kb: int, itemsize: int, cpu: bool, *, backward: bool) -> int:
    """What the all-gather kernels hold on their busiest rank beyond the output (forward) or the input gradients
    (backward) and what they keep (`kept_bytes`), read off `ContextParallelAttention` and the allocator's events:
    the largest of the kernel's phases. `kb`: the local k bytes; `repeat`: query heads per KV head.

    Forward: the gather (the stacked local K and V, the collective's buffer, and its copy into sequence order, as the
    gather is not on dim 0); grouped-query heads repeated (the gathered and the repeated K/V together); the blocks on
    the kept K/V as the ring's (each block's output and log-sum-exp until they merge and the merge's fp32 terms, or a
    block's kernel scratch), the balanced kernel's on half-length chunks beside the borrowed queries and its own
    chunk's output and log-sum-exp, and at its end both outputs, the one swapped back, and the joined output.
    Backward: every key's gradients on the busiest rank, the fp32 query gradient and two blocks' query gradients, with
    the kernel's scratch (the balanced kernel's own chunk runs after the borrowed chunk's gradients are summed to
    full-length K/V gradients); then, once the kept K/V are freed, the gradients stacked and copied into the
    reduce-scatter's order beside its output. Measured: tests/test_attention_memory.py."""
    qb, q32, lse = batch * heads * rows * dim * itemsize, batch * heads * rows * dim * 4, batch * heads * rows * 4
    gathered = 2 * n * kb  # every rank's K and V
    kept = gathered * repeat  # as many heads as the queries
    keys, half = n * rows, qb // 2

    def scratch(chunk: int, grad: bool) -> int:
        return flash_cpu_bytes(batch, heads, chunk, keys, dim, backward=grad) if cpu else 0

    if not backward:
        def blocks(count: int, chunk: int) -> int:  # one query chunk's blocks until they merge (as the ring's)
            qc, q32c, lsec = qb * chunk // rows, q32 * chunk // rows, lse * chunk // rows
            return max(count * (qc + lsec) + 3 * q32c + lsec, (count - 1) * (qc + lsec) + qc + lsec + scratch(chunk, False))

        gather = 2 * kb + 2 * gathered
        widen = gathered + kept if repeat > 1 else 0
        if balanced:
            attend = kept + half + max(half + lse // 2 + blocks(2, rows // 2), 3 * qb)
        else:
            attend = kept + blocks(2 if causal and n > 1 else 1, rows)
        return max(0, max(gather, widen, attend) - qb - (kept - 2 * kb) - (half if balanced else 0))
    if balanced:  # the last rank's own chunk (2n-2 of 2n) attends 2n-1 chunks of keys
        blocks = kept + kept * (2 * n - 1) // (2 * n) + q32 // 2 + qb + half + scratch(rows // 2, True)
    else:
        blocks = kept + q32 + 2 * qb + scratch(rows, True)
    home = qb + max(2 * kept, kept + gathered, 2 * gathered + 2 * kb) - kept
    return max(0, max(blocks, home) - qb - 2 * kb)


class ContextParallel(RegionOp):
    name = "context_parallel_attention"
    ops = (SDPA,)

    def __init__(self) -> None:
        self.variants: tuple[str, ...] = SEARCHED
        """The kernels offered."""
        self.forced = False
        """On a mesh with a `cp` axis, attention runs as one of `variants` (set by `force_context_parallel`)."""

    def rule(self, args, kwargs) -> list[Row]:
        rows = sdpa_rule(args, kwargs)
        a = sdpa_arguments(*args, **kwargs)
        causal = bool(a["is_causal"])
        tail = [] if a["attn_mask"] is None else [Replicate()]  # a mask makes the row refused, with its reason (why_not)
        for variant in VARIANTS:
            rows.append(KernelRow([Shard(SEQ)] * 4 + tail, kernel_name(variant, causal)))
        return rows

    def why_not(self, strategy, args, kwargs, mesh) -> str | None:
        if not strategy.kernel:
            if self.forced and CP_AXIS in mesh.axis_names:
                return f"force_context_parallel({', '.join(map(repr, self.variants))}): attention runs as one of these kernels"
            return None
        axes = [a for a, p in enumerate(strategy.inputs[0]) if p == Shard(SEQ)]
        if [mesh.axis_names[a] for a in axes] != [CP_AXIS]:
            return ""  # sequence-split attention is a `cp` axis' layout: on other axes not a candidate at all
        axis = axes[0]
        a = sdpa_arguments(*args, **kwargs)
        variant, causal = parse_kernel(strategy.kernel)
        n = mesh.shape[axis]
        what = f"context-parallel attention ({variant}) over mesh axis {CP_AXIS}={n}"
        if variant not in self.variants:
            if not self.forced:
                return ""  # offered only when asked for (`SEARCHED`): not a candidate, as the sequence split on other axes
            return f"{what}: planned with force_context_parallel({', '.join(map(repr, self.variants))})"
        if a["attn_mask"] is not None:
            return f"{what}: the op has an explicit attn_mask tensor, which only is_causal=True or no mask can be split by"
        if a["dropout_p"]:
            return f"{what}: dropout_p={a['dropout_p']} inside attention is not supported (its mask would differ per split)"
        seq = a["q"].shape[SEQ]
        if variant in EVEN and not causal:
            return f"{what}: load balancing is for causal masks; without one every rank already does the same work"
        if variant in EVEN + TOKEN_ORDER and seq % (2 * n):
            return f"{what}: sequence length {seq} does not split into 2 x {n} = {2 * n} equal chunks"
        if variant in ULYSSES:
            parts = n * (2 if variant in TOKEN_ORDER else 1)  # in token order the heads are cut as the sequence is
            heads = {"query heads": a["q"].shape[1], "key/value heads": a["k"].shape[1]}
            for label, count in heads.items():
                local = count // math.prod(mesh.shape[b] for b, p in enumerate(strategy.inputs[0]) if p == Shard(1))
                if local % parts:
                    return f"{what}: {local} {label} per device do not divide by {parts} (all-to-all from sequence to heads)"
        return None

    def token_order(self, strategy) -> bool:
        return bool(strategy.kernel) and parse_kernel(strategy.kernel)[0] in TOKEN_ORDER

    def cost(self, node, in_metas, strategy, mesh_shape, cluster, *, backward: bool) -> RegionCost | None:
        if not strategy.kernel:  # the plain op, causal: priced at the pairs its mask keeps (non-causal: as any op)
            return RegionCost(compute_s=compute_time(node.target, in_metas, node.outputs, strategy.outputs, mesh_shape, cluster,
                                                     backward=backward, in_layouts=strategy.inputs, causal=True)) if is_causal(node) else None
        variant, causal = parse_kernel(strategy.kernel)
        axis = cp_axis(strategy)
        n = mesh_shape[axis]
        q, k, v = in_metas[:3]
        qb, kb, vb = (_local_bytes(m, p, mesh_shape) for m, p in zip((q, k, v), strategy.inputs))
        ob = _local_bytes(node.outputs[0], strategy.outputs[0], mesh_shape)
        local = [list(local_shape(m.shape, p, mesh_shape)) for m, p in zip((q, k, v), strategy.inputs)]
        if variant in ULYSSES:
            steps = [CommStep("all_to_all", axis, SEQ, 1, nbytes=b) for b in (qb, kb, vb)]
            forward = steps + [CommStep("all_to_all", axis, 1, SEQ, nbytes=ob)]
            for shape in local:  # whole sequence, heads / n
                shape[1], shape[SEQ] = shape[1] // n, shape[SEQ] * n
        elif variant in RINGS:
            # n-1 exchanges of the packed K, V; backward n-1 of K, V and n of dK, dV (the last one home; torch's in fp32)
            forward = [CommStep("send_recv", axis, nbytes=kb + vb)] * (n - 1)
            sums = (kb + vb) * 4 // k.itemsize if variant == "torch_ring" else kb + vb
            back_steps = [CommStep("send_recv", axis, nbytes=kb + vb)] * (n - 1) + [CommStep("send_recv", axis, nbytes=sums)] * n
            for shape in local[1:]:
                shape[SEQ] *= n
        else:
            forward = [CommStep("all_gather", axis, SEQ + 1, nbytes=(kb + vb) * n)]  # K and V stacked
            for shape in local[1:]:  # the gathered keys and values
                shape[SEQ] *= n
        # balanced: half the queries to the mirrored rank, their output back (and the same in backward)
        swaps = [CommStep("send_recv", axis, nbytes=qb // 2), CommStep("send_recv", axis, nbytes=ob // 2)] if variant in BALANCED else []
        ring_steps = len(forward) if variant in RINGS else 0
        forward += swaps
        metas = [TensorMeta(tuple(s), m.dtype) for s, m in zip(local, (q, k, v))]
        out = TensorMeta(tuple(local[0][:3]) + (local[2][3],), node.outputs[0].dtype)
        whole = ((Replicate(),) * len(mesh_shape),)
        rows = local[0][SEQ]
        # Ulysses runs the plain op (its local shapes are the heads-split op's, which a profile times with its mask);
        # the others run blocks, which a profile times as the busiest rank runs them (`timed_work`); without that
        # timing, the roofline of the L x S rectangle, scaled to the pairs the busiest rank's blocks compute
        plain = variant in ULYSSES
        work = causal_pairs(variant, n, rows) / (rows * rows * n) if causal and not plain else 1.0
        shared = 1.0
        if work < 1.0 and variant not in EVEN and cluster.profile is not None:
            # split contiguously, rank r computes r whole blocks and a diagonal. Ranks that share cores (a CPU with
            # more ranks than cores: contention > 1) hand the busiest rank the time the others wait; one rank per
            # core or GPU (contention 1) computes its own work alone
            slowdown = cluster.profile.slowdown(math.prod(mesh_shape))
            per_rank = [(r * rows * rows + attention_pairs(rows, rows, True)) / (rows * rows * n) for r in range(n)]
            shared = shared_cores_seconds([w / slowdown for w in per_rank], n / slowdown) / work

        prof = cluster.profile
        timed = prof.ops.get(_blocks_key(node, in_metas, strategy, mesh_shape)[0]) if prof is not None and not plain else None

        def priced(grad: bool) -> float:
            if timed is not None:  # the busiest rank's blocks as profiled (`timed_work`), contended as any op
                runs = 2 if grad else 1
                return shared * profiled_seconds(prof, measured_seconds(timed, grad), runs) * prof.slowdown(math.prod(mesh_shape))
            return shared * work * compute_time(node.target, metas, [out], whole, mesh_shape, cluster, backward=grad,
                                                in_layouts=whole * 3 if plain else None, causal=causal and plain)

        compute = priced(backward)
        back = (back_steps + swaps if variant in RINGS else [s.dual() for s in forward]) if backward else []
        forward_comm = steps_time(forward[ring_steps:], mesh_shape, cluster)
        if not ring_steps:  # nothing overlaps: every collective adds to compute
            return RegionCost(compute_s=compute, forward=tuple(forward), backward=tuple(back),
                              comm_s=forward_comm + steps_time(back, mesh_shape, cluster))
        # each exchange hides behind one of the n blocks the busiest rank computes
        per_exchange = steps_time(forward[:1], mesh_shape, cluster)
        forward_s = priced(False)
        forward_comm += ring_steps * max(0.0, per_exchange - forward_s / n)
        backward_comm = 0.0
        if backward:  # behind block 0 the next K, V; behind the last the previous sum; behind the others both
            block_s = (compute - forward_s) / n  # one block's backward on the busiest rank
            per_sum = steps_time(back_steps[-1:], mesh_shape, cluster)
            hidden = (max(0.0, per_exchange - block_s) + max(0.0, per_sum - block_s)
                      + (n - 2) * max(0.0, per_exchange + per_sum - block_s))
            backward_comm = steps_time(swaps, mesh_shape, cluster) + hidden + per_sum  # the last sum's trip home
        return RegionCost(compute_s=compute, forward=tuple(forward), backward=tuple(back),
                          comm_s=forward_comm + backward_comm)

    def flops(self, node, in_metas) -> float | None:
        """Causal attention's model FLOPs (MFU's numerator) are the pairs its mask keeps, as its compute is priced: the
        whole rectangle would count the masked half as work done (MFU up to twice the truth at long sequences)."""
        return op_flops(node.target, list(in_metas), list(node.outputs), causal=True) if is_causal(node) else None

    def timed_work(self, node, in_metas, strategy, mesh_shape):
        """The busiest rank's blocks of a kernel that runs blocks (not Ulysses, which runs the plain op on local
        shapes a profile times anyway), as that rank runs them (`rank_attention`), keyed by the kernel, the degree
        and the local shapes."""
        if not strategy.kernel:
            return None
        variant, causal = parse_kernel(strategy.kernel)
        if variant in ULYSSES:
            return None
        n = mesh_shape[cp_axis(strategy)]
        key, local = _blocks_key(node, in_metas, strategy, mesh_shape)

        def make(device: torch.device):
            whole = [torch.randn(*m.shape[:SEQ], m.shape[SEQ] * n, *m.shape[SEQ + 1:], dtype=m.torch_dtype, device=device,
                                 requires_grad=True) for m in local]
            return (lambda: rank_attention(variant, *whole, busiest_rank(variant, n, causal), n, causal)), whole

        return key, make

    def kept_bytes(self, node, in_metas, strategy, mesh_shape) -> int:
        """The all-gather kernels (and the token-order one) keep the gathered keys and values (as many heads as the
        queries: grouped-query heads are repeated first) where the plain op keeps the local ones; the balanced one also
        keeps the half of the queries it borrowed (its two chunks' outputs, kept in place of its output, weigh the
        same), the token-order one its two chunks' outputs beside the output they are joined to. The rings keep what
        the plain op does (the balanced ring its own and the borrowed queries, in one tensor, in place of q)."""
        if not strategy.kernel:
            return 0
        variant, _ = parse_kernel(strategy.kernel)
        if variant not in ("allgather", "balanced", "headtail"):
            return 0
        n = mesh_shape[cp_axis(strategy)]
        q, k, v = in_metas[:3]
        qb, kb, vb = (_local_bytes(m, p, mesh_shape) for m, p in zip((q, k, v), strategy.inputs))
        repeat = q.shape[1] // k.shape[1]
        kept = (kb + vb) * (n * repeat - 1)
        if variant == "balanced":
            kept += qb // 2
        if variant == "headtail":  # its two chunks' outputs, each kept by its blocks, beside the output they are joined to
            kept += qb
        return kept

    def working_bytes(self, node, in_metas, strategy, mesh_shape, cluster, *, backward: bool) -> int:
        """What the rings and Ulysses hold while they run, on the busiest rank (every key block attended), beyond the output
        (forward) or the input gradients (backward), read off `RingAttention`: in forward the K/V block held and the
        one arriving, one output and fp32 log-sum-exp per key block until they merge, the merge's fp32 terms and
        running sum; in backward the query gradient in fp32, five K/V-block buffers (held, arriving, this
        rank's share, the sum arriving, the sum sent: four on two ranks), the last block's and this block's three
        gradients, and on a CPU the flash kernel's scratch (`flash_cpu_bytes`); grouped-query heads repeated per
        block. The balanced ring adds its borrowed queries' copy and runs the blocks on half-length chunks. Ulysses
        holds its q, k, v and output made again by the all-to-alls while the plain op runs on the whole sequence,
        with that op's scratch (or an all-to-all's three copies), and in backward the output gradient made again.
        The all-gather kernels: `_gathered_working_bytes`.
        Measured with a fake process group (every buffer freed where the profiler sees it;
        tests/test_attention_memory.py): the ring exactly, the balanced ring 0-17 % above, Ulysses exactly forward and
        at most one query-sized buffer above backward."""
        if not strategy.kernel:
            return 0
        variant, causal = parse_kernel(strategy.kernel)
        n = mesh_shape[cp_axis(strategy)]
        q, k = (TensorMeta(local_shape(m.shape, p, mesh_shape), m.dtype) for m, p in zip(in_metas[:2], strategy.inputs[:2]))
        *lead, rows, dim = q.shape
        batch = math.prod(lead[:-1]) if len(lead) > 1 else 1
        heads = lead[-1]
        qb, q32, lse = q.nbytes, math.prod(q.shape) * 4, batch * heads * rows * 4
        cpu = on_cpu(cluster)
        if variant not in RINGS + ULYSSES:
            # the token-order kernel runs two half-length chunks as the balanced one does, without a borrowed copy: its
            # forward holds what the contiguous kernel's does, its backward what the balanced kernel's does
            two_chunks = variant == "balanced" or (backward and variant == "headtail")
            held = _gathered_working_bytes(two_chunks, causal, n, batch, heads, heads // k.shape[-3], rows, dim,
                                           k.nbytes, q.itemsize, cpu, backward=backward)
            # the token-order kernel's chunk outputs are among what it keeps (`kept_bytes`), not on top of it
            return max(0, held - qb) if variant == "headtail" and not backward else held
        if variant in ULYSSES:  # the plain op on the whole sequence and 1/n of the heads, between all-to-alls
            whole = dict(batch=batch, heads=heads // n, rows=rows * n, keys=rows * n, head_dim=dim)
            if not backward:  # its q, k, v and output made again (as big as the local ones), the op's scratch or an all-to-all's
                scratch = flash_cpu_bytes(**whole, backward=False) if cpu else 0
                return qb + 2 * k.nbytes + lse + max(scratch, 3 * qb)
            # the output gradient made again, with the op's scratch; or an all-to-all's three copies of a gradient
            return max(qb + (flash_cpu_bytes(**whole, backward=True) if cpu else 0), 3 * qb)
        block = 2 * k.nbytes  # one K/V block, as it travels
        repeated = 2 * qb if k.shape[-3] != heads else 0  # grouped-query K and V repeated to the query heads, per block
        if variant == "torch_ring":
            # torch's templates (`TorchRingAttention`), fitted to what they allocate on 2, 4 and 8 ranks, fake and gloo,
            # in fp32 and bf16 (tests/test_attention_memory.py): forward the merged output's fp32 copy and the merge's
            # terms, the block held, the one sent (a new tensor each step: under gloo one more is read, freed on gloo's
            # thread) and the one arriving (on two ranks one exchange: two blocks); backward the CPU flash kernel's
            # scratch, the fp32 accumulators of the query and K/V gradients, the dK/dV sums sent and arriving in fp32,
            # the blocks passed round again and the op's gradients. Grouped-query heads are repeated per block, and in
            # bf16 the kernel's copies of them and of their gradients measured as much as fp32 ones
            gqa = k.shape[-3] != heads
            if not backward:
                return 3 * q32 + (4 if n > 2 else 2) * block + (2 * q32 if gqa else 0) + 5 * lse
            scratch = flash_cpu_bytes(batch, heads, rows, rows, dim, backward=True) if cpu else 0
            block32 = 2 * math.prod(k.shape) * 4
            held = scratch + 3 * q32 + 4 * qb + 4 * block32 + (2 if n > 2 else 1) * block + (2 * q32 if gqa else 0) + 4 * lse
            return held - qb - block
        # the token-order ring is walked as the contiguous one: its half-length chunks hold less in the kernel alone
        # (tests/test_attention_memory.py), but not less in a whole step (benchmarks/long_context.py, 4,096 tokens)
        chunk = rows // 2 if variant == "ring_balanced" else rows
        borrowed = qb if variant == "ring_balanced" else 0
        if not backward:
            scratch = flash_cpu_bytes(batch, heads, chunk, chunk, dim, backward=False) if cpu else 0
            held = max(block + n * (qb + lse) + 3 * q32 + lse, 2 * block + n * (qb + lse) + scratch)
            return held + repeated + borrowed - qb
        scratch = flash_cpu_bytes(batch, heads, chunk, chunk, dim, backward=True) if cpu else 0
        held = q32 + (5 if n > 2 else 4) * block + 6 * qb + repeated + scratch + borrowed
        return held - qb - block

    def local_module(self, strategy, comm: MeshComm, args) -> ContextParallelAttention | None:
        if not strategy.kernel:
            return None
        variant, causal = parse_kernel(strategy.kernel)
        return ContextParallelAttention(variant, causal, cp_axis(strategy), comm)


CONTEXT_PARALLEL_REGION = ContextParallel()


@contextlib.contextmanager
def force_context_parallel(*variants: str, region: ContextParallel = CONTEXT_PARALLEL_REGION) -> Iterator[None]:
    """Plans made inside the block run every attention op on a mesh with a `cp` axis as one of these kernels (of
    `VARIANTS`; others and the plain op's layouts are ruled out, and `explain` says so), e.g.
    `with force_context_parallel("ulysses"): meshplan.plan(..., axis_names=("cp",))`. Process-wide state while
    the block runs: plan in one thread at a time."""
    unknown = [v for v in variants if v not in VARIANTS]
    if not variants or unknown:
        raise ValueError(f"force_context_parallel takes one or more of {', '.join(VARIANTS)}; got {variants!r}")
    before = region.variants, region.forced
    region.variants, region.forced = tuple(variants), True
    clear_strategy_cache()  # the offered strategies are cached per op and mesh
    try:
        yield
    finally:
        region.variants, region.forced = before
        clear_strategy_cache()
