"""fuse_add_rms_norm: a residual add feeding an `rms_norm` -> one `add_rms_norm`.

    sum = add(a, b); out = rms_norm(sum, weight)  ->  out, sum = add_rms_norm(a, b, weight)
The sum stays an output because the residual stream goes on past the norm (the next layer's
residual add reads it). Runs after fuse_rms_norm. Matches only when a and b have the sum's
type (no broadcasting), which is the residual stream's shape; IEEE addition commutes, so
which operand was the residual does not matter.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .dce import eliminate_dead_code
from .match import made_by, same_type


def _defined_before(value, anchor: Node, graph: Graph) -> bool:
    return value is None or value.producer is None or graph.position(value.producer) < graph.position(anchor)


def fuse_add_rms_norm(graph: Graph) -> Graph:
    """Rewrite each add -> rms_norm pair into `add_rms_norm`, in place; dead nodes are removed."""
    fused = set()
    for norm in [n for n in graph.nodes if n.op == "rms_norm"]:
        x, weight = norm.inputs
        add = made_by(x, "add")
        if add is None or id(add) in fused or not all(same_type(v, x) for v in add.inputs):
            continue
        if not _defined_before(weight, add, graph):  # the fused node takes the add's place
            continue
        node = graph.create("add_rms_norm", [add.inputs[0], add.inputs[1], weight], dict(norm.attrs))
        graph.insert_before(add, node)
        graph.replace_all_uses(add.output, node.outputs[1])
        graph.replace_all_uses(norm.output, node.outputs[0])
        fused.add(id(add))
    return eliminate_dead_code(graph)
