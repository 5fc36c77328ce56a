"""Recognize an additive ALiBi bias on attention scores and recover its per-head slopes.

BLOOM adds slope[h] * key_index to the scores, MPT slope[h] * (key_index - keys + 1) sliced out
of a table; both are built from constants and the call's sizes alone, no graph input. Such a
bias is run by the reference kernels at a concrete batch and length, and accepted when in every
row it grows linearly with the key index at one slope per head. Softmax ignores a constant per
row, so the slopes are all the `attention` op needs (its `alibi` attribute).
"""

from __future__ import annotations

import sympy
import torch

from kiln.ir import Graph, Node, Value, get_op
from kiln.ir.dims import evaluate

MAX_NODES = 64  # a bias subgraph is a handful of ops; a walk past this is not one
SAMPLE_SIZE = 12  # each symbol is bound to this (within its bounds) to evaluate the bias


def constant_subgraph(graph: Graph, value: Value) -> list[Node] | None:
    """The nodes computing `value` from constants and weights alone, in graph order; None when
    it reads a graph input (tokens, positions) or takes more than MAX_NODES nodes."""
    nodes, seen, stack = [], set(), [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer
        if node is None:
            if v.name in graph.weights:
                continue
            return None
        nodes.append(node)
        if len(nodes) > MAX_NODES:
            return None
        stack += [i for i in node.inputs if i is not None]
    return sorted(nodes, key=graph.position)


def sample_bindings(graph: Graph) -> dict[str, int]:
    """A concrete size for every symbol of the graph: SAMPLE_SIZE, clipped to its bounds."""
    return {name: max(bound.min, min(bound.max, SAMPLE_SIZE)) for name, bound in graph.symbols.items()}


def run_subgraph(graph: Graph, nodes: list[Node], value: Value, bindings: dict[str, int]) -> torch.Tensor:
    """`value` computed by the reference kernels under `bindings`."""

    def concrete(a):
        if isinstance(a, tuple):
            return tuple(concrete(x) for x in a)
        return evaluate(a, bindings) if isinstance(a, sympy.Expr) else a

    env = {id(v): graph.weights[name] for name, v in graph.params.items() if name in graph.weights}
    with torch.no_grad():
        for node in nodes:
            args = [None if v is None else env[id(v)] for v in node.inputs]
            result = get_op(node.op).reference(*args, **{k: concrete(a) for k, a in node.attrs.items()})
            for out, t in zip(node.outputs, result if isinstance(result, tuple) else (result,)):
                env[id(out)] = t
    return env[id(value)]


def alibi_slopes(graph: Graph, bias: Value, at: Value, scores_shape: tuple) -> tuple[float, ...] | None:
    """Per-head slopes if `bias`, added to `at` (the scores, [b, h, s, t] or [b*h, s, t]), is
    slope[h] * key_index plus a constant per row; `scores_shape` is the 4-D [b, h, s, t]."""
    if not bias.type.dtype.startswith(("f", "bf")):
        return None
    nodes = constant_subgraph(graph, bias)
    if nodes is None:
        return None
    bindings = sample_bindings(graph)
    try:
        shape4 = tuple(evaluate(d, bindings) for d in scores_shape)
        flat = tuple(evaluate(d, bindings) for d in at.type.shape)
        values = run_subgraph(graph, nodes, bias, bindings).double()
        values = values.broadcast_to(flat).reshape(shape4)
    except (ValueError, RuntimeError, KeyError):
        return None
    keys = shape4[3]
    if keys < 2 or not torch.isfinite(values).all():
        return None
    growth = values - values[..., :1]  # the per-row constant removed
    slopes = growth[..., -1] / (keys - 1)  # [b, h, s]
    per_head = slopes[0, :, 0]
    expected = per_head[None, :, None, None] * torch.arange(keys, dtype=torch.float64)
    tolerance = 1e-5 * (1.0 + float(per_head.abs().max()) * keys)
    if not per_head.abs().max() > 0 or not torch.allclose(growth, expected.expand_as(growth), rtol=0, atol=tolerance):
        return None
    return tuple(float(s) for s in per_head)
