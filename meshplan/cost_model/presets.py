"""Hardware presets: the only place hardware numbers live.

A cluster is one kind of device, a number of devices per node, and two links: a fast one inside a
node and a slower one between nodes. Mesh axes map onto links innermost-first (DESIGN.md: the
innermost mesh axis is the fastest), so the cost model asks the cluster which link an axis uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshplan.cost_model.profile import Profile


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicePreset:
    """One accelerator (or CPU rank): compute peaks, memory bandwidth and capacity."""

    name: str
    """Short label printed in plans (`"H100-SXM5-80GB"`)."""
    peak_flops: dict[str, float]
    """dtype name (`"float32"`, `"bfloat16"`, `"float16"`) -> dense FLOP/s one device can sustain."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s (reads + writes together)."""
    memory_bytes: int
    """Memory one device can use, in bytes; the planner's per-device budget."""
    host_link_bandwidth: float | None = None
    """Bytes/s each way between this device and host memory (PCIe); None: the device's memory is host
    memory (a CPU rank), so there is nowhere to offload to."""
    host_memory_bandwidth: float | None = None
    """Host memory bytes/s available to this device's share of the host CPUs (runs offloaded optimizer steps)."""
    library_workspace_bytes: int = 0
    """Bytes the math libraries keep allocated in each process once a matrix product has run (cuBLAS's and
    cuBLASLt's workspaces come from torch's allocator): held through every step, in no tensor of a plan. 0 where
    not measured."""

    def peak(self, dtype: str) -> float:
        """FLOP/s for `dtype`. Other real torch dtypes (int64 indices, bool masks, float64) use the
        float32 peak: such ops are memory-bound, so the exact figure rarely matters."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if isinstance(getattr(torch, dtype, None), torch.dtype) and "float32" in self.peak_flops:
            return self.peak_flops["float32"]
        raise ValueError(
            f"device {self.name!r} has no peak for dtype {dtype!r}; known: {', '.join(self.peak_flops)}"
        )

    @property
    def default_precision(self) -> str:
        """'bf16' where this device's bf16 peak beats its fp32 peak (GPUs), else 'fp32' (`mixed_precision='auto'`)."""
        return "bf16" if self.peak("bfloat16") > self.peak("float32") else "fp32"


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkPreset:
    """A communication link in the alpha-beta model: time = alpha + bytes / bandwidth."""

    name: str
    """Short label (`"NVLink4"`)."""
    latency_s: float
    """alpha: fixed cost of one message/hop in seconds."""
    bandwidth: float
    """beta^-1: bytes/s one device can send over this link (one direction)."""
    call_overhead_s: float = 0.0
    """Fixed cost of issuing one collective (kernel launch, protocol handshake), paid once per call
    on top of the per-hop latency: what makes one all-reduce cheaper than the two collectives it equals."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterPreset:
    """Identical devices grouped in nodes, a fast link inside a node and a slower one between."""

    name: str
    """Name `get_cluster` knows it by (`"h100"`)."""
    device: DevicePreset
    """Every device of the cluster."""
    devices_per_node: int
    """Devices that share the intra-node link."""
    intra_node: LinkPreset
    """Link between devices of one node."""
    inter_node: LinkPreset
    """Link between nodes (per device)."""
    profile: Profile | None = None
    """Measured op times and collective fits (`meshplan profile ...`); None: presets only. Costs
    use a measurement where the profile has one and these presets everywhere else."""
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """(mesh shape, axes) -> `link_for_axes`: a cache, not configuration."""

    def with_profile(self, profile: Profile | None) -> ClusterPreset:
        """This cluster with `profile`: itself when it has that profile already (planning without a profile prices
        with the preset itself, and its caches serve every plan)."""
        return self if profile is self.profile else replace(self, profile=profile)

    def link_for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> LinkPreset:
        """The link a collective over mesh axis `axis` uses.

        Ranks are row-major, so axis `a` moves between ranks `prod(mesh_shape[a+1:])` apart and its
        groups live inside `prod(mesh_shape[a:])` consecutive ranks; if those fit in one node the
        whole group is intra-node.
        """
        if not mesh_shape or any((not isinstance(n, int)) or n < 1 for n in mesh_shape):
            raise ValueError(f"mesh shape {mesh_shape!r} is invalid; expected a tuple of positive ints")
        if not (isinstance(axis, int) and 0 <= axis < len(mesh_shape)):
            raise ValueError(f"mesh axis {axis!r} is out of range for mesh shape {mesh_shape}; allowed 0..{len(mesh_shape) - 1}")
        if math.prod(mesh_shape[axis:]) <= self.devices_per_node:
            return self.intra_node
        return self.inter_node

    def link_for_axes(self, mesh_shape: tuple[int, ...], axes: tuple[int, ...]) -> LinkPreset:
        """The link of a group spanning several axes: the slowest of theirs (a ring is as slow as
        its slowest hop)."""
        if not axes:
            raise ValueError("link_for_axes needs at least one mesh axis; got none")
        key = (tuple(mesh_shape), tuple(axes))
        link = self._links.get(key)
        if link is None:  # memoised: the planner asks this for every collective it prices
            links = [self.link_for_axis(mesh_shape, a) for a in axes]
            link = self._links[key] = min(links, key=lambda link: (link.bandwidth, -link.latency_s))
        return link


# --- H100 --------------------------------------------------------------------------------------
# Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5 column) and the NVIDIA DGX H100 user guide.
# bf16/fp16 are the dense (no sparsity) tensor-core peaks. float32 uses the non-tensor-core 67
# TFLOP/s rather than TF32's 494: torch defaults to allow_tf32=False for matmuls, and a cost
# model that is too optimistic about compute over-favours sharding that saves memory traffic.
HOPPER_WORKSPACE_BYTES = 64 * 2**20
"""Measured on an H200 by benchmarks/gpu_check.py (runs 7 and 8, torch 2.11: 64.0 MiB held after one bf16 matrix
product and its backward, in a fresh process). The H100 is the same chip to the libraries."""
H100_SXM = DevicePreset(
    name="H100-SXM5-80GB",
    peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
    memory_bandwidth=3.35e12,  # HBM3
    memory_bytes=80 * 2**30,
    # PCIe Gen5 x16: 128 GB/s bidirectional (H100 datasheet) = 64 GB/s each way. DGX H100 host: two Xeon
    # 8480C, 8 channels of DDR5-4800 each (2 x 307 GB/s) shared by 8 GPUs: ~77 GB/s per GPU.
    host_link_bandwidth=64e9,
    host_memory_bandwidth=77e9,
    library_workspace_bytes=HOPPER_WORKSPACE_BYTES,
)
# NVLink 4 / NVSwitch: 900 GB/s bidirectional per GPU = 450 GB/s each way; a few us per hop.
# Every NCCL collective is at least one CUDA kernel launch (~5 us, CUDA C programming guide's
# launch-overhead figures for H100-class GPUs) before any data moves.
NVLINK4 = LinkPreset(name="NVLink4", latency_s=3e-6, bandwidth=450e9, call_overhead_s=5e-6)
# One ConnectX-7 InfiniBand NDR port per GPU: 400 Gb/s = 50 GB/s; ~5-10 us through the switch.
IB_NDR = LinkPreset(name="IB-NDR400", latency_s=8e-6, bandwidth=50e9, call_overhead_s=5e-6)

DGX_H100 = ClusterPreset(name="h100", device=H100_SXM, devices_per_node=8, intra_node=NVLINK4, inter_node=IB_NDR)

# --- H200 --------------------------------------------------------------------------------------
# Sources: NVIDIA H200 Tensor Core GPU datasheet (SXM column) and the DGX H200 datasheet. Same
# Hopper compute as the H100 SXM (989 TFLOP/s dense bf16, 67 TFLOP/s fp32 without TF32); 141 GB of
# HBM3e at 4.8 TB/s. A DGX H200 has the same NVLink 4 / NVSwitch fabric (900 GB/s bidirectional)
# and eight ConnectX-7 400 Gb/s InfiniBand NDR ports (one per GPU) as the DGX H100.
H200_SXM = DevicePreset(
    name="H200-SXM-141GB",
    peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
    memory_bandwidth=4.8e12,
    memory_bytes=141 * 10**9,
    host_link_bandwidth=64e9,  # PCIe Gen5 x16 and the DGX H200's host, as for the DGX H100
    host_memory_bandwidth=77e9,
    library_workspace_bytes=HOPPER_WORKSPACE_BYTES,
)
DGX_H200 = ClusterPreset(name="h200", device=H200_SXM, devices_per_node=8, intra_node=NVLINK4, inter_node=IB_NDR)

# --- A100 --------------------------------------------------------------------------------------
# Sources: NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column) and the DGX A100 user guide.
# bf16/fp16 dense tensor-core peak 312 TFLOP/s; fp32 without TF32 19.5 TFLOP/s (see the H100 note);
# HBM2e 2,039 GB/s. NVLink 3 / NVSwitch: 600 GB/s bidirectional per GPU = 300 GB/s each way. DGX
# A100: eight ConnectX-6 HDR 200 Gb/s InfiniBand ports (one per GPU) = 25 GB/s each way.
A100_80GB = DevicePreset(
    name="A100-SXM4-80GB",
    peak_flops={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
    memory_bandwidth=2.039e12,
    memory_bytes=80 * 2**30,
    # PCIe Gen4 x16: 64 GB/s bidirectional (A100 datasheet) = 32 GB/s each way. DGX A100 host: two EPYC
    # 7742, 8 channels of DDR4-3200 each (2 x 205 GB/s) shared by 8 GPUs: ~51 GB/s per GPU.
    host_link_bandwidth=32e9,
    host_memory_bandwidth=51e9,
)
NVLINK3 = LinkPreset(name="NVLink3", latency_s=3e-6, bandwidth=300e9, call_overhead_s=5e-6)
IB_HDR = LinkPreset(name="IB-HDR200", latency_s=8e-6, bandwidth=25e9, call_overhead_s=5e-6)
DGX_A100 = ClusterPreset(name="a100", device=A100_80GB, devices_per_node=8, intra_node=NVLINK3, inter_node=IB_HDR)

# --- CPU (this development machine) ------------------------------------------------------------
# Measured 2026-11-21 on the 2-core AMD EPYC (AVX2+FMA, no AVX512-BF16) with torch 2.13.0, one
# thread per rank because the ranks share the two cores:
#   torch.mm 512x512, median of 30 runs: float32 ~68 GFLOP/s (1024x1024: 67-82);
#   bfloat16/float16 ~1.2 GFLOP/s (no native support: a slow fallback path, ~50x slower);
#   copy of a 64 MiB float32 tensor, median of 20: ~21-23 GB/s read+write.
CPU_RANK = DevicePreset(
    name="cpu-1thread",
    peak_flops={"float32": 68e9, "bfloat16": 1.2e9, "float16": 1.2e9},
    memory_bandwidth=21e9,
    memory_bytes=23 * 2**30,  # MemTotal 23.5 GiB, shared by every rank on the machine
)
# gloo over 127.0.0.1 (DESIGN.md facts): 4 MiB all_reduce ~6 ms (world 2), ~11 ms (4), ~31 ms (8).
# Ring model 2(n-1)/n*B/bw + 2(n-1)*alpha with alpha fixed at 75 us/hop, bw least-squares-fitted on
# worlds 2 and 4: bw ~630 MB/s -> predicts 6.8 / 10.4 / 12.6 ms. World 8 puts 4 ranks on each core,
# so measured time is ~2.5x the model there: CPU contention, not the link, which no link fits.
GLOO_LOOPBACK = LinkPreset(name="gloo-loopback", latency_s=75e-6, bandwidth=630e6)
CPU_GLOO = ClusterPreset(
    name="cpu", device=CPU_RANK, devices_per_node=8, intra_node=GLOO_LOOPBACK, inter_node=GLOO_LOOPBACK
)

CLUSTERS: Mapping[str, ClusterPreset] = MappingProxyType(
    {"cpu": CPU_GLOO, "a100": DGX_A100, "h100": DGX_H100, "h200": DGX_H200}
)
"""Named presets, by the name `get_cluster` accepts."""
DEVICES: Mapping[str, DevicePreset] = MappingProxyType(
    {"A100-80GB": A100_80GB, "H100-SXM": H100_SXM, "H200": H200_SXM, "cpu": CPU_RANK}
)
"""Device presets by short name (each is also the device of the cluster preset of its kind)."""


def cluster_of(profile: Profile | None) -> ClusterPreset:
    """The preset `profile` calibrates, with it (the CPU preset without a profile)."""
    return get_cluster(profile.cluster if profile is not None else "cpu").with_profile(profile)


def get_cluster(name_or_preset: str | ClusterPreset) -> ClusterPreset:
    """A preset by name in any case (`"a100"`, `"H100"`, `"h200"`, `"cpu"`), or the given preset unchanged."""
    if isinstance(name_or_preset, ClusterPreset):
        return name_or_preset
    if isinstance(name_or_preset, str) and name_or_preset.lower() in CLUSTERS:
        return CLUSTERS[name_or_preset.lower()]
    raise ValueError(f"unknown cluster {name_or_preset!r}; known: {', '.join(sorted(CLUSTERS))}")
