"""The IR: a traced model as a flat list of nodes with tensor metas, module paths and parameter FQNs."""

from meshplan.ir.graph import Graph, Node, TensorMeta, TensorRef
from meshplan.ir.mesh import MeshSpec
from meshplan.ir.placement import Partial, Placement, Placements, Replicate, Shard
from meshplan.ir.trace import TraceError, trace

__all__ = [
    "Graph", "MeshSpec", "Node", "Partial", "Placement", "Placements", "Replicate", "Shard", "TensorMeta", "TensorRef",
    "TraceError", "trace",
]
