"""A tiny Mixtral (transformers, random weights) shared by the MoE tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH, SEQ, VOCAB = 4, 8, 64


def mixtral_config(**overrides):
    from transformers import MixtralConfig

    kw = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="sdpa", router_jitter_noise=0.0,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)


def build_mixtral(**overrides):
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(mixtral_config(**overrides))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, tokens


def lm_loss(out, tokens: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model, tokens, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def plan_traced(model, graph, mesh_shape: tuple[int, ...], **options):
    """Plan an already traced model (tracing a transformers model costs seconds; tests trace once)."""
    import math
    import warnings

    from meshplan.planner.meshes import resolve_mesh
    from meshplan.cost_model.presets import get_cluster
    from meshplan.planner.annotations import module_annotations
    from meshplan.planner.constraints import Annotations
    from meshplan.planner.planner import PlanOptions, make_plan

    cluster = get_cluster(options.pop("cluster", "cpu"))
    (mesh,) = resolve_mesh(math.prod(mesh_shape), mesh_shape, None, cluster.devices_per_node)
    opts = PlanOptions(annotations=Annotations(modules=module_annotations(model)), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(graph, mesh, cluster, opts, model_name=type(model).__name__)
