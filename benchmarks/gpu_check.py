"""The GPU kit: what a lent CUDA machine must tell us, in one run of at most 10 minutes (issue 15).

    python benchmarks/gpu_check.py                    # on a CUDA machine: writes benchmarks/results/gpu_check-*.{json,md}
    python benchmarks/gpu_check.py --device cpu --quick   # the same steps on this CPU, tiny (the smoke test runs this)

Steps, on one device:
1. **Compute profile**: every op of a GPT (traced in bf16 mixed precision on CUDA, fp32 on the CPU)
   timed at its one-device shapes (`calibrate.profile_graph`), saved as a profile JSON.
2. **bf16 parity**: 3 Adam steps of `auto_parallelize(..., mixed_precision="bf16")` on one device
   against one process doing the same by hand (parameters cast with `functional_call`, logits to
   fp32). Each gradient's error must stay within 3 times its own bf16 noise (the distance between
   that reference and fp32 training), as in tests/test_mixed_precision.py.
3. **Predicted against measured**: the one-device plan of the same model with its loss inside its
   forward (so the whole step is in the plan, as benchmarks/memory_truth.py does), priced with the
   presets and with the profile of step 1 (and, to compare the methods of `op_profiler`'s module doc, with
   profiles timing each op's runs queued back to back, `op_profiler.QUEUED`, and one synchronised run each; and
   with step 1's profile without its host floor, `Profile.host_op_run_s`), against the median measured step (forward, backward, Adam
   step; `torch.cuda.synchronize` around each) and the measured peak (`max_memory_allocated`) against
   the plan's memory figure.

The report (JSON and markdown) goes to `--out` (default benchmarks/results/), named after the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not an installed meshplan

import torch
import torch.nn.functional as F
from torch.func import functional_call

import meshplan
from meshplan.cost_model.presets import get_cluster
from meshplan.cost_model.profile import device_name
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.precision import resolve_precision
from meshplan.ir.trace import trace
from meshplan.models import GPT, GPTConfig
from meshplan.profiling.calibrate import profile_graph
from meshplan.profiling.op_profiler import QUEUED
from meshplan.runtime.launch import run_local

MODELS = {
    # (config, batch): a GPT that keeps an H100 busy for a few ms per step, and a tiny one for --quick
    "full": (GPTConfig(vocab_size=8192, seq_len=512, hidden=1024, heads=16, layers=8), 8),
    "quick": (GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=2, layers=1), 4),
    # out of sample: the same GPT at a quarter of the batch (a quarter of the kernels' work, the same ops), priced
    # with its own op timings and the full batch's in-program overhead and host seconds per op run
    "full_other": (GPTConfig(vocab_size=8192, seq_len=512, hidden=1024, heads=16, layers=8), 2),
    "quick_other": (GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=2, layers=1), 1),
}
PARITY_STEPS = 3
NOISE_FACTOR = 3.0


def build(size: str):
    cfg, batch = MODELS[size]
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    return model, tokens


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


class WithLoss(torch.nn.Module):
    """The GPT whose forward returns its next-token loss: a plan of it states the loss's memory too (run 5's
    plan, of the GPT alone, stated 8 % below the measured step, whose loss held fp32 logits outside it)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.gpt(tokens), tokens)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, tokens, steps, forward=None):
    """Adam steps; the losses and the first step's gradients (local tensors, on the host)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(tokens) if forward is None else forward(model, tokens), tokens)
        loss.backward()
        if first is None:
            first = {k: (v.grad.to_local() if hasattr(v.grad, "to_local") else v.grad).detach().cpu().clone()
                     for k, v in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first


def bf16_parity(size: str, device: torch.device) -> dict:
    """Step 2, in this process (a world-1 group is initialised by the caller)."""
    model, tokens = build(size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = meshplan.auto_parallelize(model, devices=1, example_inputs=(tokens,), mixed_precision="bf16")
    losses, grads = train(pmodel, tokens.to(device), PARITY_STEPS)
    reference, ref32 = build(size)[0].to(device), build(size)[0].to(device)
    cast = lambda m, x: functional_call(m, {n: p.to(torch.bfloat16) for n, p in m.named_parameters()}, (x,)).float()  # noqa: E731
    ref_losses, ref_grads = train(reference, tokens.to(device), PARITY_STEPS, cast)
    _, grads32 = train(ref32, tokens.to(device), PARITY_STEPS)
    worst, worst_name = 0.0, ""
    for fqn, g in grads.items():
        err = float((g - ref_grads[fqn]).norm() / ref_grads[fqn].norm().clamp_min(1e-12))
        noise = float((ref_grads[fqn] - grads32[fqn]).norm() / grads32[fqn].norm().clamp_min(1e-12))
        ratio = err / (noise + 1e-3 / NOISE_FACTOR)
        if ratio > worst:
            worst, worst_name = ratio, fqn
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return {"losses": losses, "reference_losses": ref_losses, "max_loss_rel_error": loss_err,
            "worst_grad_error_over_bf16_noise": worst, "worst_grad": worst_name,
            "passed": worst <= NOISE_FACTOR and loss_err <= 2.0**-8}


def measure_plan(plan_json: str, size: str, device: torch.device, steps: int) -> dict:
    """Step 3's measurement: median step time and peak bytes of the plan on this device."""
    plan = meshplan.Plan.from_json(plan_json)
    model, tokens = build(size)
    pmodel = meshplan.auto_parallelize(WithLoss(model), example_inputs=(tokens,), plan=plan)
    tokens = tokens.to(device)
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 3):  # 3 warm-up steps
        if i == 3 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        pmodel(tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"median_step_s": statistics.median(times), "steps": steps, "peak_bytes": peak,
            "kernel_s": kernel_seconds(pmodel, tokens, opt, device)}


def kernel_seconds(pmodel, tokens, opt, device: torch.device, steps: int = 3) -> float | None:
    """GPU kernel time per step (the sum of kernel durations the profiler records): the step time a GPU that never
    waits for the CPU would take, against which the measured step shows how much the CPU's dispatch adds."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            pmodel(tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
    kernels = [e.duration_ns() for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    return sum(kernels) / 1e9 / steps


def library_workspace_bytes(device: torch.device) -> int | None:
    """Bytes the device's math libraries keep allocated once a bf16 matrix product and its backward have run
    (cuBLAS and cuBLASLt take their workspaces from torch's allocator, once per handle): memory every step holds
    that no tensor of the plan accounts for. Measured first thing in a fresh process."""
    if device.type != "cuda":
        return None
    before = torch.cuda.memory_allocated(device)
    a = torch.randn(512, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    (a @ a).float().sum().backward()
    del a
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before


def _worker(rank, world, size, device_type, plans, steps):
    """`plans`: name -> (plan JSON, the `MODELS` size it is of)."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    workspace = library_workspace_bytes(device)
    parity = bf16_parity(size, device)
    measured = {name: measure_plan(text, of, device, steps) for name, (text, of) in plans.items()}
    return parity, measured, workspace


def cluster_of(device: torch.device) -> str:
    """The presets the lent device is priced with: its own card's where there is one (an H200 is not an H100)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return "h200" if "H200" in name else "a100" if "A100" in name else "h100"


def run(*, device_type: str, quick: bool, out: Path, steps: int, other_profiles: tuple[Path, ...] = ()) -> dict:
    size = "quick" if quick else "full"
    device = torch.device(device_type)
    cluster = cluster_of(device)
    gpt, tokens = build(size)
    model = WithLoss(gpt)
    started = time.perf_counter()
    precision = resolve_precision("auto", auto=get_cluster(cluster).device.default_precision)
    graph = trace(model, (tokens,), precision=precision)
    profile = profile_graph(graph, [MeshSpec((1,))], cluster=cluster, device=device)
    profile_seconds = time.perf_counter() - started
    # the methods op_profiler's module doc compares: each op's runs queued back to back, and one synchronised run each
    queued = profile_graph(graph, [MeshSpec((1,))], cluster=cluster, device=device, queued=QUEUED, hide_launch=False)
    synchronised = profile_graph(graph, [MeshSpec((1,))], cluster=cluster, device=device, hide_launch=False)
    other_size = f"{size}_other"
    other_gpt, other_tokens = build(other_size)
    other_model = WithLoss(other_gpt)
    other_profile = profile_graph(trace(other_model, (other_tokens,), precision=precision), [MeshSpec((1,))], cluster=cluster, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        presets = meshplan.plan(model, 1, (tokens,), cluster=cluster)
        profiled = meshplan.plan(model, 1, (tokens,), cluster=cluster, profile=profile)
        back_to_back = meshplan.plan(model, 1, (tokens,), cluster=cluster, profile=queued)
        one_by_one = meshplan.plan(model, 1, (tokens,), cluster=cluster, profile=synchronised)
        other_own = meshplan.plan(other_model, 1, (other_tokens,), cluster=cluster, profile=other_profile)
        other_borrowed = meshplan.plan(other_model, 1, (other_tokens,), cluster=cluster, profile=dataclasses.replace(
            other_profile, node_overhead_s=profile.node_overhead_s, host_op_run_s=profile.host_op_run_s))
        no_host_floor = meshplan.plan(model, 1, (tokens,), cluster=cluster, profile=dataclasses.replace(profile, host_op_run_s=None))
        # out of sample: profiles measured earlier on other machines of the kind, pricing the same plan
        others = {p.name: meshplan.plan(model, 1, (tokens,), cluster=cluster, profile=str(p)).step_time_s for p in other_profiles}
    backend = "nccl" if device_type == "cuda" else "gloo"
    [(parity, measured, workspace)] = run_local(1, _worker, size, device_type, {"profiled": (profiled.to_json(), size),
                                     "other": (other_own.to_json(), other_size)}, steps, backend=backend, timeout=540)
    m, o = measured["profiled"], measured["other"]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device), "cluster": cluster, "torch": torch.__version__, "model": str(MODELS[size][0]), "batch": MODELS[size][1],
        "precision": profiled.precision.name if profiled.precision else "fp32",
        "profile": {"ops_timed": len(profile.ops), "seconds": profile_seconds},
        "bf16_parity": parity,
        "step": {
            "measured_s": m["median_step_s"], "predicted_presets_s": presets.step_time_s, "predicted_profile_s": profiled.step_time_s,
            "error_presets": presets.step_time_s / m["median_step_s"] - 1, "error_profile": profiled.step_time_s / m["median_step_s"] - 1,
            "predicted_queued_profile_s": back_to_back.step_time_s, "predicted_other_profiles_s": others,
            "predicted_synchronised_profile_s": one_by_one.step_time_s, "predicted_no_host_floor_s": no_host_floor.step_time_s,
            "mfu_measured": profiled.model_flops / (profiled.peak_flops * m["median_step_s"]), "kernel_s": m["kernel_s"],
            "node_overhead_s": profile.node_overhead_s, "host_op_run_s": profile.host_op_run_s,
        },
        "other_batch": {
            "batch": MODELS[other_size][1], "measured_s": o["median_step_s"], "kernel_s": o["kernel_s"],
            "predicted_own_profile_s": other_own.step_time_s, "node_overhead_s": other_profile.node_overhead_s,
            "host_op_run_s": other_profile.host_op_run_s,
            "predicted_borrowed_overhead_s": other_borrowed.step_time_s,
        },
        "memory": {"measured_peak_bytes": m["peak_bytes"], "plan_bytes": profiled.memory.total, "library_workspace_bytes": workspace},
        "seconds": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_check-{device_name(device).replace(' ', '_').replace('/', '_')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    profile_path = stem.parent / (stem.name + "-profile.json")
    profile_path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    return report


def _us(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1e6:.1f} us"


def markdown(r: dict) -> str:
    s, p, mem, ob = r["step"], r["bf16_parity"], r["memory"], r["other_batch"]
    kernels = "n/a (CPU)" if s["kernel_s"] is None else f"{s['kernel_s'] * 1e3:.2f} ms"
    workspace = "n/a (CPU)" if mem["library_workspace_bytes"] is None else f"{mem['library_workspace_bytes'] / 2**20:.1f} MiB"
    peak = "n/a (CPU)" if mem["measured_peak_bytes"] is None else \
        f"{mem['measured_peak_bytes'] / 2**20:.1f} MiB (the plan {mem['plan_bytes'] / mem['measured_peak_bytes'] - 1:+.1%})"
    return "\n".join([
        f"# gpu_check on {r['device']} ({r['date']}, torch {r['torch']})", "",
        f"Model {r['model']}, batch {r['batch']}, precision {r['precision']}; whole run {r['seconds']:.0f} s.", "",
        f"- compute profile: {r['profile']['ops_timed']} op shapes in {r['profile']['seconds']:.0f} s",
        f"- bf16 parity ({'passed' if p['passed'] else 'FAILED'}): worst gradient error {p['worst_grad_error_over_bf16_noise']:.2f} x its "
        f"bf16 noise ({p['worst_grad']}), losses within {p['max_loss_rel_error']:.1e}",
        f"- step: measured {s['measured_s'] * 1e3:.2f} ms; predicted {s['predicted_profile_s'] * 1e3:.2f} ms with the profile "
        f"({s['error_profile']:+.0%}; each op's runs queued back to back: {s['predicted_queued_profile_s'] * 1e3:.2f} ms, "
        f"{s['predicted_queued_profile_s'] / s['measured_s'] - 1:+.0%}"
        + ("" if "predicted_synchronised_profile_s" not in s else
           f"; one synchronised run each: {s['predicted_synchronised_profile_s'] * 1e3:.2f} ms, "
           f"{s['predicted_synchronised_profile_s'] / s['measured_s'] - 1:+.0%}")
        + f"), {s['predicted_presets_s'] * 1e3:.2f} ms with the presets "
        f"({s['error_presets']:+.0%}); "
        f"measured MFU {s['mfu_measured']:.1%}; GPU kernels {kernels} per step"
        + ("" if s.get("host_op_run_s") is None else
           f"; host {_us(s['host_op_run_s'])} per op run, in-program overhead {_us(s['node_overhead_s'])}; without the host floor "
           f"{s['predicted_no_host_floor_s'] * 1e3:.2f} ms ({s['predicted_no_host_floor_s'] / s['measured_s'] - 1:+.0%})")
        + "".join(f"; with {name} (another machine's): {t * 1e3:.2f} ms ({t / s['measured_s'] - 1:+.0%})"
                  for name, t in s.get("predicted_other_profiles_s", {}).items()),
        f"- out of sample, the batch of {ob['batch']}: measured {ob['measured_s'] * 1e3:.2f} ms (GPU kernels "
        + ("n/a (CPU)" if ob["kernel_s"] is None else f"{ob['kernel_s'] * 1e3:.2f} ms")
        + f"); predicted {ob['predicted_borrowed_overhead_s'] * 1e3:.2f} ms with its op timings and the batch of {r['batch']}'s "
        f"in-program overhead and host floor ({ob['predicted_borrowed_overhead_s'] / ob['measured_s'] - 1:+.0%}), "
        f"{ob['predicted_own_profile_s'] * 1e3:.2f} ms with its own ({ob['predicted_own_profile_s'] / ob['measured_s'] - 1:+.0%}; "
        f"in-program overhead {_us(ob['node_overhead_s'])} per op run, the batch of {r['batch']}'s {_us(s.get('node_overhead_s'))}; "
        f"host {_us(ob.get('host_op_run_s'))} per op run, the batch of {r['batch']}'s {_us(s.get('host_op_run_s'))})",
        f"- memory: measured peak {peak}, plan {mem['plan_bytes'] / 2**20:.1f} MiB; the math libraries' workspaces {workspace}", "",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="a tiny model (the CPU smoke test)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--other-profile", type=Path, nargs="*", default=[],
                    help="profiles saved by earlier runs on other machines: the plan priced with each too (out of sample)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for the smoke test")
    report = run(device_type=args.device, quick=args.quick, out=args.out, steps=args.steps, other_profiles=tuple(args.other_profile))
    print(markdown(report))
    if not report["bf16_parity"]["passed"]:
        raise SystemExit("bf16 parity FAILED")


if __name__ == "__main__":
    main()
