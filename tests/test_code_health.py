"""Code-health checks over meshplan's own source: invariants that `python -O` cannot strip, and every private
torch name the package touches, listed (torch is pinned to one minor version: these are what a new one may break)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "meshplan"

PRIVATE_TORCH = {
    # torch paths (imports and torch.* attribute chains) with a private part
    "torch._C": "autograd's current graph task, dispatch-key checks",
    "torch._C._current_graph_task_id": "a collective knows whether it runs inside backward",
    "torch._C._dispatch_has_kernel_for_dispatch_key": "tracing tells a composite op from a kernel",
    "torch._C._profiler._EventType": "measured peaks pair the allocator's events by address (profiling/fidelity.py)",
    "torch._ops": "OpOverload, the type of traced targets",
    "torch._ops.OpOverload": "the type of traced targets",
    "torch._subclasses.fake_tensor.FakeTensorMode": "shapes without memory when tracing",
    "torch.autograd.Variable._execution_engine": "gradient buckets flush at the end of backward",
    "torch.autograd.Variable._execution_engine.queue_callback": "gradient buckets flush at the end of backward",
    "torch.distributed._functional_collectives": "collectives autograd and compile can trace",
    "torch.distributed.tensor.DTensor._op_dispatcher": "DTensor's sharding rules as strategies",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator": "DTensor's sharding rules as strategies",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx": "ops whose args carry shapes",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": "asking DTensor's rules about a layout",
    "torch.distributed.tensor._dtensor_spec.TensorMeta": "asking DTensor's rules about a layout",
    "torch.distributed.tensor._op_schema.OpSchema": "asking DTensor's rules about a layout",
    "torch.distributed.tensor._op_schema.OpSpec": "DTensor's rules' answers",
    "torch.distributed.tensor._op_schema.OpStrategy": "DTensor's rules' answers",
    "torch.distributed.tensor._op_schema.TupleStrategy": "DTensor's rules' answers",
    "torch.distributed.tensor._ops.single_dim_strategy._ShardingPlaceholder": "DTensor's single-dim rules",
    "torch.distributed.tensor._ops.utils": "DTensor's cost hooks, switched off while listing strategies",
    "torch.distributed.tensor.placement_types._MaskPartial": "vocabulary-parallel lookups",
    "torch.distributed.tensor.experimental._context_parallel._attention": "torch's ring attention templates (regions/torch_ring.py)",
    "torch.distributed.tensor.experimental._context_parallel._attention._cp_options": "torch's ring options, set per call",
    "torch.distributed.tensor.experimental._context_parallel._attention._RotateMethod": "torch's ring rotation (all-to-all)",
    "torch.distributed.tensor.experimental._context_parallel._attention._RotateMethod.ALL_TO_ALL": "torch's ring rotation",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention": "torch's ring, forward",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention_backward": "torch's ring, backward",
    "torch.nn.utils.stateless._reparametrize_module": "bf16 working copies of weights",
    "torch.utils._python_dispatch.TorchDispatchMode": "meta-device init records the ops that fill parameters",
    "torch.utils._pytree": "flattening user inputs and outputs",
    "torch.utils._pytree.tree_leaves": "flattening user inputs and outputs",
    "torch.utils._pytree.tree_map": "flattening user inputs and outputs",
    # private attributes of torch objects (names meshplan itself never defines)
    ".._C": "torch._C",
    ".._MaskPartial": "vocabulary-parallel lookups",
    ".._assert_tensor_metadata": "an export assertion op the trace drops",
    ".._buffers": "nn.Module's own dicts: stacks of identical blocks, module surgery",
    ".._cdata": "a storage's identity (tied tensors at meta init)",
    ".._current_graph_task_id": "see torch._C",
    ".._dispatch_has_kernel_for_dispatch_key": "see torch._C",
    ".._execution_engine": "see torch.autograd.Variable",
    ".._get_metadata_path": "DCP's metadata file of a checkpoint",
    ".._is_view": "a tensor that views another",
    ".._local_tensor": "a DTensor's local shard without autograd's to_local",
    ".._modules": "nn.Module's own dicts",
    ".._non_persistent_buffers_set": "nn.Module's own dicts",
    ".._op_dispatcher": "see torch.distributed.tensor.DTensor",
    ".._parameters": "nn.Module's own dicts",
    ".._pytree": "see torch.utils._pytree",
    ".._schema": "an op's schema (argument names, mutation)",
    ".._cp_options": "see torch.distributed.tensor.experimental._context_parallel._attention",
    ".._RotateMethod": "see torch.distributed.tensor.experimental._context_parallel._attention",
    ".._templated_ring_attention": "see torch.distributed.tensor.experimental._context_parallel._attention",
    ".._templated_ring_attention_backward": "see torch.distributed.tensor.experimental._context_parallel._attention",
    ".._c10d_functional": "the functional all-to-all torch's ring issues, counted as observed (regions/torch_ring.py)",
    ".._scaled_dot_product_flash_attention_for_cpu": "context-parallel attention's blocks with their log-sum-exp",
    ".._scaled_dot_product_flash_attention_for_cpu_backward": "context-parallel attention's blocks in backward",
    ".._scaled_dot_product_flash_attention": "context-parallel attention's blocks on CUDA (fp16/bf16)",
    ".._scaled_dot_product_flash_attention_backward": "context-parallel attention's blocks on CUDA in backward",
    ".._scaled_dot_product_efficient_attention": "context-parallel attention's blocks on CUDA (fp32, or before sm80)",
    ".._scaled_dot_product_efficient_attention_backward": "context-parallel attention's blocks on CUDA in backward",
    ".._scaled_dot_product_cudnn_attention": "context-parallel attention's blocks on CUDA where SDPA picks cuDNN",
    ".._scaled_dot_product_cudnn_attention_backward": "context-parallel attention's blocks on cuDNN in backward",
    "torch._fused_sdp_choice": "the fused kernel SDPA would pick for a block (the blocks run the same kernel)",
    ".._fused_sdp_choice": "the same, as the attribute read",
    "torch.cuda._sleep": "the op profiler's spin kernel: the GPU busy while the host issues the op timed (its launch hidden)",
    ".._sleep": "the same, as the attribute read",
}
"""Every private torch name meshplan touches -> why; `.._name` entries are private attributes of torch objects."""


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text(), str(path))


def _private(parts) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def private_torch_names() -> dict[str, set[str]]:
    """Private torch paths (imports, torch.* attribute chains; not torch.ops.*, whose names are aten's) and private
    attributes that meshplan reads but never defines, each with the files using it."""
    found: dict[str, set[str]] = {}
    defined: set[str] = set()
    read: dict[str, set[str]] = {}
    for path, tree in _sources():
        alias: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch":
                        alias[a.asname or "torch"] = a.name if a.asname else "torch"
                        if _private(a.name.split(".")):
                            found.setdefault(a.name, set()).add(str(path))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    alias[a.asname or a.name] = full
                    if _private(full.split(".")):
                        found.setdefault(full, set()).add(str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.keyword) and node.arg:
                defined.add(node.arg)
            elif isinstance(node, ast.Attribute):
                if not isinstance(node.ctx, ast.Load):
                    defined.add(node.attr)
                elif _private([node.attr]):
                    read.setdefault(node.attr, set()).add(str(path))
                parts, root = [], node
                while isinstance(root, ast.Attribute):
                    parts.append(root.attr)
                    root = root.value
                if isinstance(root, ast.Name) and root.id in alias and _private(parts):
                    full = ".".join([alias[root.id], *reversed(parts)])
                    if not full.startswith("torch.ops."):
                        found.setdefault(full, set()).add(str(path))
    # aten op names (torch.ops.aten._to_copy) are public names that start with "_"
    aten = {"_log_softmax", "_native_batch_norm_legit_functional", "_to_copy", "_unsafe_view"}
    found.update({f".._{name[1:]}": files for name, files in read.items() if name not in defined and name not in aten})
    return found


def test_every_private_torch_name_is_listed():
    found = private_torch_names()
    new = {name: sorted(files) for name, files in found.items() if name not in PRIVATE_TORCH}
    gone = sorted(set(PRIVATE_TORCH) - set(found))
    assert not new, f"private torch names used but not listed in PRIVATE_TORCH (say why, and check them on a torch upgrade): {new}"
    assert not gone, f"listed in PRIVATE_TORCH but no longer used (remove them): {gone}"


def test_no_assert_statements_guard_the_library():
    """`python -O` strips `assert`: an invariant of the library raises explicitly."""
    asserts = [f"{path}:{node.lineno}" for path, tree in _sources() for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not asserts, f"assert statements in meshplan (raise AssertionError or a ValueError instead): {asserts}"
