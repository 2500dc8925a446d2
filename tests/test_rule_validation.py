"""Strategy validation: every sharding rule meshplan registers is checked against the op on one
device, over random shapes (hypothesis), like DTensor's strategy validation.

For each rule and each strategy it yields on a 1-D mesh of n simulated ranks: inputs are cut per
the strategy's input placements (Shard: rank r's chunk; Replicate: whole; Partial: rank 0 holds
the value, the others zeros), the op runs on each rank's local tensors (region ops through their
per-rank runtime module), and the outputs are put back together per the output placements
(Shard: concatenated; Replicate: every rank must hold the same tensor; Partial: summed) and
compared with the op on the whole inputs. Strategies whose op runs collectives of its own (SyncBN
over the batch, MoE expert parallelism, the vocabulary-parallel log-softmax kernel) need real
processes: tests/test_resnet.py, tests/test_moe.py and tests/test_vocab_parallel.py check those with gloo.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost_model.presets import get_cluster
from meshplan.ir.graph import Node, TensorMeta, TensorRef
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.op_kinds import RANDOM_OPS
from meshplan.ir.placement import Partial, Shard
from meshplan.ir.regions import RegionOp, region_op
from meshplan.planner.rules import RULES
from meshplan.planner.strategies import _compute_op_strategies, _device_mesh
from meshplan.regions import BUILTIN_REGIONS
from meshplan.regions.batch_norm import BATCH_NORM
from meshplan.regions.moe import MOE_OP

aten = torch.ops.aten
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
CHECKED: set[str] = set()


def candidate_strategies(op, args: tuple, n: int):
    """The strategies meshplan's planner generates for `op(*args)` on a mesh of n devices."""
    mesh = MeshSpec((n,), ("x",))
    with torch.no_grad():
        out = op(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    node = Node("op", "op", str(op), tuple(TensorRef(f"in{i}") for i in range(len(tensors))),
                tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outs),
                attrs=tuple(a for a in args if not isinstance(a, torch.Tensor)) if str(op).startswith("meshplan.") else ())
    metas = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    errors: list[str] = []
    found = _compute_op_strategies(op, (metas, {}), node, mesh, _device_mesh(mesh.shape), [], errors)
    assert not errors, f"{op}: the sharding rule raised {errors[0]}"
    return mesh, node, found


def _local_inputs(args: tuple, placements, n: int, rank: int) -> list:
    it = iter(placements)
    local = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            local.append(a)
            continue
        (p,) = next(it)
        if isinstance(p, Shard):
            a = a.chunk(n, dim=p.dim)[rank]
        elif isinstance(p, Partial):
            a = a if rank == 0 else torch.zeros_like(a)
        local.append(a.contiguous())
    return local


def _assemble(pieces: list[torch.Tensor], p) -> torch.Tensor:
    if isinstance(p, Shard):
        return torch.cat(pieces, dim=p.dim)
    if isinstance(p, Partial):
        return torch.stack(pieces).sum(0)
    for other in pieces[1:]:
        torch.testing.assert_close(other, pieces[0], rtol=0, atol=0, msg="ranks disagree on a replicated output")
    return pieces[0]


def validate(op, args: tuple, n: int, *, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-5) -> int:
    """Check every candidate strategy of `op(*args)` on n simulated ranks; returns how many were checked."""
    mesh, node, strategies = candidate_strategies(op, args, n)
    assert strategies, f"{op}: no strategy at all"
    torch.manual_seed(seed)
    whole = op(*args)
    whole = whole if isinstance(whole, (tuple, list)) else (whole,)
    checked = 0
    for s in strategies:
        metas = [TensorMeta.of(a) for a in args if isinstance(a, torch.Tensor)]
        region = region_op(op)
        own = region.cost(node, metas, s, mesh.shape, get_cluster("cpu"), backward=False) if region is not None else None
        if (own is not None and own.forward) or s.kernel:
            continue  # collectives of its own (a region's, or a kernel's): validated on real processes (module docstring)
        locals_ = []
        for rank in range(n):
            local = _local_inputs(args, s.inputs, n, rank)
            torch.manual_seed(seed)  # every rank holds the same generator state (runtime/parallel_module.py)
            comm = SimpleNamespace(mesh=mesh, coord=mesh.coordinate(rank), rank=rank)
            module = region.local_module(s, comm, args) if region is not None else None
            out = (module or op)(*local)
            locals_.append(out if isinstance(out, (tuple, list)) else (out,))
        for i, (want, p) in enumerate(zip(whole, s.outputs)):
            if p is None or not isinstance(want, torch.Tensor):
                continue
            got = _assemble([lo[i] for lo in locals_], p[0])
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{op} strategy {s} output {i}: {m}")
        checked += 1
    CHECKED.add(str(op))
    return checked


sizes = st.sampled_from([2, 4, 8])
mesh_n = st.sampled_from([2, 4])


@SETTINGS
@given(n=mesh_n, batch=sizes, cin=sizes, cout=sizes, hw=st.integers(3, 7), bias=st.booleans(), stride=st.sampled_from([1, 2]), pad=st.sampled_from([0, 1]))
def test_convolution_rules(n, batch, cin, cout, hw, bias, stride, pad):
    g = torch.Generator().manual_seed(batch * 100 + cin * 10 + cout)
    x, w = torch.randn(batch, cin, hw, hw, generator=g), torch.randn(cout, cin, 3, 3, generator=g)
    b = torch.randn(cout, generator=g) if bias else None
    checked = validate(aten.convolution.default, (x, w, b, [stride, stride], [pad, pad], [1, 1], False, [0, 0], 1), n)
    assert checked >= 1 + (batch % n == 0) + (cout % n == 0) + (not bias and cin % n == 0)


@SETTINGS
@given(n=mesh_n, batch=sizes, channels=sizes, hw=st.integers(1, 5), affine=st.booleans())
def test_batch_norm_rules(n, batch, channels, hw, affine):
    g = torch.Generator().manual_seed(batch * 10 + channels)
    x = torch.randn(batch, channels, hw, hw, generator=g)
    w, b = (torch.randn(channels, generator=g), torch.randn(channels, generator=g)) if affine else (None, None)
    rm, rv = torch.randn(channels, generator=g), torch.rand(channels, generator=g) + 0.5
    assert validate(BATCH_NORM, (x, w, b, rm, rv, True, 0.1, 1e-5), n) >= (2 if channels % n == 0 else 1)


@SETTINGS
@given(n=mesh_n, batch=sizes, heads=sizes, seq=st.sampled_from([4, 8]), dim=st.sampled_from([4, 8]), mask=st.sampled_from([None, "full", "broadcast"]))
def test_attention_rules(n, batch, heads, seq, dim, mask):
    g = torch.Generator().manual_seed(batch + heads + seq)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=g) for _ in range(3))
    args = (q, k, v)
    if mask == "full":
        args += (torch.randn(batch, heads, seq, seq, generator=g),)
    elif mask == "broadcast":
        args += (torch.randn(1, 1, seq, seq, generator=g),)
    assert validate(aten.scaled_dot_product_attention.default, args, n) >= 1 + (batch % n == 0) + (heads % n == 0)


@SETTINGS
@given(n=mesh_n, tokens=st.sampled_from([4, 8, 16]), experts=st.sampled_from([2, 4, 8]), top_k=st.sampled_from([1, 2]), normalize=st.booleans(), three_d=st.booleans())
def test_moe_rules(n, tokens, experts, top_k, normalize, three_d):
    g = torch.Generator().manual_seed(tokens * 10 + experts)
    x = torch.randn(2, tokens, 8, generator=g) if three_d else torch.randn(tokens, 8, generator=g)
    args = (x, torch.randn(experts, 8, generator=g), torch.randn(experts, 12, 8, generator=g), torch.randn(experts, 8, 6, generator=g), top_k, normalize, "silu")
    even_tokens = x.shape[0] % n == 0
    assert validate(MOE_OP, args, n) >= 1 + even_tokens + (experts % n == 0)  # replicated, tokens split, experts split


@SETTINGS
@given(n=mesh_n, rows=sizes, cols=sizes, p=st.sampled_from([0.1, 0.5]))
def test_random_rules(n, rows, cols, p):
    x = torch.empty(rows, cols)
    validate(aten.bernoulli_.float, (x, p), n, atol=0, rtol=0)
    validate(aten.rand_like.default, (x,), n, atol=0, rtol=0)
    validate(aten.native_dropout.default, (torch.randn(rows, cols), p, True), n, atol=0, rtol=0)


@SETTINGS
@given(n=mesh_n, rows=sizes, cols=sizes, src_kind=st.sampled_from(["same", "row", "column", "lower rank"]))
def test_copy_rules(n, rows, cols, src_kind):
    g = torch.Generator().manual_seed(rows * 10 + cols)
    dst = torch.randn(rows, cols, generator=g)
    src_shape = {"same": (rows, cols), "row": (1, cols), "column": (rows, 1), "lower rank": (cols,)}[src_kind]
    assert validate(aten.copy.default, (dst, torch.randn(src_shape, generator=g)), n) >= 1 + (rows % n == 0) + (cols % n == 0)


@SETTINGS
@given(n=mesh_n, rows=sizes, cols=sizes, three_d=st.booleans(), last=st.booleans())
def test_log_softmax_rules(n, rows, cols, three_d, last):
    g = torch.Generator().manual_seed(rows * 10 + cols)
    x = torch.randn(2, rows, cols, generator=g) if three_d else torch.randn(rows, cols, generator=g)
    dim = x.ndim - 1 if last else x.ndim - 2
    # rows that keep the softmax dim whole; the vocabulary-parallel kernel row runs all-reduces
    # (checked with parity on gloo ranks in tests/test_vocab_parallel.py)
    kept = sum(x.shape[d] % n == 0 for d in range(x.ndim) if d != dim)
    assert validate(aten._log_softmax.default, (x, dim, False), n) >= min(kept, 1)


def test_every_registered_rule_has_a_validation():
    """A new rule in meshplan/planner/rules/ or a new region op's rule must get a generator above."""
    covered = {str(op) for op in (aten.convolution.default, BATCH_NORM, aten.scaled_dot_product_attention.default, MOE_OP, aten.copy.default, aten._log_softmax.default)}
    covered |= {str(op) for op in RANDOM_OPS}
    ruled = set(RULES) | {str(op) for region in BUILTIN_REGIONS if type(region).rule is not RegionOp.rule for op in region.ops}
    missing = ruled - covered
    assert not missing, f"rules without a validation: {sorted(missing)}"
