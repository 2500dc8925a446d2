"""Trace an `nn.Module` into an `ir.Graph` with non-strict torch.export, without running it.

The exported ATen program is decomposed to core ATen (so DTensor's op rules apply) except for
`scaled_dot_product_attention`, which stays one op so attention can be sharded by heads. Tied
parameters become one parameter node, so a plan can never place them differently.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
import sysconfig
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.export.graph_signature import ConstantArgument, InputKind, InputSpec, OutputKind

from meshplan.ir.causal_mask import causal_masks_to_flags
from meshplan.ir.graph import Graph, Node, TensorMeta, TensorRef
from meshplan.ir.mutations import (REGION_OUTPUT, UNSET, assigned, attributes, detach_parameter_updates, forward_attributes,
                                   rebind_updated_parameters)
from meshplan.ir.precision import MixedPrecision, cast_for_tracing
from meshplan.ir.regions import regions_patched
from meshplan.ir.repeat import replicate, repeated_stacks, truncated
from meshplan.ir.verify import verify
from meshplan.progress import timed

aten = torch.ops.aten
log = logging.getLogger("meshplan")

KEEP_WHOLE = (aten.scaled_dot_product_attention.default, aten.detach.default)
"""Ops kept from decomposition: meshplan has its own sharding rules for attention, and `detach`
would otherwise become `alias`, which lets gradients through where the model stopped them."""

CHECKS = (aten._assert_tensor_metadata.default,)
"""Assertions export inserts on the dtype/device of tensors (`.to()` calls in the model): they hold by
construction when the traced program runs, produce nothing and would need a sharding rule, so the
trace drops them."""

STRIDE_SAFE = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}
"""The trace bakes in the strides fake kernels chose; executing on other kernels (or on shards) a
view may meet a non-contiguous tensor, so views run as reshapes (a view whenever one is possible)."""


@dataclass(frozen=True, slots=True)
class FixedInput:
    """A non-tensor input of the traced call (a flag such as `use_cache=False`, a size, a string, None):
    torch.export bakes its value into the ops that read it, so the program has no input for it."""

    name: str
    """Where the call passes it: a keyword (`use_cache`) or a position (`args[1]`), then any nesting (`[0]`)."""
    index: int
    """Its position among the call's flattened inputs."""
    value: Any


@dataclass(slots=True)
class TracedProgram:
    """What the runtime needs of the trace: the ATen graph module and how to call it."""

    gm: fx.GraphModule
    in_spec: Any
    out_spec: Any
    constants: dict[str, torch.Tensor]
    """Lifted tensor constants by placeholder name."""
    mutations: tuple[str, ...] = ()
    """FQNs of the parameters and buffers the model updates in place in forward (batch norm's running
    statistics, weights it rescales), one per leading output of the graph, which holds the new value, in
    order; the user's outputs follow them."""
    fixed: tuple[FixedInput, ...] = ()
    """The traced call's non-tensor inputs, in call order."""
    attributes: dict[str, Any] = field(default_factory=dict)
    """The model's plain-valued module attributes (flags, counters) by `path.name` when it was traced: the program
    computes what the model computes in that state."""
    state_changes: dict[str, Any] = field(default_factory=dict)
    """Attributes the forward reassigns, with the values it leaves, where the program traced from those values
    differs from this one (RWKV's `layers_are_rescaled`): this program is then right for its first call only."""

    def user_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors of the call `(*args, **kwargs)`, in the order the program's user inputs take them.

        The call must be shaped like the traced one (keywords in any order) and pass every fixed input's
        traced value: the program computes with that value, whatever the call says."""
        keys = self.in_spec.child(1).context
        if set(kwargs) == set(keys):  # flattening follows the keywords' order, the program the traced order
            kwargs = {k: kwargs[k] for k in keys}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise ValueError(f"the model was traced with {_call_shape(self.in_spec)} and is called with {_call_shape(spec)}"
                             f"{_first_difference(self.in_spec, spec)}; call it as it was traced (example_inputs=, example_kwargs=)")
        fixed = {f.index: f for f in self.fixed}
        tensors = []
        for i, x in enumerate(leaves):
            f = fixed.get(i)
            if f is None and not isinstance(x, torch.Tensor):
                name = _input_name(pytree.tree_flatten_with_path((args, kwargs))[0][i][0])
                raise ValueError(f"{name} was traced as a tensor; got {_brief(x)}")
            if f is None:
                tensors.append(x)
            elif type(x) is not type(f.value) or x != f.value:
                raise ValueError(
                    f"{f.name}={_brief(x)}, but the model was traced (and planned) with {f.name}={f.value!r}: a non-tensor "
                    f"input is a constant of the traced program; pass {f.name}={f.value!r}, or plan again with the new value"
                )
        return tensors


def _input_name(path: tuple) -> str:
    """`use_cache`, `args[1]`, `labels[0]`: where a flattened input of the call `(args, kwargs)` sits."""
    first = path[1]
    return (f"args[{first.idx}]" if path[0].idx == 0 else str(first.key)) + pytree.keystr(path[2:])


def _brief(x: Any) -> str:
    return f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def _call_shape(spec: Any) -> str:
    """'1 positional input and keywords labels, use_cache' of a call's (args, kwargs) tree spec."""
    n, keys = spec.child(0).num_children, spec.child(1).context
    return f"{n} positional input{'' if n == 1 else 's'} and " + (f"keywords {', '.join(map(str, keys))}" if keys else "no keywords")


def _first_difference(traced: Any, called: Any) -> str:
    """Where two calls of the same positions and keywords nest differently (empty when their positions or keywords differ)."""
    if _call_shape(traced) != _call_shape(called):
        return ""
    names = [f"args[{i}]" for i in range(traced.child(0).num_children)] + [str(k) for k in traced.child(1).context]
    children = traced.child(0).children() + traced.child(1).children()
    theirs = called.child(0).children() + called.child(1).children()
    return next(f" ({n} holds other containers than the traced one)" for n, a, b in zip(names, children, theirs) if a != b)


class TraceError(ValueError):
    """The model could not be traced; the message names the model and the cause."""


def op_name(target: Any) -> str:
    return str(target)


def _metas(val: Any) -> tuple[TensorMeta | None, ...]:
    if isinstance(val, torch.Tensor):
        return (TensorMeta.of(val),)
    if isinstance(val, (list, tuple)):
        return tuple(TensorMeta.of(v) if isinstance(v, torch.Tensor) else None for v in val)
    return (None,)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L__self__.")


def _export(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # KV caches are inference state; training traces must not carry them.
        config.use_cache = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.export(model, args, kwargs, strict=False)
            _inline_regions(ep.graph_module)
            _drop_checks(ep.graph_module)
            rebind_updated_parameters(ep.graph_module, {s.arg.name for s in ep.graph_signature.input_specs
                                                        if s.kind == InputKind.PARAMETER})
            if _decompose_in_place(ep.graph_module):
                return ep
            table = torch.export.default_decompositions()
            for op in KEEP_WHOLE:
                table.pop(op, None)
            ep = ep.run_decompositions(table)
            _inline_regions(ep.graph_module)
            _drop_checks(ep.graph_module)
            detach_parameter_updates(ep.graph_module, [i for i, s in enumerate(ep.graph_signature.output_specs)
                                                       if s.kind == OutputKind.PARAMETER_MUTATION])
            return ep
    except Exception as e:  # noqa: BLE001 - re-raised with context for the user
        where = user_frame(e)
        line = f"{where.filename}:{where.lineno} in {where.name}: `{where.line}`" if where else "a line outside the model"
        first = " ".join(str(e).strip().splitlines()[:3])[:500]
        raise TraceError(
            f"could not trace {type(model).__name__} with torch.export (non-strict) at {line}: {type(e).__name__}: "
            f"{first} (the full torch.export error is this exception's __cause__)"
        ) from e


def _drop_checks(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in CHECKS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _inline_regions(gm: fx.GraphModule) -> None:
    """Splice the bodies of `torch.no_grad()` / `enable_grad()` / disabled-autocast regions (export
    keeps them as higher-order ops over submodules) into the graph, so every op is one node with a
    sharding rule. A region run without gradients has its outputs detached, as it would at run time;
    an enabled autocast region would change dtypes the graph does not show, so it is refused."""
    hop = torch.ops.higher_order
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (hop.wrap_with_set_grad_enabled, hop.wrap_with_autocast):
            continue
        if node.target is hop.wrap_with_set_grad_enabled:
            grad, body_node, inputs = node.args[0], node.args[1], list(node.args[2:])
        else:
            device, dtype, enabled, _cache, body_node, *inputs = node.args
            if enabled:
                raise TraceError(
                    f"the model runs a torch.autocast({device!r}, dtype={dtype}) region at {_module_path(node) or '<top>'}; "
                    "meshplan plans and runs the model in the dtypes it traces: remove the autocast or apply it around the call"
                )
            grad = True
        body: fx.GraphModule = getattr(gm, body_node.target)
        _inline_regions(body)
        if not grad:
            out = next(n for n in body.graph.nodes if n.op == "output")
            def detach(a: fx.Node) -> fx.Node:
                d = body.graph.call_function(aten.detach.default, (a,))
                d.meta.update({k: a.meta[k] for k in ("val", "tensor_meta") if k in a.meta})
                d.meta[REGION_OUTPUT] = True  # a parameter the region wrote stays the parameter (ir/mutations.py)
                return d

            with body.graph.inserting_before(out):
                detached = fx.node.map_arg(out.args[0], detach)
            out.args = (detached,)
        for attr in body.graph.nodes:  # constants the body reads become the outer module's
            if attr.op == "get_attr":
                setattr(gm, attr.target, getattr(body, attr.target))
        _splice(gm.graph, node, body, inputs)
        if not body_node.users:
            gm.graph.erase_node(body_node)
            delattr(gm, body_node.target)
    gm.graph.lint()
    gm.recompile()


_DECOMPOSITIONS: dict[tuple, fx.GraphModule] = {}
"""(op, static args, argument structure, tensor shapes/strides/dtypes/devices) -> its traced decomposition."""


@functools.lru_cache(maxsize=1)
def _decomposition_table() -> dict:
    table = dict(torch.export.default_decompositions().items())
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table


def _decompose_in_place(gm: fx.GraphModule) -> bool:
    """Lower the export graph to core ATen node by node, as `run_decompositions` would, but trace
    each distinct (op, shapes, static args) once and splice copies of it in: repeated layers ask
    for the same decompositions, and retracing the whole program was over half of the trace time.

    The templates are kept between traces: the pipeline search traces one model at several
    microbatch sizes, whose weight-only ops (casts, transposes) decompose alike.

    Returns False, changing nothing, when the graph mutates tensors (functionalisation needs the
    whole-program pass)."""
    table = _decomposition_table()
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    if any(n.target._schema.is_mutable for n in calls):
        return False
    templates = _DECOMPOSITIONS
    if len(templates) > 4096:
        templates.clear()
    for node in calls:
        if node.target in KEEP_WHOLE or (node.target not in table and not _composite(node.target)):
            continue
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        tensor_at = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
        metas = [flat[i].meta["val"] for i in tensor_at]
        static = [a if not isinstance(a, fx.Node) else None for a in flat]
        key = (node.target, repr(static), spec, tuple((tuple(m.shape), tuple(m.stride()), m.dtype, m.device) for m in metas))
        if key not in templates:
            def call(*tensors, _flat=flat, _spec=spec, _op=node.target):
                values = list(_flat)
                for i, t in zip(tensor_at, tensors):
                    values[i] = t
                args, kwargs = pytree.tree_unflatten(values, _spec)
                return _op(*args, **kwargs)

            templates[key] = _trace_decomposition(call, metas, table)
        _splice(gm.graph, node, templates[key], [flat[i] for i in tensor_at])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return True


def _trace_decomposition(call, metas: list, table: dict) -> fx.GraphModule:
    """make_fx of `call` on fake tensors like `metas`, on their own device: a decomposition may move
    tensors between devices (`to(device=cpu)`), which meta examples cannot do."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        examples = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=m.device) for m in metas]
    return make_fx(call, decomposition_table=table, tracing_mode="fake", _allow_non_fake_inputs=True)(*examples)


def _composite(op: torch._ops.OpOverload) -> bool:
    """An op torch defines by other ops (CompositeImplicitAutograd): tracing below autograd decomposes it."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _splice(graph: fx.Graph, node: fx.Node, template: fx.GraphModule, inputs: list[fx.Node]) -> None:
    """Replace `node` by a copy of `template`'s body fed with `inputs`; new nodes keep `node`'s module stack."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    result = None
    with graph.inserting_before(node):
        for t in template.graph.nodes:
            if t.op == "placeholder":
                env[t] = next(placeholders)
            elif t.op == "output":
                result = fx.node.map_arg(t.args[0], lambda a: env[a])
            else:
                new = graph.node_copy(t, lambda a: env[a])
                for key in ("nn_module_stack", "stack_trace"):
                    if key in node.meta:
                        new.meta[key] = node.meta[key]
                env[t] = new
    if isinstance(result, fx.Node):
        node.replace_all_uses_with(result)
    else:  # a multi-output op: its getitem users take the matching part
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise AssertionError(f"{node.format_node()} has a non-getitem user {user.format_node()}")
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, __import__("meshplan"))
) + (sysconfig.get_paths()["stdlib"] + os.sep,)


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `error`'s traceback (or its causes') outside torch, meshplan and the stdlib:
    the user's line that torch.export could not trace."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in traceback.extract_tb(error.__traceback__):
            path = os.path.abspath(frame.filename)
            if not frame.filename.startswith("<") and not path.startswith(_LIBRARY_DIRS):
                found = frame
        error = error.__cause__ or error.__context__
    return found


@timed("trace")
def trace(model: nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None, *,
          precision: MixedPrecision | None = None, copy_repeated: bool = True) -> Graph:
    """Trace `model(*example_inputs, **example_kwargs)` into an `ir.Graph`.

    The inputs may be real, meta or fake tensors; nothing is computed on real data. Non-tensor inputs (flags
    such as `use_cache=False`, sizes, strings, None) are constants of the program: it has no input for them,
    and `TracedProgram.user_inputs` holds every call to the values traced. `precision`: the
    mixed-precision policy whose casts the program carries (ir/precision.py); None: the model's dtypes.
    `copy_repeated`: trace a few blocks of each stack of identical layers and copy one block's program for
    the rest (ir/repeat.py); False exports every block.

    Module attributes the forward reassigns are put back, as torch.export does; where the program traced from the
    values the forward leaves differs, the program records them (`TracedProgram.state_changes`).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    example_inputs, example_kwargs = example_call(example_inputs, example_kwargs)
    if any(t.device.type == "meta" for t in itertools.chain(model.parameters(), model.buffers())):
        # a model built on the meta device traces with meta inputs (only shapes matter)
        example_inputs, example_kwargs = pytree.tree_map_only(torch.Tensor, lambda x: x.to("meta"), (example_inputs, example_kwargs))
    before = attributes(model)
    with forward_attributes(model) as left:
        graph = _traced(model, example_inputs, example_kwargs, precision, copy_repeated)
    changed = {k: v for k, v in left.items() if before.get(k, UNSET) != v}

    def matters(values: dict[str, Any]) -> bool:  # a flag that picks a branch does; a counter nothing reads does not
        with assigned(model, values):
            again = _traced(model, example_inputs, example_kwargs, precision, copy_repeated).fx
        return again.gm.code != graph.fx.gm.code or again.mutations != graph.fx.mutations

    state = {k: v for k, v in changed.items() if matters({k: v})}
    if not state and len(changed) > 1 and matters(changed):
        state = changed
    graph.fx.attributes, graph.fx.state_changes = before, state
    return graph


def _traced(model: nn.Module, example_inputs: tuple, example_kwargs: dict, precision: MixedPrecision | None,
            copy_repeated: bool) -> Graph:
    """One trace of the model as it is now (see `trace`)."""
    stacks = repeated_stacks(model) if copy_repeated else []
    ep, specs, grads, fixed = _exported(model, example_inputs, example_kwargs, precision, stacks)
    if ep is None:
        log.info("the blocks of %s did not trace as copies of one block; tracing every block", ", ".join(s.path for s in stacks))
        ep, specs, grads, fixed = _exported(model, example_inputs, example_kwargs, precision, [])
    gm = ep.graph_module

    # FQNs of every tensor, so tied parameters collapse to the first placeholder naming them.
    tensor_of = dict(model.named_parameters(remove_duplicate=False))
    tensor_of.update(dict(model.named_buffers(remove_duplicate=False)))
    aliases: dict[int, list[str]] = {}
    for fqn, t in tensor_of.items():
        aliases.setdefault(id(t), []).append(fqn)

    kinds = {s.arg.name: s for s in specs}
    nodes: list[Node] = []
    first_placeholder_of: dict[int, fx.Node] = {}
    refs: dict[fx.Node, TensorRef] = {}
    input_names: list[str] = []
    constants: dict[str, torch.Tensor] = {}

    for n in list(gm.graph.nodes):
        if n.op == "placeholder":
            spec = kinds[n.name]
            metas = _metas(n.meta.get("val"))
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                t = tensor_of.get(spec.target)
                if t is not None and id(t) in first_placeholder_of:
                    n.replace_all_uses_with(first_placeholder_of[id(t)])
                    gm.graph.erase_node(n)
                    continue
                if t is not None:
                    first_placeholder_of[id(t)] = n
                fqns = tuple(aliases.get(id(t), [spec.target])) if t is not None else (spec.target,)
                kind = "param" if spec.kind == InputKind.PARAMETER else "buffer"
                nodes.append(Node(n.name, kind, spec.target, (), metas, fqns=fqns))
            elif spec.kind == InputKind.USER_INPUT:
                nodes.append(Node(n.name, "input", n.name, (), metas))
                input_names.append(n.name)
            else:  # lifted constants
                constants[n.name] = ep.constants[spec.target]
                nodes.append(Node(n.name, "constant", spec.target, (), metas))
            refs[n] = TensorRef(n.name)
        elif n.op == "call_function" and n.target is operator.getitem:
            src, idx = n.args
            refs[n] = TensorRef(refs[src].node, idx)
        elif n.op == "call_function":
            inputs = tuple(refs[a] for a in _tensor_args(n))
            attrs = _static_args(n) if str(n.target).startswith("meshplan.") else _causal_flag(n)
            nodes.append(Node(n.name, "op", op_name(n.target), inputs, _metas(n.meta.get("val")), _module_path(n), attrs=attrs))
            refs[n] = TensorRef(n.name)
        elif n.op == "output":
            outs = [a for a in fx.node.map_arg(n.args[0], lambda x: x) if isinstance(a, fx.Node)]
            nodes.append(Node("output", "output", "output", tuple(refs[a] for a in outs), ()))
        else:
            raise TraceError(f"unexpected fx node {n.format_node()} in the exported graph")
    gm.graph.lint()
    gm.recompile()
    nodes = [replace(n, requires_grad=grads.get(n.name, ())) if n.kind != "output" else n for n in nodes]
    program = TracedProgram(gm, ep.call_spec.in_spec, ep.call_spec.out_spec, constants, _mutations(ep), fixed)
    graph = Graph(nodes, fx=program, input_names=tuple(input_names), precision=precision)
    verify(graph)
    return graph


def _exported(model: nn.Module, args: tuple, kwargs: dict, precision: MixedPrecision | None, stacks: list,
              ) -> tuple[torch.export.ExportedProgram | None, list[InputSpec], dict[str, tuple[bool, ...]], tuple[FixedInput, ...]]:
    """The exported program (weight casts placed, `stacks` traced in part and copied, no placeholders for
    non-tensor inputs), its input specs, which outputs of each node carry gradients and the call's fixed
    inputs; (None, [], {}, ()) when a stack's copy cannot reproduce it."""
    # blocks with data-dependent control flow trace as one op each
    with truncated(model, stacks), regions_patched(model), cast_for_tracing(model, precision):
        ep = _export(model, args, kwargs)
    gm, fixed = ep.graph_module, _fix_inputs(ep, args, kwargs)
    causal_masks_to_flags(gm)  # Hugging Face's causal masks, materialised under export, back to is_causal
    specs = [s for s in ep.graph_signature.input_specs if not isinstance(s.arg, ConstantArgument)]
    if precision is not None:
        _place_weight_casts(gm, {s.arg.name for s in specs if s.kind == InputKind.PARAMETER})
    if stacks and _mutations(ep):
        return None, [], {}, ()  # the copies would have to extend the program's outputs too
    trainable = dict(model.named_parameters(remove_duplicate=False))
    grads = _requires_grad(gm, {s.arg.name: trainable[s.target].requires_grad for s in specs if s.target in trainable})
    for stack in stacks:  # a copy carries gradients where the block it copies does (blocks 1 and 2 agree)
        copied = replicate(gm, specs, stack, _module_path, grads)
        if copied is None:
            return None, [], {}, ()
        specs = copied.specs
        grads.update((name, grads[src]) for name, src in copied.source.items() if src in grads)
    return ep, specs, grads, fixed


def _fix_inputs(ep: torch.export.ExportedProgram, args: tuple, kwargs: dict) -> tuple[FixedInput, ...]:
    """Erase the placeholders of the call's non-tensor inputs, which no op reads (export put their values
    in the ops), and say where each sits in the call and what it was."""
    paths = [path for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user) != len(paths):
        raise AssertionError(f"export took {len(user)} user inputs of a call with {len(paths)}")
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    fixed = []
    for i, (spec, path) in enumerate(zip(user, paths)):
        if isinstance(spec.arg, ConstantArgument):
            node = placeholders[spec.arg.name]
            if node.users:
                raise AssertionError(f"the constant input {spec.arg.name} is read by {list(node.users)}")
            ep.graph_module.graph.erase_node(node)
            fixed.append(FixedInput(_input_name(path), i, spec.arg.value))
    ep.graph_module.recompile()
    return tuple(fixed)


def example_call(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    """`(example_inputs, example_kwargs)` as the call's positional tuple and keyword dict; one input alone is
    the one positional input."""
    if isinstance(example_inputs, Mapping):
        raise ValueError(
            f"example_inputs must be a tuple of positional inputs; got a {type(example_inputs).__name__} with keys "
            f"{', '.join(map(repr, example_inputs))}: pass keyword inputs as example_kwargs= (or a dict that is the "
            "model's one positional input as example_inputs=(d,))"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise ValueError(f"example_kwargs must be a dict of keyword inputs (or None); got {type(example_kwargs).__name__}")
    return (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)), dict(example_kwargs or {})


def _place_weight_casts(gm: fx.GraphModule, params: set[str]) -> None:
    """Move each parameter's cast (ir/precision.py casts them all as the forward starts) to just before its first
    user, in that user's module: the cast then belongs to the user's layer and pipeline stage."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        if (n.op == "call_function" and n.target is aten._to_copy.default and isinstance(n.args[0], fx.Node)
                and n.args[0].name in params and n.users):
            first = min(n.users, key=order.__getitem__)
            first.prepend(n)
            if "nn_module_stack" in first.meta:
                n.meta["nn_module_stack"] = first.meta["nn_module_stack"]
    gm.graph.lint()
    gm.recompile()


def _requires_grad(gm: fx.GraphModule, param_grad: dict[str, bool]) -> dict[str, tuple[bool, ...]]:
    """Run the graph on fake tensors with autograd on, to learn which outputs carry gradients.

    Fake rather than meta tensors: they keep each tensor's device, so ops the model pins to a device
    (`arange(device="cpu")` next to a parameter) run as they did in the trace."""
    seen: dict[str, tuple[bool, ...]] = {}

    class Probe(fx.Interpreter):
        def run_node(self, n: fx.Node):
            if n.op == "placeholder":
                val = n.meta["val"]
                out = torch.empty(val.shape, dtype=val.dtype, device=val.device)
                if param_grad.get(n.name) and out.is_floating_point():
                    out.requires_grad_(True)
            elif n.op == "call_function":
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                out = STRIDE_SAFE.get(n.target, n.target)(*args, **kwargs)
            else:
                out = super().run_node(n)
            if n.op != "output" and n.target is not operator.getitem:
                flat = out if isinstance(out, (list, tuple)) else (out,)
                seen[n.name] = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
            return out

    with torch.enable_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        Probe(gm).run(*[None for n in gm.graph.nodes if n.op == "placeholder"])
    return seen


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    """The fx nodes among an op's arguments, in flattened argument order."""
    found: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def _static_args(n: fx.Node) -> tuple:
    """The non-tensor arguments of an op, in argument order (for meshplan's region ops)."""
    return tuple(a for a in pytree.tree_leaves((n.args, n.kwargs)) if not isinstance(a, fx.Node))


def _causal_flag(n: fx.Node) -> tuple:
    """`(("is_causal", True),)` for an ATen op called with `is_causal=True` (attention: the cost model prices the
    pairs its mask keeps, `Node.attrs`), else ()."""
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "is_causal" not in names:
        return ()
    i = names.index("is_causal")
    value = n.kwargs.get("is_causal", n.args[i] if i < len(n.args) else schema.arguments[i].default_value)
    return (("is_causal", True),) if value is True else ()


MUTATED = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)
"""The updates the program hands back to be written into the module (runtime/write_back.py)."""


def _mutations(ep: torch.export.ExportedProgram) -> tuple[str, ...]:
    """FQNs of the buffers and parameters written by the graph's leading outputs. A forward that writes into
    one of its inputs is a TraceError: the runtime hands each rank its part of the input, not the caller's tensor."""
    specs = ep.graph_signature.output_specs
    values = next(n for n in ep.graph_module.graph.nodes if n.op == "output").args[0]
    for spec, value in zip(specs, values):
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            raise TraceError(
                f"the model's forward writes in place into its input {spec.target} ({_made_by(value)}); meshplan's program "
                "gives each rank its part of the input, so the caller's tensor would not change: write the result to a "
                "new tensor instead")
    mutated = tuple(s.target for s in specs if s.kind in MUTATED)
    if any(s.kind not in MUTATED for s in specs[: len(mutated)]):
        raise TraceError(f"the exported program mutates buffers or parameters after its user outputs "
                         f"({[s.kind.name for s in specs]}); meshplan cannot run it")
    return mutated


def _made_by(node: Any) -> str:
    """`aten.mul.Tensor at blocks.1`: the op whose result an output is, and where the model runs it."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return f"{node}"
    return f"{op_name(node.target)} at {_module_path(node) or '<top>'}"
