"""What an attention kernel allocates while it runs, beyond its inputs, outputs and gradients.

On a CPU, attention without a mask tensor runs ATen's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`),
which works through the queries in blocks of `q_split` rows against blocks of up to 512 keys, with buffers per
intra-op thread: in forward the block's scores and its running maxima and sums; in backward the scores and their
gradients, and the query gradient accumulated in fp32. Measured with the profiler's allocator events for fp32 on
this machine (2026-11-26: 1 and 2 threads, 100 to 4,096 rows, 16 and 64 per head, causal or not): every case within
1 KiB of `flash_cpu_bytes`. The peak walk (`cost_model/peak.py`) adds it while the op runs; a plan's runtime gives
each rank one intra-op thread (`runtime/launch.py`). On a GPU the kernels' workspaces are not modeled (0).
"""

from __future__ import annotations

from meshplan.cost_model.presets import CPU_RANK, ClusterPreset

KV_SPLIT = 512
"""Keys per block of the CPU flash kernel."""


def q_split(rows: int) -> int:
    """Query rows per block of the CPU flash kernel: 256 from 768 rows, 64 from 192, else 32 (at most `rows`)."""
    return min(rows, 256 if rows >= 768 else 64 if rows >= 192 else 32)


def flash_cpu_bytes(batch: int, heads: int, rows: int, keys: int, head_dim: int, *, backward: bool, threads: int = 1) -> int:
    """Bytes the CPU flash kernel holds while it runs, for `rows` queries against `keys` keys per head: per thread a
    block of fp32 scores with its row maxima and sums (forward), or of scores and their gradients (backward, which
    also accumulates the query gradient in fp32)."""
    block_rows, block_keys = q_split(rows), min(KV_SPLIT, keys)
    if not backward:
        return threads * block_rows * (block_keys + head_dim + 2) * 4
    return threads * 2 * block_rows * block_keys * 4 + batch * heads * rows * head_dim * 4


def on_cpu(cluster: ClusterPreset) -> bool:
    """The cluster's devices are CPU ranks, whose attention runs the CPU flash kernel."""
    return cluster.device.name == CPU_RANK.name
