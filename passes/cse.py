"""Common-subexpression elimination: a node repeating an earlier one (same op, the very same
input values, equal attributes) is replaced by the earlier one's outputs.

Capture repeats work per layer (the same position `arange`, the same mask, the same constant
`full`); merging it shrinks the graph and lets fusion passes see one shared value.
"""

from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.ir.printer import format_attr


def _key(node: Node) -> tuple:
    # Attributes compare by text form, so 1, 1.0 and true stay distinct.
    attrs = tuple((k, format_attr(v)) for k, v in sorted(node.attrs.items()))
    return node.op, tuple(None if v is None else id(v) for v in node.inputs), attrs


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Merge repeated nodes into their first occurrence, in place."""
    first: dict[tuple, Node] = {}
    duplicates = []
    for node in graph.nodes:  # in order, so a merge is seen by the keys of the nodes after it
        original = first.setdefault(_key(node), node)
        if original is not node:
            for repeated, kept in zip(node.outputs, original.outputs):
                graph.replace_all_uses(repeated, kept)
            duplicates.append(node)
    graph.erase(*duplicates)
    return graph
