"""Cut one rank's rewritten program (runtime/rewrite.py) into pipeline stage programs.

Every node of the per-rank program belongs to the stage that holds its unit (`pre`, `layers.k`,
`post`, see planner/stage_profile.py): an op to its own unit, a resharding move to its consumer's,
a recomputed layer to that layer's. Stage k's program takes the values handed to it by stage k - 1
(the activations crossing the cut, plus any earlier value a later stage still needs: it is passed
through) followed by the parameters and constants it uses, and returns what stage k + 1 takes; the
last stage returns the model's outputs. Stage 0 takes the user's inputs.

Pure torch.fx: no process groups here. The collectives inside each stage are the plan's moves,
which travel with the nodes that call them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from meshplan.ir.graph import Graph
from meshplan.ir.placement import local_shape
from meshplan.ir.units import unit_names, unit_of_nodes
from meshplan.plans.pipeline import PipelinePlan
from meshplan.plans.plan import Plan
from meshplan.runtime.collectives import scale_grad
from meshplan.runtime.rewrite import SOURCE, Recomputed, Redistribute


@dataclass(frozen=True, kw_only=True, slots=True)
class StageProgram:
    index: int
    gm: fx.GraphModule
    """Placeholders: `carried_in`, then `locals_in`; returns `carried_out` (a tuple) or, last, the model's outputs."""
    carried_in: tuple[str, ...]
    """Values received from the previous stage (stage 0: the user's inputs), by program node name."""
    locals_in: tuple[str, ...]
    """Parameters, buffers and constants it reads (program placeholder names)."""
    carried_out: tuple[str, ...]
    """Values handed to the next stage; empty for the last."""


def unit_stages(graph: Graph, pipe: PipelinePlan) -> dict[str, int]:
    """Traced node -> stage index; checks the plan's units are the graph's."""
    names = unit_names(graph)
    planned = [u for s in pipe.stages for u in s.units]
    if planned != names:
        raise ValueError(f"the pipeline plan's units {planned} are not this model's units {names}; re-plan for this model")
    stage = {u: s.index for s in pipe.stages for u in s.units}
    return {node: stage[u] for node, u in unit_of_nodes(graph).items()}


def node_stages(gm: fx.GraphModule, of_traced: dict[str, int], last: int) -> dict[fx.Node, int]:
    """Stage of every non-placeholder node of the per-rank program."""
    out: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        src = n.meta.get(SOURCE)
        if n.op == "call_function" and n.target is operator.getitem:
            out[n] = out[n.args[0]]
        elif n.op == "call_function" and n.target is scale_grad:
            out[n] = last
        elif src is not None:
            out[n] = last if src == "output" else of_traced[src]
        elif n.op == "call_module" and isinstance(getattr(gm, n.target), Recomputed):
            # a checkpointed layer's fused body: its ops keep their sources
            body = getattr(gm, n.target).body
            hits = {last if m.meta[SOURCE] == "output" else of_traced[m.meta[SOURCE]] for m in body.graph.nodes if SOURCE in m.meta}
            if len(hits) != 1:
                raise AssertionError(f"recomputed {getattr(gm, n.target).layer} spans stages {hits}")
            out[n] = hits.pop()
        else:
            raise AssertionError(f"no pipeline stage for program node {n.format_node()}")
    return out


def split_program(gm: fx.GraphModule, stage_of: dict[fx.Node, int], n_stages: int, user_inputs: list[str]) -> list[StageProgram]:
    """Stage programs of `gm`; `user_inputs` are its placeholders fed by the user (the rest are locals)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op != "placeholder" and stage_of[a] > stage_of[n]:
                raise ValueError(f"{n.name} (stage {stage_of[n]}) reads {a.name} from the later stage {stage_of[a]}: the cut is not in program order")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    # where each value is read last: a value produced by stage i and read by stage j > i is carried over i+1..j
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op != "placeholder" or a.name in user_inputs:
                last_use[a] = max(last_use.get(a, 0), stage_of[n])
    for a in output.all_input_nodes:
        last_use[a] = n_stages - 1
    born = {n: stage_of[n] for n in nodes} | {p: 0 for p in gm.graph.nodes if p.op == "placeholder" and p.name in user_inputs}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    carried = [sorted((v for v, j in last_use.items() if born[v] < k <= j), key=order.__getitem__) for k in range(n_stages)]
    carried[0] = [p for p in gm.graph.nodes if p.op == "placeholder" and p.name in user_inputs]
    programs = []
    for k in range(n_stages):
        mine = [n for n in nodes if stage_of[n] == k]
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for v in carried[k]:
            env[v] = g.placeholder(v.name)
        local = [a for a in dict.fromkeys(a for n in mine for a in n.all_input_nodes) if a.op == "placeholder" and a.name not in user_inputs]
        for a in local:
            env[a] = g.placeholder(a.name)
        for n in mine:
            env[n] = g.node_copy(n, env.__getitem__)
        if k == n_stages - 1:
            g.output(fx.node.map_arg(output.args[0], env.__getitem__))
            out_names: tuple[str, ...] = ()
        else:
            handed = carried[k + 1]
            g.output(tuple(env[v] for v in handed))
            out_names = tuple(v.name for v in handed)
        g.lint()
        programs.append(StageProgram(index=k, gm=fx.GraphModule(gm, g, class_name=f"Stage{k}Program"), carried_in=tuple(v.name for v in carried[k]),
                                     locals_in=tuple(a.name for a in local), carried_out=out_names))
    return programs


def example_values(gm: fx.GraphModule, names: tuple[str, ...] | None, graph: Graph, plan: Plan, *,
                   whole_inputs: bool = False) -> tuple[torch.Tensor, ...]:
    """Meta tensors shaped like this rank's blocks of the named program values (`names=None`: the program's outputs).
    A user input is the rank's block too (what stage 0 hands on to a later stage that reads it, as a model computing
    its own loss reads its labels), or the whole microbatch with `whole_inputs` (what stage 0 takes: it shards it).

    They give `PipelineStage` its send/receive buffers up front (static mode), so torch does not run an extra
    forward of every stage (with the stage's collectives) to infer them."""
    layouts = {n.name: n.strategy.outputs for n in plan.nodes}
    inputs = {i.name: i.layout for i in plan.inputs}
    moved = {(t.consumer, t.forward): t.dst for t in plan.transfers}
    mesh = plan.mesh.shape

    def meta(owner: fx.GraphModule, node: fx.Node, idx: int = 0) -> torch.Tensor:
        if node.op == "placeholder":  # a user input
            m, layout = graph[node.name].outputs[0], None if whole_inputs else inputs.get(node.name)
        elif node.op == "call_function" and node.target is operator.getitem:
            return meta(owner, node.args[0], node.args[1])
        elif node.op == "call_function" and node.target is scale_grad:
            return meta(owner, node.args[0], idx)
        elif node.op == "call_module" and isinstance(getattr(owner, node.target), Recomputed):
            body = getattr(owner, node.target).body
            out = next(x for x in body.graph.nodes if x.op == "output").args[0]
            return meta(body, out[idx] if isinstance(out, (tuple, list)) else out)
        elif node.op == "call_module" and isinstance(getattr(owner, node.target), Redistribute):
            src = node.args[0]
            m = _traced_meta(owner, src, graph)
            layout = moved[(node.meta[SOURCE], getattr(owner, node.target).steps)]
        else:
            m, layout = graph[node.meta[SOURCE]].outputs[idx], layouts[node.meta[SOURCE]][idx]
        shape = m.shape if layout is None else local_shape(m.shape, layout, mesh)
        # activations of floating dtype carry gradients across the cut (torch's stage reads this flag)
        return torch.empty(shape, dtype=m.torch_dtype, device="meta", requires_grad=m.torch_dtype.is_floating_point)

    nodes = {n.name: n for n in gm.graph.nodes}
    if names is None:
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return tuple(meta(gm, v) for v in (out if isinstance(out, (tuple, list)) else (out,)))
    return tuple(meta(gm, nodes[name]) for name in names)


def _traced_meta(owner: fx.GraphModule, node: fx.Node, graph: Graph):
    """Global meta of a program value (what a move reshards)."""
    if node.op == "placeholder":
        return graph[node.name].outputs[0]
    if node.op == "call_function" and node.target is operator.getitem and SOURCE in node.args[0].meta:
        return graph[node.args[0].meta[SOURCE]].outputs[node.args[1]]
    if not (SOURCE in node.meta and node.op == "call_function"):
        raise AssertionError(f"cannot tell the shape of {node.format_node()}")
    return graph[node.meta[SOURCE]].outputs[0]
