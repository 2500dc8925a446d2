"""Every mesh of the default search, one solve at a time: issue 19's regression benchmark.

    python benchmarks/mesh_search.py [--devices 8 64] [--only llama_small] [--quick]

For each model (meshplan's own and the Hugging Face models the tests build, plus RWKV) and each
device count, plans every mesh of up to 3 axes that `meshplan.plan(model, devices=N)` considers,
in the same order and with the same starts (the coarser meshes' plans), and prints per mesh:
strategies, layout pairs, the MIP's variables and rows (of the last solve, for a search one axis
at a time), how it was searched (exact MIP, or one axis at a time), solver status,
gap, seconds and the predicted step. Then the mesh search as a call (`meshplan.plan(model,
devices=N, pipeline=None)`, trace included: across nodes the default call searches pipelines
instead, which `benchmarks/planning_time.py --zoo` times) with its chosen mesh, and whether that
plan is the fastest of the per-mesh solves. Targets: no mesh over 30 s; llama_small on 8 devices <= 15 s (the default call,
here without the CLI's import time).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import meshplan
from meshplan.cost_model.presets import get_cluster
from meshplan.ir.trace import trace
from meshplan.planner.meshes import resolve_mesh
from meshplan.planner.neighbourhood import PAIR_LIMIT, layout_pairs
from meshplan.planner.planner import MemoryBudgetError, PlanOptions, make_plan
from meshplan.planner.solver import InfeasiblePlan, SolveTimeout
from meshplan.planner.strategies import generate
from meshplan.planner.tying import tie_repeated_layers

MESH_TARGET_S = 30.0
DEFAULT_CALL_TARGET_S = 15.0


def _rwkv():
    """The HF RWKV architecture, tiny (issue 19 saw it fail on (2, 4))."""
    import torch
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    cfg = RwkvConfig(vocab_size=128, context_length=16, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                     intermediate_size=128, use_cache=False)
    return RwkvForCausalLM(cfg), (torch.randint(0, 128, (8, 16)),), {}


def _hf(name: str):
    def build():
        from meshplan.models.hf import hf_model

        return hf_model(name)

    return build


def _own(name: str):
    def build():
        import meshplan.models as models

        return getattr(models, name)()

    return build


def _mixtral():
    from meshplan.models.mixtral import hf_mixtral

    return hf_mixtral()


def _resnet():
    from meshplan.models.resnet import resnet_small

    return resnet_small()


MODELS = {
    "mlp_small": _own("mlp_small"),
    "gpt_small": _own("gpt_small"),
    "llama_small": _own("llama_small"),
    "resnet_small": _resnet,
    "mixtral": _mixtral,
    "hf_gpt2": _hf("gpt2"),
    "hf_llama": _hf("llama"),
    "hf_bert": _hf("bert"),
    "hf_t5": _hf("t5"),
    "hf_vit": _hf("vit"),
    "hf_rwkv": _rwkv,
}


def _unpack(built):
    model, inputs, *rest = built
    kwargs = rest[0] if rest else {}
    return model, inputs if isinstance(inputs, tuple) else (inputs,), kwargs or None


def per_mesh(name: str, devices: int, cluster) -> list[dict]:
    model, inputs, kwargs = _unpack(MODELS[name]())
    graph = trace(model, inputs, kwargs)
    options = PlanOptions()
    found, rows = [], []
    for mesh in resolve_mesh(devices, devices_per_node=cluster.devices_per_node):
        by_node = generate(graph, mesh).by_node
        pairs = layout_pairs(graph, by_node, tie_repeated_layers(graph, by_node).rep)
        row = {"model": name, "devices": devices, "mesh": mesh.shape, "strategies": sum(map(len, by_node.values())), "pairs": pairs,
               "method": "axis" if pairs > PAIR_LIMIT else "exact"}
        began = time.perf_counter()
        try:
            plan = make_plan(graph, mesh, cluster, options, model_name=name, earlier=found)
        except (MemoryBudgetError, InfeasiblePlan, SolveTimeout, ValueError) as e:
            row.update(seconds=time.perf_counter() - began, status=f"no plan: {type(e).__name__}", gap=float("nan"), step_ms=float("nan"), mip="-")
        else:
            found.append(plan)
            row.update(seconds=time.perf_counter() - began, status=plan.solver.status, gap=plan.solver.gap, step_ms=plan.step_time_s * 1e3,
                       mip=f"{plan.solver.variables}/{plan.solver.constraints}")
        rows.append(row)
        print(f"{name:13s} {devices:3d} {str(mesh.shape):12s} {row['strategies']:7d} {pairs:9d} {row['mip']:>13s} {row['method']:6s} "
              f"{row['status']:22s} {row['gap']:7.2%} {row['seconds']:7.2f} {row['step_ms']:10.4f}", flush=True)
    return rows


def default_call(name: str, devices: int) -> tuple[float, object]:
    model, inputs, kwargs = _unpack(MODELS[name]())
    began = time.perf_counter()
    plan = meshplan.plan(model, devices, inputs, example_kwargs=kwargs, cluster="cpu", pipeline=None)
    return time.perf_counter() - began, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--only", nargs="+", choices=sorted(MODELS), help="these models only")
    ap.add_argument("--quick", action="store_true", help="mlp_small on 8 devices (smoke test)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("meshplan").setLevel(logging.ERROR)
    names = ["mlp_small"] if args.quick else args.only or list(MODELS)
    devices = [8] if args.quick else args.devices
    cluster = get_cluster("cpu")
    print(f"{'model':13s} {'dev':>3s} {'mesh':12s} {'strat.':>7s} {'pairs':>9s} {'vars/rows':>13s} {'search':6s} {'status':22s} {'gap':>7s} {'seconds':>7s} {'step ms':>10s}")
    worst, summary = 0.0, []
    failed = []
    for n in devices:
        for name in names:
            try:
                rows = per_mesh(name, n, cluster)
            except Exception as e:  # noqa: BLE001 - a model that cannot be planned is reported, the others still run
                print(f"{name:13s} {n:3d} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                failed.append(f"{name} on {n}")
                continue
            worst = max(worst, max(r["seconds"] for r in rows))
            seconds, plan = default_call(name, n)
            best = min((r["step_ms"] for r in rows if r["step_ms"] == r["step_ms"]), default=float("nan"))
            same = abs(plan.step_time_s * 1e3 - best) <= 1e-9 * max(best, 1.0)
            summary.append((name, n, seconds, plan.mesh.shape, plan.step_time_s * 1e3, best, same, len(plan.solver.skipped)))
    print("\nthe mesh search as a call, meshplan.plan(model, devices=N, pipeline=None), trace included:")
    print(f"{'model':13s} {'dev':>3s} {'seconds':>8s} {'mesh':12s} {'step ms':>10s} {'best mesh ms':>12s} {'same':>5s} {'skipped':>7s}")
    for name, n, seconds, shape, step, best, same, skipped in summary:
        print(f"{name:13s} {n:3d} {seconds:8.2f} {str(shape):12s} {step:10.4f} {best:12.4f} {str(same):>5s} {skipped:7d}")
    print(f"\nslowest single mesh: {worst:.2f} s (target <= {MESH_TARGET_S:.0f} s): {'met' if worst <= MESH_TARGET_S else 'NOT met'}")
    for name, n, seconds, *_ in summary:
        if name == "llama_small" and n == 8:
            verdict = "met" if seconds <= DEFAULT_CALL_TARGET_S else "NOT met"
            print(f"llama_small, devices=8, default call: {seconds:.2f} s (target <= {DEFAULT_CALL_TARGET_S:.0f} s): {verdict}")
    if failed:
        raise SystemExit(f"could not plan: {', '.join(failed)}")
    if not all(s[6] for s in summary):
        raise SystemExit("a default call did not return the fastest of the per-mesh plans")


if __name__ == "__main__":
    main()
