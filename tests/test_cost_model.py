"""Analytic cost model: collectives, link mapping, FLOP formulas, roofline, memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from meshplan.cost_model.collectives import COLLECTIVE_KINDS, LOCAL_KINDS, collective_time
from meshplan.cost_model.compute import BACKWARD_FACTOR, attention_pairs, is_view, op_bytes, op_flops, op_time, roofline_time
from meshplan.cost_model.memory import MemoryBreakdown, format_bytes, optimizer_state_bytes
from meshplan.cost_model.presets import ClusterPreset, DevicePreset, LinkPreset, get_cluster
from meshplan.ir.graph import TensorMeta

LINK = LinkPreset(name="test", latency_s=1e-5, bandwidth=1e9)


def f32(*shape: int) -> TensorMeta:
    return TensorMeta(shape, "float32")


# --- collectives -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("all_reduce", 2 * 3 / 4 * 8000 / 1e9 + 6 * 1e-5),
        ("all_gather", 3 / 4 * 8000 / 1e9 + 3 * 1e-5),
        ("reduce_scatter", 3 / 4 * 8000 / 1e9 + 3 * 1e-5),
        ("all_to_all", 3 / 4 * 8000 / 1e9 + 3 * 1e-5),
        ("send_recv", 8000 / 1e9 + 1e-5),
    ],
)
def test_collective_formulas(kind, expected):
    assert collective_time(kind, 8000, 4, LINK) == pytest.approx(expected, rel=1e-12)


def test_collective_zero_cases():
    for kind in COLLECTIVE_KINDS:
        assert collective_time(kind, 10**6, 1, LINK) == 0.0
    for kind in LOCAL_KINDS:
        assert collective_time(kind, 10**6, 8, LINK) == 0.0
    assert set(LOCAL_KINDS) == {"chunk", "pad", "scale"}


def test_collective_unknown_kind():
    with pytest.raises(ValueError, match=r"'broadcastt'.*all_reduce.*chunk"):
        collective_time("broadcastt", 100, 2, LINK)
    with pytest.raises(ValueError, match="group_size"):
        collective_time("all_reduce", 100, 0, LINK)


@given(
    kind=st.sampled_from(COLLECTIVE_KINDS),
    nbytes=st.integers(1, 10**10),
    extra=st.integers(1, 10**9),
    n=st.integers(2, 1024),
)
def test_collective_grows_with_bytes_and_group(kind, nbytes, extra, n):
    t = collective_time(kind, nbytes, n, LINK)
    assert collective_time(kind, nbytes + extra, n, LINK) > t
    grown = collective_time(kind, nbytes, n + 1, LINK)
    assert grown >= t if kind == "send_recv" else grown > t


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    parts = collective_time("reduce_scatter", 4096, 8, LINK) + collective_time("all_gather", 4096, 8, LINK)
    assert collective_time("all_reduce", 4096, 8, LINK) == pytest.approx(parts)


def test_cpu_preset_reproduces_the_gloo_figures_it_was_fit_to():
    """The `cpu` link's alpha and beta were fit to DESIGN.md's gloo loopback figures (4 MiB all-reduce: about
    6 ms on 2 ranks, 11 ms on 4); this guards the fit against edits. It measures nothing: how well the preset
    describes a machine is `meshplan validate`'s job (docs/cost_model.md)."""
    link = get_cluster("cpu").link_for_axis((2,), 0)
    for world, design_md in ((2, 6e-3), (4, 11e-3)):
        assert collective_time("all_reduce", 4 * 2**20, world, link) == pytest.approx(design_md, rel=0.2)


# --- presets -----------------------------------------------------------------------------------


def test_link_for_axis_h100():
    h100 = get_cluster("h100")
    assert h100.link_for_axis((16, 8), 1) is h100.intra_node
    assert h100.link_for_axis((16, 8), 0) is h100.inter_node
    assert h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    assert all(h100.link_for_axis((2, 2, 2), a) is h100.intra_node for a in range(3))
    assert h100.link_for_axis((4, 4), 0) is h100.inter_node  # 16 ranks > 8 per node
    assert h100.link_for_axes((16, 8), (0, 1)) is h100.inter_node
    assert h100.link_for_axes((2, 4), (0, 1)) is h100.intra_node
    with pytest.raises(ValueError, match="out of range"):
        h100.link_for_axis((16, 8), 2)


def test_get_cluster():
    h100 = get_cluster("h100")
    assert isinstance(h100, ClusterPreset) and h100.devices_per_node == 8
    assert get_cluster(h100) is h100
    assert h100.device.peak("bfloat16") == 989e12 and h100.device.peak("float32") == 67e12
    with pytest.raises(ValueError, match=r"^unknown cluster 'x'; known: a100, cpu, h100, h200$"):
        get_cluster("x")
    assert get_cluster("H100") is h100  # names in any case


def test_an_unknown_cluster_fails_before_the_presets_warning(caplog):
    import logging

    import meshplan
    from meshplan.models import mlp_small

    model, x = mlp_small()
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="unknown cluster 'H1000'"):
        meshplan.plan(model, 2, (x,), cluster="H1000")
    assert "presets" not in caplog.text


# --- compute -----------------------------------------------------------------------------------


def test_matmul_flops_exact():
    assert op_flops("aten.mm.default", [f32(4, 3), f32(3, 5)], [f32(4, 5)]) == 120
    assert op_flops("aten.addmm.default", [f32(5), f32(4, 3), f32(3, 5)], [f32(4, 5)]) == 120
    assert op_flops("aten.bmm.default", [f32(2, 4, 3), f32(2, 3, 5)], [f32(2, 4, 5)]) == 240
    assert op_flops("aten.baddbmm.default", [f32(2, 4, 5), f32(2, 4, 3), f32(2, 3, 5)], [f32(2, 4, 5)]) == 240
    assert op_bytes("aten.mm.default", [f32(4, 3), f32(3, 5)], [f32(4, 5)]) == (12 + 15 + 20) * 4


def test_sdpa_flops_exact():
    q, kv = f32(2, 3, 4, 8), f32(2, 3, 6, 8)
    expected = 4 * 2 * 3 * 4 * 6 * 8
    assert op_flops("aten.scaled_dot_product_attention.default", [q, kv, kv], [q]) == expected
    cpu_target = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert op_flops(cpu_target, [q, kv, kv], [q, f32(2, 3, 4)]) == expected


def test_causal_sdpa_flops_count_the_pairs_the_mask_keeps():
    """SDPA's is_causal mask is `ones(L, S).tril()` (upper-left aligned); the flash and memory-efficient kernels skip
    what it masks, so a causal op costs its kept pairs, about half the rectangle, on every attention op name."""
    for rows, keys in ((4, 6), (6, 4), (5, 5), (1, 7), (7, 1)):
        assert attention_pairs(rows, keys, True) == int(torch.ones(rows, keys).tril().sum())
        assert attention_pairs(rows, keys, False) == rows * keys
    q, kv = f32(2, 3, 4, 8), f32(2, 3, 6, 8)
    for target in ("aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
                   "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default"):
        assert op_flops(target, [q, kv, kv], [q], causal=True) == 4 * 2 * 3 * 10 * 8  # queries 0..3 see 1+2+3+4 keys
        assert op_flops(target, [q, kv, kv], [q]) == 4 * 2 * 3 * 24 * 8
    with pytest.raises(ValueError, match="causal=True prices attention ops .*; got 'aten.mm.default'"):
        op_flops("aten.mm.default", [f32(4, 3), f32(3, 5)], [f32(4, 5)], causal=True)


class _Attend(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):  # [batch, heads, seq, 64]
        q = self.proj(x)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=self.causal)


def test_causal_attention_is_planned_at_the_pairs_its_mask_keeps():
    """The traced op remembers is_causal (`Node.attrs`), and its plan prices the kept pairs: (S+1)/2S of the same
    op without the mask, at a compute-bound size on the H100 presets."""
    import warnings

    import meshplan
    from meshplan.ir.trace import trace

    seq = 4096
    x = torch.randn(1, 8, seq, 64, device="meta")
    attention = {}
    for causal in (False, True):
        with torch.device("meta"):
            model = _Attend(causal)
        node = next(n for n in trace(model, (x,)).nodes if n.target == "aten.scaled_dot_product_attention.default")
        assert node.attrs == ((("is_causal", True),) if causal else ())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = meshplan.plan(model, 1, (x,), cluster="h100")
        attention[causal] = next(n.time_s for n in plan.nodes if n.target == node.target)
    assert attention[True] == pytest.approx(attention[False] * (seq + 1) / (2 * seq))


def test_norm_softmax_conv_and_default_flops():
    x = f32(2, 4, 8)
    assert op_flops("aten.native_layer_norm.default", [x, f32(8), f32(8)], [x, f32(2, 4, 1), f32(2, 4, 1)]) == 8 * 64
    assert op_flops("aten._softmax.default", [x], [x]) == 5 * 64
    conv_out = f32(1, 16, 6, 6)
    assert op_flops("aten.convolution.default", [f32(1, 3, 8, 8), f32(16, 3, 3, 3), f32(16)], [conv_out]) == 2 * 576 * 27
    assert op_flops("aten.add.Tensor", [x, f32(8)], [x]) == 64  # broadcasting pointwise: output elements
    assert op_flops("aten.sum.default", [x], [f32()]) == 64  # reduction: input elements
    assert op_flops("aten.embedding.default", [f32(100, 8), TensorMeta((2, 4), "int64")], [x]) == 0


def test_flops_agree_with_torch_flop_counter():
    a, b, bias = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    x, w = torch.randn(1, 3, 8, 8), torch.randn(16, 3, 3, 3)
    cases = [
        ("aten.mm.default", lambda: torch.mm(a, b), [a, b]),
        ("aten.addmm.default", lambda: torch.addmm(bias, a, b), [bias, a, b]),
        ("aten.bmm.default", lambda: torch.bmm(a[None], b[None]), [a[None], b[None]]),
        ("aten.convolution.default", lambda: torch.conv2d(x, w), [x, w]),
    ]
    for target, fn, args in cases:
        with FlopCounterMode(display=False) as counter:
            out = fn()
        ours = op_flops(target, [TensorMeta.of(t) for t in args], [TensorMeta.of(out)])
        assert ours == counter.get_total_flops(), target


def test_views_are_free():
    x = f32(4, 8)
    for target in ("aten.view.default", "aten._unsafe_view.default", "aten.permute.default", "aten.t.default",
                   "aten.transpose.int", "aten.expand.default", "aten.slice.Tensor", "aten.detach.default",
                   "aten.split_with_sizes.default", "aten.select.int", "aten.alias.default"):
        assert is_view(target), target
        assert op_flops(target, [x], [x]) == 0 and op_bytes(target, [x], [x]) == 0
        assert op_time(target, [x], [x], get_cluster("h100").device) == 0
    assert not is_view("aten.mm.default") and not is_view("aten.clone.default")


def test_roofline_picks_max():
    dev = DevicePreset(name="d", peak_flops={"float32": 1e12, "bfloat16": 4e12}, memory_bandwidth=1e11, memory_bytes=2**30)
    assert roofline_time(1e9, 1e6, dev, "float32") == pytest.approx(1e-3)  # compute-bound
    assert roofline_time(1e9, 1e6, dev, "bfloat16") == pytest.approx(2.5e-4)
    assert roofline_time(1e3, 1e9, dev, "float32") == pytest.approx(1e-2)  # memory-bound
    assert roofline_time(1e3, 1e9, dev, "int64") == pytest.approx(1e-2)  # falls back to the float32 peak
    with pytest.raises(ValueError, match="no peak for dtype 'fp8ish'"):
        roofline_time(1.0, 1.0, dev, "fp8ish")
    assert BACKWARD_FACTOR == 2.0


# --- memory ------------------------------------------------------------------------------------


def test_memory_breakdown():
    mib = 2**20
    m = MemoryBreakdown(params=mib, grads=mib, optimizer=2 * mib, activations=3 * mib + mib // 10)
    assert m.total == 7 * mib + mib // 10
    assert str(m) == "params 1.0 MiB + grads 1.0 MiB + optimizer 2.0 MiB + activations 3.1 MiB = 7.1 MiB"
    assert MemoryBreakdown.from_dict(m.to_dict()) == m
    assert eval(repr(m)) == m
    with pytest.raises(ValueError, match="keys"):
        MemoryBreakdown.from_dict({"params": 1})
    with pytest.raises(ValueError, match="grads"):
        MemoryBreakdown(params=0, grads=-1, optimizer=0, activations=0)
    w = MemoryBreakdown(params=mib, grads=0, optimizer=0, activations=0, workspace=64 * mib)
    assert w.total == 65 * mib and str(w).endswith("workspace 64.0 MiB = 65.0 MiB")
    saved_before = {k: v for k, v in m.to_dict().items() if k != "workspace"}  # a plan saved before workspaces counted
    assert MemoryBreakdown.from_dict(saved_before) == m


def test_a_gpu_plan_holds_the_math_libraries_workspace():
    """cuBLAS/cuBLASLt workspaces: measured 64.0 MiB on an H200 (benchmarks/gpu_check.py), in no tensor of a plan."""
    import meshplan
    from meshplan.models import mlp_small

    model, inputs = mlp_small()
    gpu, cpu = (meshplan.plan(model, 2, inputs, cluster=c) for c in ("h100", "cpu"))
    assert gpu.memory.workspace == get_cluster("h100").device.library_workspace_bytes == 64 * 2**20
    assert cpu.memory.workspace == 0
    assert gpu.memory.total - cpu.memory.total >= 64 * 2**20 - 2**20  # the same tiny model's tensors, give or take dtypes


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(80 * 2**30) == "80.0 GiB"


def test_optimizer_state_bytes():
    assert optimizer_state_bytes(1000) == 8000  # adam: exp_avg + exp_avg_sq, fp32
    assert optimizer_state_bytes(1000, "adamw") == 8000
    assert optimizer_state_bytes(1000, "sgd") == 0
    assert optimizer_state_bytes(1000, "sgd_momentum") == 4000
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_state_bytes(10, "lion")


def test_pointwise_work_on_partial_sums_is_not_split():
    """A residual add of two partial tensors runs on whole-sized local tensors on every device; a matmul whose
    contraction dim is split gives partial sums from a split of the work."""
    from meshplan.cost_model.estimate import compute_time
    from meshplan.ir.placement import Partial, Replicate, Shard

    h100 = get_cluster("h100")
    x = TensorMeta((64, 4096), "float32")
    w = TensorMeta((4096, 4096), "float32")
    whole = compute_time("aten.add.Tensor", [x, x], [x], [(Replicate(),)], (8,), h100, backward=False, in_layouts=[(Replicate(),)] * 2)
    partial = compute_time("aten.add.Tensor", [x, x], [x], [(Partial(),)], (8,), h100, backward=False, in_layouts=[(Partial(),)] * 2)
    assert partial == pytest.approx(whole)
    mm_whole = compute_time("aten.mm.default", [x, w], [x], [(Replicate(),)], (8,), h100, backward=False,
                            in_layouts=[(Replicate(),), (Replicate(),)])
    mm_split = compute_time("aten.mm.default", [x, w], [x], [(Partial(),)], (8,), h100, backward=False,
                            in_layouts=[(Shard(1),), (Shard(0),)])
    assert mm_split == pytest.approx(mm_whole / 8)
