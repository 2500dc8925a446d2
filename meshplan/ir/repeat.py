"""Trace a stack of identical layers once, then copy that layer's program for the rest of the stack.

torch.export costs time in proportion to the ops it records, and a 96-layer transformer records
the same layer 96 times. `trace` therefore exports the model with each stack of identical layers
(an `nn.ModuleList`, or an `nn.ModuleDict` as torchtitan keeps them, whose blocks have the same
structure; blocks in iteration order, named by their keys) cut to its first `KEPT` blocks, checks
that the second and third blocks traced to the same program, and copies the third block's ops
for every block after it, with that block's parameters. The result is the program a full export
gives, up to fx node names (tests/test_repeat.py compares the IR of both for the model zoo).

Blocks count as identical when every submodule has the same class, parameters and buffers of the
same shapes and dtypes, the same hooks, and the same plain attributes, except an index attribute
(an int equal to the block's position plus a constant, such as Hugging Face's `layer_idx`). A layer
that uses its index in its arithmetic traces differently in blocks 1 and 2, which the check sees.
Anything the copy cannot reproduce (a stack whose blocks differ, shared parameters between blocks,
buffer updates, a later op reading a value from inside an earlier block) traces the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.fx as fx
from torch import nn
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.utils import _pytree as pytree

log = logging.getLogger("meshplan")

KEPT = 3
"""Blocks traced per stack: the first may differ from the rest (it reads the embeddings), the second
and third show one block's program and what it hands the next."""

MIN_LENGTH = KEPT + 1
"""Shorter stacks gain nothing from the copy."""

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_load_state_dict_pre_hooks")


CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Module containers a stack can sit in. Both keep their blocks in `_modules` under string keys, in the
order their forward iterates them (a list's keys are "0", "1", ...; a dict's are the user's, in insertion
order), so a stack is its container's path and keys whatever the container."""


@dataclass(frozen=True, slots=True)
class Stack:
    path: str
    """FQN of the container (`model.layers`)."""
    keys: tuple[str, ...]
    """The blocks' names in the container, in iteration order: block k is the submodule `path.keys[k]`."""

    @property
    def length(self) -> int:
        return len(self.keys)

    def block(self, k: int) -> str:
        return f"{self.path}.{self.keys[k]}" if self.path else self.keys[k]


def repeated_stacks(model: nn.Module) -> list[Stack]:
    """The outermost containers (`CONTAINERS`) of at least `MIN_LENGTH` identical blocks that own their parameters."""
    owners: dict[int, int] = {}
    for _, t in model.named_parameters(remove_duplicate=False):
        owners[id(t)] = owners.get(id(t), 0) + 1
    for _, t in model.named_buffers(remove_duplicate=False):
        owners[id(t)] = owners.get(id(t), 0) + 1
    found: list[Stack] = []
    for name, module in model.named_modules():
        if type(module) not in CONTAINERS or len(module) < MIN_LENGTH:
            continue
        if any(name == s.path or name.startswith(s.path + ".") or not s.path for s in found):
            continue
        keys, blocks = tuple(module._modules), list(module._modules.values())
        if any(b is None for b in blocks):
            continue  # an emptied slot (None) is no block
        tensors = [t for b in blocks for _, t in [*b.named_parameters(remove_duplicate=False), *b.named_buffers(remove_duplicate=False)]]
        if any(owners[id(t)] != 1 for t in tensors):
            continue  # a tensor shared between blocks (or with the rest of the model) is not one block's own
        if _identical(blocks):
            found.append(Stack(name, keys))
        else:
            log.debug("the blocks of %s differ; tracing each of them", name)
    return found


def _identical(blocks: list[nn.Module]) -> bool:
    """Same structure in every block, up to index attributes."""
    signatures = [_signature(b) for b in blocks]
    if any(s.keys() != signatures[0].keys() for s in signatures):
        return False
    for key in signatures[0]:
        values = [s[key] for s in signatures]
        if all(_same(v, values[0]) for v in values):
            continue
        if all(type(v) is int for v in values) and len({v - k for k, v in enumerate(values)}) == 1:
            continue  # an index attribute (layer_idx): the trace of blocks 1 and 2 shows whether arithmetic uses it
        return False
    return True


def _signature(block: nn.Module) -> dict[tuple, object]:
    sig: dict[tuple, object] = {}
    for path, m in block.named_modules(remove_duplicate=False):
        sig[(path, "class")] = type(m)
        for name, t in m._parameters.items():
            sig[(path, "param", name)] = None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in m._buffers.items():
            sig[(path, "buffer", name)] = None if t is None else (tuple(t.shape), t.dtype, name in m._non_persistent_buffers_set)
        for hooks in _HOOKS:
            sig[(path, hooks)] = tuple(getattr(h, "__qualname__", repr(h)) for h in getattr(m, hooks, {}).values())
        for name, value in vars(m).items():
            if not name.startswith("_"):
                sig[(path, "attr", name)] = value
    return sig


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - an object that cannot compare is not known to be equal
        return False
    return equal is True


@contextlib.contextmanager
def truncated(model: nn.Module, stacks: list[Stack]) -> Iterator[None]:
    """`model` with each stack cut to its first `KEPT` blocks (the same block objects)."""
    saved = []
    try:
        for s in stacks:
            parent, _, name = s.path.rpartition(".")
            owner = model.get_submodule(parent)
            full = owner._modules[name]
            cut = type(full)()
            for key in s.keys[:KEPT]:
                cut.add_module(key, full._modules[key])
            saved.append((owner, name, full))
            owner._modules[name] = cut
        yield
    finally:
        for owner, name, full in reversed(saved):
            owner._modules[name] = full


@dataclass(frozen=True, slots=True)
class Copied:
    specs: list[InputSpec]
    """The program's input specs, with the copies' parameters and buffers."""
    source: dict[str, str]
    """Name of each new fx node -> the node of block `KEPT - 1` it copies."""


def replicate(gm: fx.GraphModule, specs: list[InputSpec], stack: Stack, path_of: Callable[[fx.Node], str],
              grads: dict[str, tuple[bool, ...]]) -> Copied | None:
    """Copy block `KEPT - 1` of `stack` in the program of the cut model until the stack has its full length.

    `grads`: which outputs of each node carry gradients; blocks 1 and 2 must agree on them too.
    Returns None, changing nothing, when the program does not have the shape a copy can extend (the
    caller then traces the whole model)."""
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    pos = {n: i for i, n in enumerate(ops)}
    lead = stack.path + "." if stack.path else ""
    index = {key: k for k, key in enumerate(stack.keys[:KEPT])}

    def block_of(n: fx.Node) -> int | None:
        path = path_of(n)
        return index.get(path[len(lead):].partition(".")[0]) if path.startswith(lead) else None

    blocks = [block_of(n) for n in ops]
    starts = [blocks.index(k) if k in blocks else None for k in range(KEPT)]
    if None in starts or any(n.op != "call_function" for n in ops):
        return None
    s1, s2 = starts[1], starts[2]
    period = s2 - s1
    seg1, seg2 = ops[s1:s2], ops[s2:s2 + period]
    if len(seg2) != period or any(b not in (1, None) for b in blocks[s1:s2]) or any(b not in (2, None) for b in blocks[s2:s2 + period]):
        return None
    if any(b in (1, 2) for b in blocks[:s1]) or any(b is not None for b in blocks[s2 + period:]):
        return None
    at1, at2 = {n: j for j, n in enumerate(seg1)}, {n: j for j, n in enumerate(seg2)}
    target = {s.arg.name: s.target for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
    own1, own2 = stack.block(1) + ".", stack.block(2) + "."

    def corresponds(a1: object, a2: object) -> bool:
        """Does block 2's argument `a2` stand where block 1's `a1` stands?"""
        if not isinstance(a1, fx.Node) or not isinstance(a2, fx.Node):
            return not isinstance(a1, fx.Node) and not isinstance(a2, fx.Node) and type(a1) is type(a2) and repr(a1) == repr(a2)
        if a1 in at1:
            return at2.get(a2) == at1[a1]
        t1 = target.get(a1.name, "")
        if t1.startswith(own1):
            return target.get(a2.name) == own2 + t1[len(own1):]
        if a2 is a1:
            return True  # computed before the stack (or its first block) and read by every block
        return a1 in pos and a2 in at1 and pos[a2] == pos[a1] + period  # handed from one block to the next

    for n1, n2 in zip(seg1, seg2):
        flat1, spec1 = pytree.tree_flatten((n1.args, n1.kwargs))
        flat2, spec2 = pytree.tree_flatten((n2.args, n2.kwargs))
        if (n1.target != n2.target or spec1 != spec2 or not all(map(corresponds, flat1, flat2)) or _shapes(n1) != _shapes(n2)
                or grads.get(n1.name) != grads.get(n2.name)):
            return None
    tail = set(ops[s2 + period:]) | {n for n in gm.graph.nodes if n.op == "output"}
    if any(u not in at1 and u not in at2 for n in seg1 for u in n.users):
        return None  # a value from inside block 1 read after block 2: not a chain of blocks
    if any(u not in at2 and u not in tail for n in seg2 for u in n.users):
        return None

    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    own_specs = [s for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and s.target.startswith(own2)]
    new_specs, source = list(specs), {}
    param_of: list[dict[fx.Node, fx.Node]] = [{} for _ in range(stack.length)]
    for kind in (InputKind.PARAMETER, InputKind.BUFFER):
        mine = [s for s in own_specs if s.kind == kind]
        if not mine:
            continue
        anchor, at = placeholders[mine[-1].arg.name], new_specs.index(mine[-1])
        for k in range(KEPT, stack.length):
            for s in mine:
                fqn = stack.block(k) + "." + s.target[len(own2):]
                name = _renamed(s.arg.name, stack, k)
                with gm.graph.inserting_after(anchor):
                    anchor = gm.graph.placeholder(name)
                anchor.meta = copy.copy(placeholders[s.arg.name].meta)
                if anchor.name != name:
                    return _undo(gm, param_of)
                param_of[k][placeholders[s.arg.name]] = anchor
                source[name] = s.arg.name
                at += 1
                new_specs.insert(at, InputSpec(kind=kind, arg=TensorArgument(name=name), target=fqn, persistent=s.persistent))

    previous, stop = seg2, seg2[-1].next  # the copies go between block 2 and what follows the stack
    for k in range(KEPT, stack.length):
        env: dict[fx.Node, fx.Node] = {}

        def mapped(a: fx.Node) -> fx.Node:
            if a in env:
                return env[a]
            if a in at1:
                return previous[at1[a]]
            return param_of[k].get(a, a)

        with gm.graph.inserting_before(stop):
            for n in seg2:
                env[n] = gm.graph.node_copy(n, mapped)
                env[n].meta = _moved_meta(n.meta, stack, k)
                source[env[n].name] = n.name
        previous = [env[n] for n in seg2]
    for n in seg2:
        for user in list(n.users):
            if user in tail:
                user.replace_input_with(n, previous[at2[n]])
    gm.graph.lint()  # the caller recompiles once it is done with the graph
    return Copied(new_specs, source)


def _undo(gm: fx.GraphModule, param_of: list[dict[fx.Node, fx.Node]]) -> None:
    for added in param_of:
        for node in added.values():
            gm.graph.erase_node(node)
    return None


def _shapes(n: fx.Node) -> tuple:
    vals = pytree.tree_leaves(n.meta.get("val"))
    return tuple((tuple(v.shape), v.dtype, tuple(v.stride())) if hasattr(v, "shape") else repr(v) for v in vals)


@functools.lru_cache(maxsize=65536)  # the same module paths recur in every node's meta
def _renamed(text: str, stack: Stack, k: int) -> str:
    """`text` (a placeholder name or a module path) with block `KEPT - 1` of `stack` renamed block k."""
    dotted = re.escape(stack.block(KEPT - 1)) + r"(?=\.|$)"
    flat = re.escape(stack.block(KEPT - 1).replace(".", "_")) + r"(?=_|$)"
    text = re.sub(dotted, stack.block(k), text)
    return re.sub(flat, stack.block(k).replace(".", "_"), text)


def _moved_meta(meta: dict, stack: Stack, k: int) -> dict:
    out = copy.copy(meta)
    if "nn_module_stack" in meta:
        out["nn_module_stack"] = {_renamed(key, stack, k): (_renamed(path, stack, k), cls) for key, (path, cls) in meta["nn_module_stack"].items()}
    return out
