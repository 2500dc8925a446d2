"""`torch.compile(pmodel)` on real gloo ranks: the per-rank program's functional collectives trace
into one graph (no graph break), and compiled training gives the single-process numbers.

The backend is "aot_eager" (Dynamo and AOTAutograd, no code generation) with inductor's partitioner (min-cut), which
keeps the test fast on a 2-core machine; "inductor" works as well but needs ~30 s per rank here to build GPT's kernels.
aot_eager's own partitioner (`default_partition`) would put a dead copy of attention and the all-to-all after it in
the backward graph of a Ulysses plan, one per layer (torch 2.13; plain torch reproduces it: SDPA, an all-to-all and an
autograd all-gather), which inductor never runs. Compiled code counts no collectives; the test reads them off the
graphs AOTAutograd compiles.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from _parity import build, plan_kwargs, run_steps, train

import meshplan
from meshplan.regions.context_parallel import kernel_name
from meshplan.runtime.launch import run_local
from meshplan.runtime.local_view import local_of
from meshplan.runtime.parallel_module import shard_tensor

pytestmark = pytest.mark.multiprocess

STEPS = 2
KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_to_all_single": "all_to_all"}
"""functional collective op -> the plan's collective kind"""


def _kind(node) -> str:
    """The plan's collective kind of a functional collective node: an all-to-all with one non-empty piece each way is a
    point-to-point exchange (`send_recv`, as the rings issue theirs)."""
    kind = KINDS[node.target._opname]
    if kind == "all_to_all" and all(isinstance(s, list) and sum(1 for x in s if x) == 1 for s in node.args[1:3]):
        return "send_recv"
    return kind


def _counting_backend(graphs: list):
    """"aot_eager" (Dynamo and AOTAutograd, no code generation) with inductor's partitioner, recording for every forward
    and backward graph it is handed the functional collectives in it: compiled code runs exactly those, and counts
    nothing itself."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(phase: str):
        def compile_graph(gm, example_inputs):
            found = Counter(f"{phase}:{_kind(n)}" for n in gm.graph.nodes
                            if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "_c10d_functional"
                            and n.target._opname in KINDS)
            graphs.append((phase, found))
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=min_cut_rematerialization_partition)


def _plan(kind: str):
    model, x, _ = build("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return meshplan.plan(model, devices=2, example_inputs=(x,), **plan_kwargs("gpt", kind, (2,)))


def _compiled_worker(rank: int, world: int, plan):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, x, y = build("gpt")
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(x,), plan=plan)
    graphs: list[tuple[str, Counter]] = []
    compiled = torch.compile(pmodel, backend=_counting_backend(graphs))
    pmodel.reset_collective_counts()
    losses = run_steps(compiled, torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9), x, y, "gpt", STEPS)
    counts = pmodel.collective_counts()
    module_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())  # anywhere in the compiled pmodel
    params = {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}

    # the per-rank program on its own: the arguments ParallelModule passes it, then Dynamo's account of it
    captured = []
    hook = pmodel.program.register_forward_pre_hook(lambda module, args: captured.append(args))
    pmodel(x)
    hook.remove()
    explained = torch._dynamo.explain(pmodel.program)(*captured[0])
    breaks = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    return losses, counts, params, explained.graph_count, explained.graph_break_count, breaks, module_breaks, graphs


@pytest.mark.parametrize("kind", ["data_parallel", "megatron"])
def test_compiled_training_matches_one_process_without_graph_breaks(kind):
    plan = _plan(kind)
    results = run_local(2, _compiled_worker, plan, timeout=600)
    model, x, y = build("gpt")
    reference = train(model, x, y, "gpt", STEPS)
    ref_params = dict(model.named_parameters())
    layouts = {f: p.layout for p in plan.params for f in p.fqns}
    program_collectives = {k for k in plan.collectives() if not k.startswith("grad_sync:")}
    if kind == "megatron":
        assert program_collectives, "the TP plan should move activations inside the program"
    for rank, (losses, counts, params, graphs, breaks, reasons, module_breaks, compiled) in enumerate(results):
        assert breaks == 0 and graphs == 1, f"rank {rank}: the per-rank program broke into {graphs} graphs: {reasons}"
        assert module_breaks == 0, f"rank {rank}: {module_breaks} graph breaks in the compiled ParallelModule (TORCH_LOGS=graph_breaks)"
        # the program ran compiled: its collectives were traced (compiled code does not count them),
        # while the gradient buckets (outside the program) still counted theirs
        assert not program_collectives & set(counts), f"rank {rank} ran the program eagerly: {dict(counts)}"
        # the plan is the truth: one forward and one backward graph, holding exactly the plan's collectives of a step
        assert [phase for phase, _ in compiled] == ["forward", "backward"], f"rank {rank} compiled {compiled}"
        ran = sum((found for _, found in compiled), Counter())
        want = Counter({k: v for k, v in plan.collectives().items() if not k.startswith("grad_sync:")})
        assert ran == want, f"rank {rank}: the compiled graphs run {dict(ran)}, the plan lists {dict(want)}"
        assert counts.get("grad_sync:all_reduce", 0) == STEPS * plan.collectives().get("grad_sync:all_reduce", 0)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-6)
        assert set(params) == set(ref_params)
        for fqn, local in params.items():
            want = shard_tensor(ref_params[fqn].detach(), layouts[fqn], plan.mesh, rank)
            torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {fqn}: {m}")


# ---------------------------------------------------------------- context parallelism

def _compiled_cp_worker(rank: int, world: int, plan):
    import torch._dynamo
    from test_context_parallel import _build, _train

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, tokens = _build("gpt")
    pmodel = meshplan.auto_parallelize(model, devices=world, example_inputs=(tokens,), plan=plan)
    graphs: list[tuple[str, Counter]] = []
    compiled = torch.compile(pmodel, backend=_counting_backend(graphs))
    pmodel.reset_collective_counts()
    losses, grads = _train(compiled, tokens, local_of)
    grads = {k.removeprefix("_orig_mod."): g for k, g in grads.items()}
    params = {k: local_of(v.detach()) for k, v in pmodel.named_parameters()}
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return losses, grads, params, pmodel.collective_counts(), graphs, breaks


@pytest.mark.parametrize("variant", ["ring_headtail", "ulysses_headtail", "headtail", "torch_ring"])
def test_compiled_context_parallel_training_matches_one_process(variant):
    """The context-parallel kernels under torch.compile, 2 ranks, head-tail token order, 3 AdamW steps against one
    process. The collectives the compiled graphs hold (each graph runs once a step) plus those counted eagerly are the
    plan's. Ulysses and the gathered kernel trace into one forward and one backward graph; the rings run eagerly between
    graphs (`ring_attention`, `torch_ring_attention`: traced, AOTAutograd merged or moved their exchanges)."""
    from test_context_parallel import STEPS as CP_STEPS, _check_parity
    from test_token_order import _ordered

    plan = _ordered("gpt", 2, variant)
    assert {n.strategy.kernel for n in plan.nodes if n.strategy.kernel.startswith("cp_attention")} == {kernel_name(variant, True)}
    results = run_local(2, _compiled_cp_worker, plan, timeout=900)
    for rank, (_, _, _, counts, graphs, breaks) in enumerate(results):
        compiled = sum((found for _, found in graphs), Counter())
        if variant in ("ring_headtail", "torch_ring"):  # the rings run eagerly between graphs
            assert breaks > 0 and not any(k.endswith(":send_recv") for k in compiled), f"rank {rank}: {graphs}"
        else:
            assert breaks == 0 and [phase for phase, _ in graphs] == ["forward", "backward"], f"rank {rank}: {breaks} breaks, {graphs}"
        ran = Counter(counts) + Counter({k: v * CP_STEPS for k, v in compiled.items()})
        assert ran == Counter({k: v * CP_STEPS for k, v in plan.collectives().items()}), f"rank {rank} ran {dict(ran)}"
    # parity: the runs' collective counts are checked above (compiled graphs count nothing themselves)
    _check_parity("gpt", plan, [(losses, grads, params, {k: v * CP_STEPS for k, v in plan.collectives().items()})
                                for losses, grads, params, _, _, _ in results])
