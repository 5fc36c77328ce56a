"""Constant folding: evaluate small, statically shaped nodes computed only from constants.

Constants are `full` and `arange` with concrete attributes, and whatever is computed from them
alone (never from graph inputs or parameters). Such a node is run with its op's reference
kernel; if the result is uniform it becomes a single `full`, which later passes (canonicalize,
CSE) and backends handle without computing anything. A non-uniform result (an `arange`, a
causal mask) has no IR form short of a general constant op, so it stays as computed, but still
feeds the folding of the nodes after it (`eq(arange(4), arange(4))` folds to `full(true)`).
"""

from __future__ import annotations

import sympy
import torch

from kiln.ir import Graph, Node, get_op

MAX_FOLDED_ELEMENTS = 4096  # bigger constants are cheaper to compute at run time than to store


def _is_concrete(attr) -> bool:
    if isinstance(attr, tuple):
        return all(_is_concrete(a) for a in attr)
    return not isinstance(attr, sympy.Expr)


def _evaluate(node: Node, known: dict[int, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """The outputs of `node` if it is a small static node over known constants, else None."""
    if any(v is not None and id(v) not in known for v in node.inputs):
        return None
    if not all(_is_concrete(a) for a in node.attrs.values()):
        return None
    for out in node.outputs:
        shape = out.type.shape
        if not all(isinstance(d, int) for d in shape) or torch.Size(shape).numel() > MAX_FOLDED_ELEMENTS:
            return None
    args = [None if v is None else known[id(v)] for v in node.inputs]
    with torch.no_grad():
        result = get_op(node.op).reference(*args, **node.attrs)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _uniform_value(tensor: torch.Tensor):
    """The one value every element of `tensor` holds, or None."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        return None
    return flat[0].item()


def fold_constants(graph: Graph) -> Graph:
    """Replace uniform constant subexpressions by `full` nodes, in place."""
    known: dict[int, torch.Tensor] = {}  # id(Value) -> its constant tensor
    folded = []
    for node in list(graph.nodes):
        results = _evaluate(node, known)
        if results is None:
            continue
        known.update((id(v), t) for v, t in zip(node.outputs, results))
        value = _uniform_value(results[0]) if len(results) == 1 and node.op != "full" else None
        if value is None:
            continue
        out = node.outputs[0]
        full = graph.create("full", [], {"shape": out.type.shape, "value": value, "dtype": out.type.dtype})
        known[id(full.outputs[0])] = results[0]
        graph.insert_after(node, full)
        graph.replace_all_uses(out, full.outputs[0])
        folded.append(node)
    graph.erase(*folded)
    return graph
