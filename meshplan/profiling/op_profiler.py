"""Time ATen ops on the shapes one device really runs: forward and backward, warm-up, medians.

`time_op` runs one traced op (its fx node gives the callable and the non-tensor arguments) on fresh
tensors of the given local shapes, the way the per-rank program runs it: shape arguments are
localised as the runtime's rewrite does, views run as reshapes. On CUDA the time comes from CUDA
events (kernels are asynchronous, so wall-clock time would measure the launch); on CPU from
`time.perf_counter`. The backward of one op is timed with `torch.autograd.grad` on a fresh forward,
so it includes autograd's per-node work, as a real backward pass does.

On CUDA an op's timing (and a region kernel's, `time_function`) is its kernels alone (`hide_launch`, the default: a
spin kernel keeps the GPU busy while the host issues the op, `Timer`), and the host's seconds issuing them are kept beside it (`OpTiming.host_forward_s`).
What a step's host spends is measured in the whole program (`calibrate.program_overhead`), not
summed from isolated ops: on an H200 (2026-11-26, benchmarks/results/README.md run 12) the isolated host timings of
a GPT's ops summed to 66 ms for a step measured at 24 ms, hot in a step and cold after each synchronisation. The
earlier method, one synchronised run per sample with autograd's start-up (`grad_call_overhead`) subtracted from
each backward, put the launch and synchronisation latency into every op and its backward's price hung on that
subtraction: the same GPT's step priced -19 % to +91 % on machines of one kind (runs 3-11).

With `queued=n` each sample times n runs queued back to back (their backwards in one autograd call): the larger of
an op's kernel and its dispatch, hot. It predicted no better (runs 7-12: +13 % to +76 %); benchmarks/gpu_check.py
prices with it for comparison.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Shard

from meshplan.cost_model.profile import OpTiming
from meshplan.ir.graph import TensorMeta

SHAPE_ARG = dict(DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx)
"""Ops whose argument at this index is their output's (global) shape; the runtime localises it too."""
_RUNTIME_TARGET = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                   torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}
"""What the per-rank program calls instead (ir/trace.py STRIDE_SAFE: views may meet non-contiguous shards)."""


class Timer:
    """Seconds of `fn()` on `device`: CUDA events on a GPU, perf_counter elsewhere.

    `hide_launch` (CUDA): the GPU is first kept busy by a spin kernel long enough for the host to queue all of
    `fn`'s kernels, so the events time the kernels alone (the device's track), and `host_s` keeps the seconds
    the host spent issuing them (the host's track). Without it the events also hold the launch latency."""

    def __init__(self, device: torch.device, *, hide_launch: bool = False) -> None:
        self.device = device
        self.hide_launch = hide_launch and device.type == "cuda"
        self.host_s = 0.0
        """Host seconds of the last call (on a CPU, the call itself)."""

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.hide_launch:  # the spin must outlast the issuing: twice the last call's at the fastest clock
                torch.cuda._sleep(min(max(SPIN_CYCLES, int(4 * self.host_s * SPIN_HZ_FLOOR)), SPIN_CYCLES_MAX))
            start.record()
            t0 = time.perf_counter()
            fn()
            self.host_s = time.perf_counter() - t0
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        self.host_s = time.perf_counter() - t0
        return self.host_s


SPIN_CYCLES = 2_000_000
"""GPU clock cycles the launch-hiding spin lasts at least (about 1 ms at 2 GHz)."""
SPIN_CYCLES_MAX = 20_000_000
"""... and at most (about 10 ms: a warm-up call can take the host long, and an op that waits for the GPU waits out the spin)."""
SPIN_HZ_FLOOR = 1e9
"""A GPU clock no slower than this converts host seconds to spin cycles (so the spin lasts at least that long)."""


def make_tensor(meta: TensorMeta, device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    """Values that every op accepts: normal floats, zero indices (valid for any gather/embedding), true masks."""
    dt = meta.torch_dtype
    if dt.is_floating_point or dt.is_complex:
        t = torch.randn(meta.shape, dtype=dt, device=device)
        return t.requires_grad_(requires_grad)
    if dt == torch.bool:
        return torch.ones(meta.shape, dtype=dt, device=device)
    return torch.zeros(meta.shape, dtype=dt, device=device)


def _call(node: fx.Node, tensors: Sequence[torch.Tensor], out_shape: tuple[int, ...] | None) -> Callable[[], object]:
    feed = iter(tensors)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda _: next(feed))
    idx = SHAPE_ARG.get(node.target)
    if idx is not None and out_shape is not None:
        args = list(args)
        args[idx[0] if isinstance(idx, tuple) else idx] = list(out_shape)
    target = _RUNTIME_TARGET.get(node.target, node.target)
    return lambda: target(*args, **kwargs)


QUEUED = 8
"""Runs per timing sample when queued back to back (see the module doc)."""


def _float_outputs(out: object) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _samples(timer: Timer, fn: Callable[[], object], warmup: int, min_runs: int, max_runs: int, budget_s: float,
             host: list[float] | None = None) -> list[float]:
    """Seconds of `fn()` per run after `warmup` runs: at least `min_runs`, more (up to `max_runs`) while their sum
    stays under `budget_s`. `host` gets each timed run's host seconds (`Timer.host_s`)."""
    times: list[float] = []
    for i in range(warmup + max_runs):
        t = timer(fn)
        if i >= warmup:
            times.append(t)
            if host is not None:
                host.append(timer.host_s)
            if len(times) >= min_runs and sum(times) > budget_s:
                break
    return times


def time_op(
    node: fx.Node,
    inputs: Sequence[TensorMeta],
    needs_grad: Sequence[bool],
    out_shape: tuple[int, ...] | None,
    *,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    min_runs: int = 5,
    max_runs: int = 25,
    budget_s: float = 0.05,
    grad_call_s: float = 0.0,
    queued: int = 1,
    hide_launch: bool = True,
) -> OpTiming:
    """Median forward (and, when any input in `needs_grad` is set, backward) seconds of `node` on
    tensors shaped `inputs` (local shapes); `out_shape` is the local shape of output 0.

    Runs at least `min_runs` timed repetitions after `warmup`, and more (up to `max_runs`) while the
    total stays under `budget_s`: tiny ops get many samples, big ones few. `grad_call_s` (see
    `grad_call_overhead`) is subtracted from each backward sample: a real backward pass starts
    autograd's engine once per step, not once per op. `queued`: runs per sample, queued back to back (see the
    module doc). `hide_launch` (CUDA): the medians are of the kernels alone, and the host's seconds issuing them are
    kept as well (`OpTiming.host_forward_s`; `Timer`); off, of one synchronised run each (the launch in it).
    """
    if len(inputs) != len(needs_grad):
        raise AssertionError((node, inputs, needs_grad))
    device = torch.device(device)
    timer = Timer(device, hide_launch=hide_launch)
    tensors = [make_tensor(m, device, g) for m, g in zip(inputs, needs_grad)]
    grad_in = [t for t, g in zip(tensors, needs_grad) if g and t.requires_grad]
    run = _call(node, tensors, out_shape)

    def run_queued() -> None:
        for _ in range(queued):
            run()

    host_fwd: list[float] = []
    with torch.set_grad_enabled(bool(grad_in)):
        fwd = [t / queued for t in _samples(timer, run_queued, warmup, min_runs, max_runs, budget_s * queued, host_fwd)]
    host_fwd = [h / queued for h in host_fwd]
    if not grad_in:
        return _timing(timer, fwd, host_fwd)

    # `queued` forwards on inputs of their own (shared ones would add every copy's gradient into one), their
    # backwards in one call (one engine start-up)
    copies = [(run, grad_in)]
    for _ in range(queued - 1):
        mine = [make_tensor(m, device, g) for m, g in zip(inputs, needs_grad)]
        copies.append((_call(node, mine, out_shape), [t for t, g in zip(mine, needs_grad) if g and t.requires_grad]))
    leaves = [t for _, ins in copies for t in ins]
    bwd: list[float] = []
    host_bwd: list[float] = []
    for i in range(warmup + len(fwd)):
        with torch.enable_grad():
            outs = [o for fn, _ in copies for o in _float_outputs(fn())]
        if not outs:  # integer outputs (argmax, comparisons): nothing flows back
            return _timing(timer, fwd, host_fwd, [0.0], [0.0])
        grads = [torch.ones_like(o) for o in outs]
        t = timer(lambda: torch.autograd.grad(outs, leaves, grads, allow_unused=True))
        if i >= warmup:
            b, h = _backward_sample(timer, t, grad_call_s, queued)
            bwd.append(b)
            host_bwd.append(h)
    return _timing(timer, fwd, host_fwd, bwd, host_bwd)


def _backward_sample(timer: Timer, t: float, grad_call_s: float, runs: int) -> tuple[float, float]:
    """(seconds, host seconds) per run of one backward sample of `runs` runs, `t` seconds by `timer`. The engine's
    start-up (`grad_call_s`) is host work: taken off the host's seconds, and off the sample unless the launch was
    hidden (then the sample is the kernels alone, which hold none of it)."""
    return (t if timer.hide_launch else max(t - grad_call_s, 0.0)) / runs, max(timer.host_s - grad_call_s, 0.0) / runs


def _timing(timer: Timer, fwd: list[float], host_fwd: list[float], bwd: list[float] | None = None,
            host_bwd: list[float] | None = None) -> OpTiming:
    """The medians of the samples; the host's only when `timer` hid the launch (otherwise they are the samples)."""
    tracks = {}
    if timer.hide_launch:
        tracks = {"host_forward_s": statistics.median(host_fwd),
                  "host_backward_s": statistics.median(host_bwd) if host_bwd else None}
    return OpTiming(forward_s=statistics.median(fwd), backward_s=statistics.median(bwd) if bwd else None, runs=len(fwd),
                    **tracks)


def time_function(run: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor], *, device: torch.device | str = "cpu",
                  warmup: int = 2, min_runs: int = 5, max_runs: int = 25, budget_s: float = 0.05, grad_call_s: float = 0.0,
                  hide_launch: bool = True) -> OpTiming:
    """Median forward and backward seconds of `run()`, a computation of several ops (a region op's kernel,
    `RegionOp.timed_work`) whose backward reaches `leaves`, sampled as `time_op` samples one op."""
    timer = Timer(torch.device(device), hide_launch=hide_launch)
    host_fwd: list[float] = []
    with torch.enable_grad():
        fwd = _samples(timer, run, warmup, min_runs, max_runs, budget_s, host_fwd)
    bwd: list[float] = []
    host_bwd: list[float] = []
    for i in range(warmup + len(fwd)):
        with torch.enable_grad():
            out = run()
        grad = torch.ones_like(out)
        t = timer(lambda: torch.autograd.grad(out, list(leaves), grad, allow_unused=True))
        if i >= warmup:
            b, h = _backward_sample(timer, t, grad_call_s, 1)
            bwd.append(b)
            host_bwd.append(h)
    return _timing(timer, fwd, host_fwd, bwd, host_bwd)


def time_program(gm: torch.nn.Module, args: Sequence[object], *, warmup: int = 3, runs: int = 15) -> tuple[float, float]:
    """(median seconds, median host seconds) of one forward + backward of a whole program (`gm(*args)`, gradients of
    ones into every floating output that needs them), as a training step runs it. On a CPU the two are one; on a GPU
    the host's are those it spent issuing the program (`Timer.host_s`)."""
    timer = Timer(next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu")))

    def step() -> None:
        outs = _float_outputs(gm(*args))
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    times, host = [], []
    for _ in range(warmup + runs):
        times.append(timer(step))
        host.append(timer.host_s)
    return statistics.median(times[warmup:]), statistics.median(host[warmup:])


def copy_rate(device: torch.device | str = "cpu", nbytes: int = 4 * 2**20, runs: int = 15) -> float:
    """Seconds per byte written by a plain copy (the runtime's chunk().contiguous(), cat, stack)."""
    device = torch.device(device)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device)
    times = [timer(lambda: dst.copy_(src)) for _ in range(runs + 2)][2:]
    return statistics.median(times) / nbytes


def op_overhead(device: torch.device | str = "cpu", runs: int = 50) -> float:
    """Forward seconds of an op on 8 elements: the dispatch cost every op pays however small."""
    device = torch.device(device)
    a, b = torch.randn(8, device=device), torch.randn(8, device=device)
    timer = Timer(device)
    times = [timer(lambda: torch.add(a, b)) for _ in range(runs + 5)][5:]
    return statistics.median(times)


def grad_call_overhead(device: torch.device | str = "cpu", runs: int = 30, long: int = 33) -> float:
    """The fixed cost of one `torch.autograd.grad` call (engine start-up), apart from its nodes:
    the intercept of backward time over chains of 1 and `long` tiny multiplications."""
    device = torch.device(device)
    timer = Timer(device)

    def median_backward(length: int) -> float:
        times = []
        for _ in range(runs + 3):
            x = torch.randn(8, device=device, requires_grad=True)
            y = x
            for _ in range(length):
                y = y * 1.0
            times.append(timer(lambda: torch.autograd.grad(y, x, torch.ones_like(y))))
        return statistics.median(times[3:])

    short_t, long_t = median_backward(1), median_backward(long)
    per_node = max(long_t - short_t, 0.0) / (long - 1)
    return max(short_t - per_node, 0.0)


OPTIMIZERS = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3), "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3), "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)}
"""torch optimizers `optimizer_rate` can time, by the names the memory model uses, with torch's defaults."""


def optimizer_rate(name: str = "adam", device: torch.device | str = "cpu", numels: Sequence[int] = (), runs: int = 9) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per element) of `optimizer.step()` with torch's
    default implementation for the device. The per-tensor cost comes from 32 tiny tensors, the
    per-element cost from tensors of the sizes given (a model's parameters: `numels`) and of a
    quarter of them (sharded); 8 x 64 Ki elements without them. Each configuration keeps the median
    of `runs` steps, each started with the caches evicted (`CacheEvictor`): in a training step the
    optimizer's state comes from memory, after backward has filled the caches with activations and
    gradients. Timed hot in a loop (the fastest run, until 2026-11-27), Adam priced the fidelity
    GPTs' in-step steps 19-38 % low (docs/cost_model.md, "The optimizer step, cold")."""
    _check_optimizer(name)
    device = torch.device(device)
    timer, evict = Timer(device), CacheEvictor(device)

    def step_time(shapes: Sequence[int]) -> float:
        params = [torch.nn.Parameter(torch.randn(max(int(n), 1), device=device)) for n in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        return statistics.median(_timed_steps(name, params, timer, runs, before=evict))

    per_tensor = step_time([16] * 32) / 32
    sizes = [list(numels)] if numels else [[2**16] * 8]
    sizes.append([max(n // 4, 1) for n in sizes[0]])
    rates = [max(step_time(sz) - per_tensor * len(sz), 0.0) / sum(sz) for sz in sizes]
    return per_tensor, statistics.median(rates)


class CacheEvictor:
    """Calling it writes a buffer of twice the device's last-level cache (`last_level_cache_bytes`), so what runs
    next reads its data from memory."""

    def __init__(self, device: torch.device) -> None:
        self._buffer = torch.empty(2 * last_level_cache_bytes(device) // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self._buffer.fill_(1.0)


def last_level_cache_bytes(device: torch.device, cpu_caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache of `device` in bytes: a GPU's L2; on a CPU the largest of the caches Linux lists for cpu0
    (`cpu_caches`, sysfs); 32 MiB where neither says."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size) or 32 * 2**20
    sizes = []
    for entry in cpu_caches.glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 * 2**20)


def dtensor_optimizer_overhead(name: str, mesh, runs: int = 9) -> float:
    """Extra seconds per parameter tensor of `optimizer.step()` when the parameters are DTensors on `mesh`
    (each of torch's foreach ops then dispatches through DTensor's sharding propagation): `TWINS` tiny
    parameters sharded over the mesh against as many plain ones of the same local size, the fastest run of each.
    Runs on this rank alone (an optimizer step over DTensors communicates nothing)."""
    _check_optimizer(name)
    timer = Timer(torch.device(mesh.device_type))
    plain, sharded = _plain_and_sharded(mesh)
    for p in plain + sharded:
        p.grad = torch.ones_like(p)  # not random: DTensor warns about random ops on a CPU mesh
    return max(min(_timed_steps(name, sharded, timer, runs)) - min(_timed_steps(name, plain, timer, runs)), 0.0) / TWINS


def dtensor_view_overhead(mesh, runs: int = 9) -> float:
    """Extra seconds per trainable parameter of one forward + backward when the parameters are DTensors on `mesh`:
    the per-rank program reads each through `runtime.local_view` (an autograd Function whose backward wraps the
    gradient as a DTensor), and the gradient lands in a DTensor `.grad`. `TWINS` tiny parameters sharded over the mesh
    against as many plain ones, each used once by a tiny op and summed; the fastest run of each. Runs on this
    rank alone (nothing communicates)."""
    from meshplan.runtime.local_view import local_view

    timer = Timer(torch.device(mesh.device_type))
    plain, sharded = _plain_and_sharded(mesh)

    def fastest(params, view) -> float:
        def step() -> None:
            for p in params:
                p.grad = None
            torch.stack([(view(p) * 2.0).sum() for p in params]).sum().backward()
        return min([timer(step) for _ in range(runs + 2)][2:])

    return max(fastest(sharded, local_view) - fastest(plain, lambda p: p), 0.0) / TWINS


TWINS = 32
"""Tiny parameters of each kind the DTensor overheads are timed on (`_plain_and_sharded`)."""


def _plain_and_sharded(mesh) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """`TWINS` plain parameters of 16 elements, and as many DTensor parameters of that local size sharded over every
    axis of `mesh` (filled with ones: DTensor warns about random ops on a CPU mesh)."""
    device = torch.device(mesh.device_type)
    plain = [torch.nn.Parameter(torch.ones(16, device=device)) for _ in range(TWINS)]
    sharded = [torch.nn.Parameter(DTensor.from_local(torch.ones(16, device=device), mesh, [Shard(0)] * mesh.ndim, run_check=False))
               for _ in range(TWINS)]
    return plain, sharded


def _check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} cannot be timed; allowed: {', '.join(OPTIMIZERS)}")


def _timed_steps(name: str, params: list[torch.nn.Parameter], timer: Timer, runs: int,
                 before: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of `runs` `optimizer.step()`s over `params` (gradients set) after two warm-up steps, `before()`
    called ahead of every step."""
    opt = OPTIMIZERS[name](params)
    times = []
    for _ in range(runs + 2):
        if before is not None:
            before()
        times.append(timer(opt.step))
    return times[2:]
