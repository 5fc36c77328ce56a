"""fold_linear_reshapes: flatten -> linear -> unflatten around a linear -> the linear alone.

    reshape(linear(reshape(x, [b*s, in]), W, bias), [b, s, out])  ->  linear(x, W, bias)
`linear` applies to the last axis whatever the leading dims, so the flatten (GPT-2's Conv1D does
`x.view(-1, in)` before its addmm) and the reshape back are no-ops around it. When the flatten
also merged other dims (attention heads: [b, s, h, d] -> [b*s, h*d]) one reshape to
[b, s, h*d] stays. Runs after fold_transposes and fuse_bias_activation, which turn GPT-2's
addmm into one biased `linear`.
"""

from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.ir.dims import dims_equal
from kiln.ir.ops.shape_rules import numel

from .dce import eliminate_dead_code
from .match import has_shape, made_by, sole_reader


def _unflattened(outer: Node, graph: Graph) -> list[Node] | None:
    """New nodes computing `outer`'s value as linear(x in outer's leading dims), or None."""
    linear = made_by(outer.inputs[0], "linear")
    flatten = made_by(linear.inputs[0], "reshape") if linear is not None else None
    if flatten is None or sole_reader(linear.output, graph) is not outer:
        return None
    x, flat, lead = flatten.inputs[0], flatten.output, outer.output.type.shape[:-1]
    if flat.type.rank != 2 or not dims_equal(flat.type.shape[0], numel(lead)):
        return None
    nodes = []
    if not has_shape(x, lead + flat.type.shape[1:]):  # e.g. heads merged by the same flatten
        nodes.append(graph.create("reshape", [x], {"shape": lead + flat.type.shape[1:]}))
        x = nodes[-1].output
    return nodes + [graph.create("linear", [x, linear.inputs[1], linear.inputs[2]])]


def fold_linear_reshapes(graph: Graph) -> Graph:
    """Drop the reshapes around linears described above, in place; dead nodes are removed."""
    for node in [n for n in graph.nodes if n.op == "reshape"]:
        nodes = _unflattened(node, graph)
        if nodes is not None:
            graph.insert_before(node, *nodes)
            graph.replace_all_uses(node.output, nodes[-1].output)
    return eliminate_dead_code(graph)
