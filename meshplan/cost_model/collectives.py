"""Time of one collective in the alpha-beta ring model.

Ring algorithms are what NCCL and gloo use for large messages, and their cost has a simple closed
form: each of the n ranks sends (n-1)/n of the data per pass, in n-1 hops of latency alpha. The
model ignores tree algorithms (they win only for tiny messages, where alpha dominates anyway) and
link contention between concurrent collectives.

`nbytes` is always the size of the FULL tensor the collective is about, so that callers pass the
global size and never work out per-rank chunks themselves:

- all_reduce: the buffer being reduced (same on every rank);
- all_gather: the gathered OUTPUT (each rank contributes nbytes / n);
- reduce_scatter: the INPUT being reduced (each rank ends with nbytes / n);
- all_to_all: one rank's buffer (it keeps 1/n and sends the rest);
- send_recv: the message.
"""

from __future__ import annotations

from .presets import LinkPreset

COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Kinds that move data between devices."""
LOCAL_KINDS: tuple[str, ...] = ("chunk", "pad", "scale")
"""Kinds a redistribution may list that stay on the device (take a shard, pad it, divide for avg):
free at this model's resolution, since they are small next to the ops around them."""


def collective_time(kind: str, nbytes: int, group_size: int, link: LinkPreset) -> float:
    """Seconds for one `kind` collective over `group_size` ranks joined by `link`.

    all_reduce = reduce_scatter + all_gather, hence twice their bandwidth and latency terms (but
    one call overhead).
    all_to_all is costed like a ring exchange ((n-1) steps each moving 1/n of the buffer), which is
    also what pairwise exchange costs when one rank can send only one message at a time.
    """
    if kind not in COLLECTIVE_KINDS and kind not in LOCAL_KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; allowed: {', '.join(COLLECTIVE_KINDS + LOCAL_KINDS)}"
        )
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int; got {group_size!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0; got {nbytes!r}")
    # A group of one, an empty tensor or a local step moves nothing between devices.
    if kind in LOCAL_KINDS or group_size == 1 or nbytes == 0:
        return 0.0
    n = group_size
    alpha, bw, call = link.latency_s, link.bandwidth, link.call_overhead_s
    if kind == "all_reduce":
        return call + 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return call + (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if kind != "send_recv":
        raise AssertionError(f"collective kind {kind!r} has no cost formula")
    return call + nbytes / bw + alpha
