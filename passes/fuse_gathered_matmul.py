"""fuse_gathered_matmul: a mixture-of-experts step's expert weights applied where they lie.

Before: matmul(index(W, ids), x)     W [experts, out, in] a parameter, ids [rows], x [rows, in, k]
After:  gathered_matmul(W, ids, x)

How transformers' "batched_mm" experts are captured (frontend/capture.py): each routed row
gathers its expert's whole matrix, then multiplies by it. The gather is a copy of every routed
expert's weights per step (two experts of Mixtral's eight: as many bytes again as the product
reads); `gathered_matmul` names the product so a backend can read the weights in place.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .dce import eliminate_dead_code
from .match import made_by, sole_reader


def _gathered(matmul: Node, graph: Graph) -> Node | None:
    index = made_by(matmul.inputs[0], "index")
    if index is None or len(index.inputs) != 2 or index.inputs[1] is None:
        return None
    weights, ids = index.inputs
    x = matmul.inputs[1]
    if weights.name not in graph.params or weights.type.rank != 3 or ids.type.rank != 1 or x.type.rank != 3:
        return None
    if sole_reader(index.output, graph) is not matmul or x.type.dtype != weights.type.dtype:
        return None
    return graph.create("gathered_matmul", [weights, ids, x])


def fuse_gathered_matmul(graph: Graph) -> Graph:
    """Apply the rewrite above, in place; the gathers become dead and are removed."""
    for node in list(graph.nodes):
        fused = _gathered(node, graph) if node.op == "matmul" else None
        if fused is not None:
            graph.insert_before(node, fused)
            graph.replace_all_uses(node.output, fused.output)
    return eliminate_dead_code(graph)
