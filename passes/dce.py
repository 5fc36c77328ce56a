"""Dead-code elimination: drop nodes whose outputs reach no graph output, and unused params.

Every other pass leaves dead nodes behind (a folded chain, a replaced no-op) rather than
tracking uses itself; this pass sweeps them up, and drops the weights nothing reads any more
so artifacts do not carry them. Graph inputs are kept: they are the signature.
"""
from __future__ import annotations

from kiln.ir import Graph


def eliminate_dead_code(graph: Graph) -> Graph:
    """Remove dead nodes and unused parameters (with their weights) in place."""
    live = {id(v) for v in graph.outputs}
    kept = []
    for node in reversed(graph.nodes):  # IR ops are pure, so an unused result is dead
        if any(id(v) in live for v in node.outputs):
            kept.append(node)
            live.update(id(v) for v in node.inputs if v is not None)
        else:
            graph.forget_names(node)
    graph.nodes = kept[::-1]
    for name, value in list(graph.params.items()):
        if id(value) not in live:
            graph.remove_param(name)
    return graph
