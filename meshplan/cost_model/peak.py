"""Predicted peak memory of one training step on one device: a liveness walk over the plan.

Where `planner/problem.py`'s per-node sum (what the solver bounds) keeps every activation and
every gradient resident at once, this walks the step as the runtime runs it:

- resident throughout: local parameters and buffers, optimizer state (per optimizer, fp32), the
  gradient-bucket buffers the runtime keeps (`runtime/grad_buckets.py`);
- forward, op by op: its outputs are allocated (views alias their input, 0 bytes), and so is every
  resharded copy of an input (`plan.transfers`: an all-gathered ZeRO/FSDP weight is one); a tensor
  is freed after its last forward reader unless an op saved it for backward (`SAVED`);
- what an op saves follows autograd (`SAVED`; a product keeps a factor only for the other's gradient), and a
  region op's kernel keeps what it declares (`RegionOp.kept_bytes`: a context-parallel kernel's gathered K/V);
- backward, in reverse: each op allocates the gradients of its inputs, then frees its output
  gradients and the tensors only it saved (autograd releases them before the next node runs); a move into it then
  runs its backward collective (its scratch while it runs) and frees the moved copy's gradient; parameter gradients
  stay until the optimizer step;
- while an op runs, what its kernel holds beyond its tensors comes on top (`working_bytes`): on a CPU the flash
  attention kernel's scratch (`cost_model/attention_memory.py`), and a region op's kernel's own
  (`RegionOp.working_bytes`: a context-parallel ring's blocks in flight, an all-gather kernel's gathered copies);
- the optimizer step adds its per-parameter temporaries (`STEP_TEMPORARIES`);
- a recomputed layer (`plan.recompute`, run under `torch.utils.checkpoint`) keeps only its inputs
  through forward; its backward starts by running its forward again, which brings back what its
  ops save, each freed at its op's backward as before.

The result is the highest total reached. A resharded copy is the tensor a move leaves behind;
while a move runs, its collectives' scratch buffers come on top (`collective_scratch_bytes`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from meshplan.cost_model.attention_memory import flash_cpu_bytes, on_cpu
from meshplan.cost_model.compute import is_view
from meshplan.cost_model.memory import MemoryBreakdown, OPTIMIZER_STATES, format_bytes
from meshplan.cost_model.presets import get_cluster
from meshplan.ir.graph import Graph, TensorRef
from meshplan.ir.placement import local_shape
from meshplan.ir.regions import region_op

SAVED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "mm": ((0, 1), ()), "addmm": ((1, 2), ()), "bmm": ((0, 1), ()), "baddbmm": ((1, 2), ()),
    "mul": ((0, 1), ()), "div": ((0, 1), ()), "gelu": ((0,), ()), "silu": ((0,), ()), "sigmoid": ((), (0,)),
    "tanh": ((), (0,)), "relu": ((), (0,)), "threshold": ((), (0,)), "exp": ((), (0,)), "rsqrt": ((), (0,)),
    "pow": ((0,), ()), "sqrt": ((), (0,)), "log": ((0,), ()),
    "_softmax": ((), (0,)), "_log_softmax": ((), (0,)), "embedding": ((1,), ()),
    "native_layer_norm": ((0,), (1, 2)), "native_group_norm": ((0,), (1, 2)),
    "scaled_dot_product_attention": ((0, 1, 2), (0,)),
    "_scaled_dot_product_flash_attention_for_cpu": ((0, 1, 2), (0, 1)),
    "nll_loss_forward": ((1,), (1,)), "nll_loss2d_forward": ((1,), (1,)),
    "mean": ((), ()), "sum": ((), ()), "add": ((), ()), "sub": ((), ()), "neg": ((), ()), "clone": ((), ()),
    "cat": ((), ()), "where": ((0,), ()), "masked_fill": ((1,), ()), "gather": ((1,), ()), "index_select": ((1,), ()),
    "convolution": ((0, 1), ()), "amax": ((0,), (0,)), "_to_copy": ((), ()), "copy": ((), ()),
}
"""ATen op -> (input positions, output indices) its autograd node keeps for backward. Ops not
listed are assumed to keep every input (conservative)."""
SAVED_FOR_OTHER: dict[str, dict[int, int]] = {"mul": {0: 1, 1: 0}, "div": {0: 1}}
"""ATen op -> {input position: the input whose gradient needs it}: the input is saved only when that one needs a
gradient (a product's factor serves the other factor's gradient alone: RoPE's `q * cos` keeps `cos`, not `q`)."""
FLASH_ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu")
"""Attention ops a CPU runs with ATen's flash kernel when no mask tensor is given (`working_bytes`)."""
GLOO_SCRATCH = {"all_gather": 1, "reduce_scatter": 1}
"""Full-tensor copies gloo's `all_gather_into_tensor` / `reduce_scatter_tensor` allocate during the
call (measured with torch.profiler on 2 and 4 ranks: exactly 1.0x the full tensor; `all_reduce`
and `all_to_all_single`: none). NCCL works in place of the given buffers."""
STEP_TEMPORARIES = {"adam": 3, "adamw": 3, "sgd": 0, "sgd_momentum": 1, "adagrad": 2, "rmsprop": 2}
"""Temporaries of the largest local parameter that one (per-tensor) optimizer update allocates."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakMemory:
    """The predicted peak and what was resident throughout."""

    peak: int
    resident: MemoryBreakdown
    """Parameters, optimizer state (+ bucket buffers in `grads`) held for the whole step."""
    phase: str
    """Where the peak is: forward, backward or optimizer (a pipeline stage's also accumulating: `under_schedule`)."""
    at_peak: MemoryBreakdown
    """What is held at the peak (its total is `peak`): parameters (with the working copies of weights a mixed-precision
    cast made), gradients (bucket buffers and the parameter gradients accumulated so far), optimizer state, and
    activations with every temporary."""
    saved: int = 0
    """Bytes still held when forward ends (what backward needs): what each further microbatch in flight adds. Weights'
    working copies (mixed precision) are left out: a pipelined stage casts each parameter once per step and its
    microbatches share the copy (runtime/pipeline.py, `_hoist_weight_casts`)."""
    saved_by: dict[str, int] = field(default_factory=dict)
    """`saved` by op: the bytes of each op's tensors (its outputs, the resharded copies of its inputs, what its kernel
    keeps): what the pipeline search's stage profile counts per unit."""
    microbatch: MemoryBreakdown
    """The highest point of the forward and backward alone (no optimizer step), parameter gradients as the backward
    makes them: a pipeline stage's first microbatches, which run before any backward."""
    accumulating: MemoryBreakdown
    """The highest point of a forward and backward run after another microbatch's backward, which holds every parameter
    gradient throughout (they accumulate over the step's microbatches): the pipeline schedules that interleave
    forwards and backwards (`cost_model/pipeline_memory.py`)."""
    step: MemoryBreakdown
    """What the optimizer step holds: no microbatch is in flight then."""
    microbatch_phase: str
    """Where `microbatch` is: forward or backward."""
    casting_back: MemoryBreakdown | None = None
    """The end of a microbatch's backward in a pipeline stage, whose weights' working copies (mixed precision) are made
    once per step (runtime/pipeline.py, `_hoist_weight_casts`): autograd runs those casts' backward last (made before
    every microbatch's ops, they have the lowest sequence numbers), so each weight's working-copy gradient is held
    until then, beside every parameter gradient and the working copies. None without working copies."""
    cast_accumulate_bytes: int = 0
    """What each cast's backward adds while it sums its gradient into the parameter's after the step's first
    microbatch: the fp32 gradient of the largest weight with a working copy, made before it is added."""
    working_copy_bytes: int = 0
    """Bytes of the weights' working copies (mixed precision): a pipelined stage makes them once per step and holds
    them until its last backward."""
    idle: MemoryBreakdown | None = None
    """A pipeline stage's most while its rank runs another of its stages (`pipeline_memory.under_schedule`); None
    outside a pipeline."""

    def __str__(self) -> str:
        return f"peak {format_bytes(self.peak)} in {self.phase} (resident {self.resident})"


def collective_scratch_bytes(step, cluster: str, head_tail_axis: int | None = None) -> int:
    """Bytes held during one redistribution step beyond its result: the backend's scratch copy (gloo,
    the `cpu` cluster) plus the runtime's staging buffer when the dim is not 0 or the blocks are in head-tail token
    order (`head_tail_axis`, `Plan.head_tail_axis`): the gathered blocks before they are joined; the blocks copied
    out in rank order before a reduce-scatter (runtime/collectives.py)."""
    if step.kind not in ("all_gather", "reduce_scatter"):
        return 0
    full = step.nbytes
    staged = step.dim > 0 or step.axis == head_tail_axis
    return (GLOO_SCRATCH[step.kind] * full if cluster == "cpu" else 0) + (full if staged else 0)


def _name(target: str) -> str:
    return re.sub(r"^aten(\.|::)", "", target).split(".", 1)[0]


def predict_peak(graph: Graph, plan, *, optimizer: str = "adam", timeline: list | None = None, nodes: set[str] | None = None,
                 kept: set[str] | None = None) -> PeakMemory:
    """Peak bytes one device holds during a step of `plan` (a `meshplan.planner.Plan` for `graph`).
    With `timeline` (a list), (phase, node name, bytes held once the op is done) is appended per op.

    `nodes`: walk only these ops (a pipeline stage's), and hold only the parameters they read, their optimizer
    state and the gradient buckets made of them; tensors coming from outside cost nothing here (they arrive in
    buffers the caller counts). `kept`: ops whose outputs stay until the end of backward (a stage's outputs, which
    the schedule keeps for the backward of the next stage's gradient)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    shape = plan.mesh.shape
    out_layout = plan.value_layouts()
    strategy_of = {n.name: n.strategy for n in plan.nodes}
    moved = {(t.consumer, t.position): t for t in plan.transfers if t.forward}
    ordered = {key: plan.move_order_axis(t.tensor, graph.param_values) for key, t in moved.items()}
    scratch_fwd = {("move", c, p): max(collective_scratch_bytes(s, plan.cluster, ordered[c, p]) for s in t.forward)
                   for (c, p), t in moved.items()}
    scratch_bwd = {("move", c, p): max((collective_scratch_bytes(s, plan.cluster, ordered[c, p]) for s in t.backward), default=0)
                   for (c, p), t in moved.items()}

    def nbytes(meta, layout) -> int:
        return math.prod(local_shape(meta.shape, layout, shape)) * meta.itemsize if layout is not None else meta.nbytes

    cluster = get_cluster(plan.cluster)
    cpu = on_cpu(cluster)

    def working_bytes(node, backward: bool) -> int:
        """What the op's kernel holds while it runs beyond the tensors the walk counts there."""
        strategy = strategy_of[node.name]
        region = region_op(node.target)
        if region is not None and strategy.kernel:
            return region.working_bytes(node, [graph.meta(r) for r in node.inputs], strategy, shape, cluster, backward=backward)
        if cpu and _name(node.target) in FLASH_ATTENTION and len(node.inputs) == 3:  # no mask tensor: the flash kernel
            q, k = (local_shape(graph.meta(r).shape, p, shape) for r, p in zip(node.inputs[:2], strategy.inputs[:2]))
            return flash_cpu_bytes(math.prod(q[:-3]), q[-3], q[-2], k[-2], q[-1], backward=backward) if len(q) >= 3 else 0
        return 0

    ops = [n for n in graph.nodes if n.kind == "op" and (nodes is None or n.name in nodes)]
    read = {ref.node for n in ops for ref in n.inputs}

    # resident state
    params = [p for p in plan.params if nodes is None or p.node in read]
    param_bytes = sum(nbytes(graph[p.node].out, p.layout) for p in params)
    trainable = [p for p in params if not p.is_buffer and graph[p.node].grad(0)]
    numels = [math.prod(local_shape(p.shape, p.layout, shape)) for p in trainable]
    # an offloaded parameter's optimizer state (and its step) live in host memory
    state = OPTIMIZER_STATES[optimizer] * 4 * sum(n for p, n in zip(trainable, numels) if not p.offload)
    numels = [n for p, n in zip(trainable, numels) if not p.offload]
    # a stage's rank packs only its own parameters of a bucket (runtime/stage_grads.py)
    mine = {p.node: nbytes(graph[p.node].out, p.layout) for p in params}
    buckets = sum(b.nbytes if nodes is None else sum(mine.get(name, 0) for name in b.params) for b in plan.buckets)
    resident = MemoryBreakdown(params=param_bytes, grads=buckets, optimizer=state, activations=0,
                               workspace=get_cluster(plan.cluster).device.library_workspace_bytes)

    # tensors: a producer's output ("ref") or a resharded copy ("move"); views alias their input's root
    size: dict[object, int] = {}
    root: dict[object, object] = {}
    born: dict[object, int] = {}
    last_read: dict[object, int] = {}
    saved_until: dict[object, int] = {}  # root -> smallest index of an op that saved it (freed in backward there)
    recomputed: dict[str, dict[object, int]] = {layer: {} for layer in plan.recompute}  # layer -> {key made again: saving op}
    rerun_at = {max(i for i, n in enumerate(ops) if n.layer == layer): layer for layer in plan.recompute
                if any(n.layer == layer for n in ops)}  # its backward starts at its last op: the forward runs again there

    def tensor_in(node, pos: int, ref: TensorRef) -> object:
        if (node.name, pos) in moved:
            return ("move", node.name, pos)
        return root.get(("ref", ref.node, ref.index), ("ref", ref.node, ref.index))

    for i, node in enumerate(ops):
        ins = []
        for pos, ref in enumerate(node.inputs):
            if (node.name, pos) in moved:
                key = ("move", node.name, pos)
                size[key], born[key] = nbytes(graph.meta(ref), moved[(node.name, pos)].dst), i
            key = tensor_in(node, pos, ref)
            last_read[key] = i
            ins.append(key)
        for j, meta in enumerate(node.outputs):
            key = ("ref", node.name, j)
            if meta is None:
                continue
            if is_view(node.target) and ins:
                root[key] = ins[0]
            else:
                size[key], born[key] = nbytes(meta, out_layout[node.name][j]), i
        region = region_op(node.target)
        kept = region.kept_bytes(node, [graph.meta(r) for r in node.inputs], strategy_of[node.name], shape) if region else 0
        if kept and any(node.requires_grad):  # what the region's kernel keeps for its backward beyond the op's tensors
            key = ("kept", node.name)
            size[key], born[key] = kept, i
            if node.layer in recomputed:  # a checkpointed layer drops it after the op and makes it again in backward
                recomputed[node.layer][key] = i
            else:
                saved_until[key] = i
        if any(node.requires_grad) and not is_view(node.target):  # a view's backward needs only shapes
            name = _name(node.target)
            keep_in, keep_out = SAVED.get(name, (tuple(range(len(ins))), ()))
            needed_by = SAVED_FOR_OTHER.get(name, {})

            def needed(p: int) -> bool:
                q = needed_by.get(p)
                return q is None or (q < len(ins) and graph[node.inputs[q].node].grad(node.inputs[q].index))

            saves = [ins[p] for p in keep_in if p < len(ins) and needed(p)]
            saves += [root.get(("ref", node.name, j), ("ref", node.name, j)) for j in keep_out if j < len(node.outputs)]
            again = node.layer if node.layer in recomputed else None
            for key in saves:
                if again is not None and key in born and ops[born[key]].layer == again:  # made inside: made again
                    rerun = recomputed[again]
                    rerun[key] = min(rerun.get(key, i), i)
                else:  # a checkpointed layer keeps its inputs
                    saved_until[key] = min(saved_until.get(key, i), i)
    ends = [ref for ref in graph.output.inputs] + [TensorRef(n.name, j) for n in ops if kept and n.name in kept for j in range(len(n.outputs))]
    for ref in ends:  # the loss (outputs) live to the end of forward and into backward
        key = root.get(("ref", ref.node, ref.index), ("ref", ref.node, ref.index))
        saved_until[key] = min(saved_until.get(key, len(ops)), -1)
    for rerun in recomputed.values():  # a tensor a later op keeps anyway is never freed, so never made again
        for key in [k for k in rerun if k in saved_until]:
            del rerun[key]

    born_at: dict[int, list] = {}
    for key, b in born.items():
        born_at.setdefault(b, []).append(key)
    freed_after: dict[int, list] = {}  # forward: a tensor no op saves goes after its last reader
    for key, b in born.items():
        if key not in saved_until:
            freed_after.setdefault(max(last_read.get(key, b), b), []).append(key)
    released_at: dict[int, list] = {}  # backward: a saved tensor goes after the backward of the first op that saved it
    for key, until in saved_until.items():
        if key in born:
            released_at.setdefault(until, []).append(key)

    base = resident.total
    casts = {key for key in size if key[0] == "ref" and key[1] in graph.weight_casts}  # a weight's working copy (mixed precision)

    def held_at(total: float, grads: int, copies: int) -> MemoryBreakdown:
        """What `total` bytes held are made of, `grads` of them parameter gradients and `copies` weights' working copies."""
        grads_held, params_held = resident.grads + grads, param_bytes + copies
        return MemoryBreakdown(params=params_held, grads=grads_held, optimizer=state, workspace=resident.workspace,
                               activations=int(total) - params_held - grads_held - state - resident.workspace)
    level = copies = 0  # bytes of live tensors; of them, weights' working copies

    def hold(key, sign: int = 1) -> None:
        nonlocal level, copies
        level += sign * size[key]
        if key in casts:
            copies += sign * size[key]

    peak, where, grads_at_peak, copies_at_peak = 0, "forward", 0, 0
    no_grads, no_grads_copies = 0, 0  # the highest point without parameter gradients (`PeakMemory.accumulating` adds all)
    for i in range(len(ops)):  # forward
        scratch = working_bytes(ops[i], False)  # the op's kernel, once its moved inputs and its outputs exist
        for key in born_at.get(i, ()):
            scratch = max(scratch, scratch_fwd.get(key, 0))  # while the move runs, its result already allocated
            hold(key)
        if base + level + scratch > peak:
            peak, where, grads_at_peak, copies_at_peak = base + level + scratch, "forward", 0, copies
        if base + level + scratch > no_grads:
            no_grads, no_grads_copies = base + level + scratch, copies
        for key in freed_after.get(i, ()):
            hold(key, -1)
        if timeline is not None:
            timeline.append(("forward", ops[i].name, base + level))
    saved_bytes = level - copies  # weights' working copies are made once per step and shared by the step's microbatches
    saved_by: dict[str, int] = {}
    for key in saved_until:  # ("ref", producer, j), ("move", consumer, pos) or ("kept", op): held when forward ends
        if key in born and key not in casts:
            saved_by[key[1]] = saved_by.get(key[1], 0) + size[key]

    is_param = {n.name for n in graph.nodes if n.kind == "param"}
    grads: dict[object, int] = {}  # gradient of a tensor (root) -> bytes, alive until its producer's backward
    done_params: set[str] = set()
    param_grads = 0

    def grad_of(key, ref: TensorRef) -> int:
        """Allocate the gradient of `key` (once); parameters' gradients stay until the optimizer step."""
        nonlocal param_grads
        if key[0] == "ref" and key[1] in is_param:
            if key[1] not in done_params:
                done_params.add(key[1])
                param_grads += nbytes(graph[key[1]].out, out_layout[key[1]][0])
            return 0
        if key in grads:
            return 0
        grads[key] = size.get(key, 0)
        return grads[key]

    for i in range(len(ops) - 1, -1, -1):  # backward
        node = ops[i]
        for key, until in recomputed.get(rerun_at.get(i), {}).items():  # the checkpointed forward runs again
            hold(key)
            released_at.setdefault(until, []).append(key)
        if not any(node.requires_grad) or is_view(node.target):
            continue
        sent_back = []
        for pos, ref in enumerate(node.inputs):
            if not graph[ref.node].grad(ref.index):
                continue
            key = tensor_in(node, pos, ref)
            level += grad_of(key, ref)
            if key[0] == "move":
                sent_back.append(key)
        running = working_bytes(node, True)  # the op's backward kernel, its input gradients allocated
        if base + level + running + param_grads > peak:
            peak, where, grads_at_peak, copies_at_peak = base + level + running + param_grads, "backward", param_grads, copies
        if base + level + running > no_grads:
            no_grads, no_grads_copies = base + level + running, copies
        for key in [("ref", node.name, j) for j in range(len(node.outputs))]:
            if key in grads:  # consumed by this op's backward
                level -= grads.pop(key)
        for key in released_at.pop(i, ()):  # autograd frees a node's saved tensors once its backward has run
            hold(key, -1)
        # then each move's dual step (the next node autograd runs) brings its gradient back to the producer's layout,
        # with the collective's scratch while it runs, and frees the moved copy's gradient
        for key in sent_back:
            src = graph[key[1]].inputs[key[2]]
            level += grad_of(root.get(("ref", src.node, src.index), ("ref", src.node, src.index)), src)
            held = base + level + param_grads + scratch_bwd.get(key, 0)
            if held > peak:
                peak, where, grads_at_peak, copies_at_peak = held, "backward", param_grads, copies
            if held - param_grads > no_grads:
                no_grads, no_grads_copies = held - param_grads, copies
            if key in grads:
                level -= grads.pop(key)
        if timeline is not None:
            timeline.append(("backward", node.name, base + level + param_grads))

    biggest = max(numels, default=0) * 4
    cast_bytes = sum(size[key] for key in casts if graph[key[1]].grad(key[2]))  # the working copies needing a gradient
    casting_back = held_at(base + level + param_grads + 2 * cast_bytes, param_grads + cast_bytes, cast_bytes) if cast_bytes else None
    cast_accumulate = max((nbytes(graph[n.inputs[0].node].out, out_layout[n.inputs[0].node][0]) for n in ops
                           if n.name in graph.weight_casts and n.grad(0)), default=0)
    microbatch, microbatch_phase = held_at(peak, grads_at_peak, copies_at_peak), where  # the forward and backward's own
    at_step = base + param_grads + STEP_TEMPORARIES.get(optimizer, 0) * biggest
    step = held_at(at_step, param_grads, 0)
    if at_step > peak:
        peak, where, grads_at_peak, copies_at_peak = at_step, "optimizer", param_grads, 0
    return PeakMemory(peak=int(peak), resident=resident, phase=where, at_peak=held_at(peak, grads_at_peak, copies_at_peak),
                      saved=saved_bytes, saved_by=saved_by, microbatch=microbatch, accumulating=held_at(no_grads + param_grads, param_grads, no_grads_copies),
                      step=step, microbatch_phase=microbatch_phase, casting_back=casting_back,
                      cast_accumulate_bytes=cast_accumulate, working_copy_bytes=sum(size[key] for key in casts))
