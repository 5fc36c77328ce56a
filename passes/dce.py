"""Dead-code elimination: drop nodes whose outputs reach no graph output, and unused params.

Every other pass leaves dead nodes behind (a folded chain, a replaced no-op) rather than
tracking uses itself; this pass sweeps them up, and drops the weights nothing reads any more
so artifacts do not carry them. Graph inputs are kept: they are the signature.
"""

from __future__ import annotations

from kiln.ir import Graph, Value


def _is_live(value: Value, graph: Graph, dead: set[int]) -> bool:
    return graph.is_output(value) or any(id(u) not in dead for u in value.users)


def eliminate_dead_code(graph: Graph) -> Graph:
    """Remove dead nodes and unused parameters (with their weights) in place."""
    dead_nodes, dead = [], set()
    for node in reversed(graph.nodes):  # IR ops are pure, so an unused result is dead
        if not any(_is_live(v, graph, dead) for v in node.outputs):
            dead_nodes.append(node)
            dead.add(id(node))
    graph.erase(*dead_nodes)
    for name, value in list(graph.params.items()):
        if not _is_live(value, graph, dead):
            graph.remove_param(name)
    return graph
