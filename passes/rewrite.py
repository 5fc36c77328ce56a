"""Graph edits the passes share: replace a value by another, drop nodes, insert nodes.

`replace_value` keeps graph output names stable: when the replaced value is a graph output,
its name moves to the replacement, so `output %logits` still says `logits` after a rewrite.
"""
from __future__ import annotations

from kiln.ir import Graph, Node, Value


def replace_value(graph: Graph, old: Value, new: Value) -> None:
    """Point every use of `old` (graph outputs included) at `new`; the caller drops old's node."""
    keeps_output_name = (any(v is old for v in graph.outputs) and new.producer is not None
                         and not any(v is new for v in graph.outputs))
    graph.replace_all_uses(old, new)
    if keeps_output_name:
        # Swap rather than rename: both names stay claimed, and dropping old's node releases
        # the name `new` had before.
        old.name, new.name = new.name, old.name


def drop_nodes(graph: Graph, dead: list[Node]) -> None:
    """Remove `dead` nodes (whose outputs are no longer used) and release their names."""
    dead_ids = {id(n) for n in dead}
    graph.nodes = [n for n in graph.nodes if id(n) not in dead_ids]
    for node in dead:
        graph.forget_names(node)


def insert_before(graph: Graph, anchor: Node, nodes: list[Node]) -> None:
    """Put `nodes` (made with `graph.create`, in order) into the graph just before `anchor`."""
    index = next(i for i, n in enumerate(graph.nodes) if n is anchor)
    graph.nodes[index:index] = nodes
