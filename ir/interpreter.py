"""The reference interpreter: runs any graph node by node with each op's reference kernel.

It is the oracle every pass and backend is tested against, so it favours clarity over speed
and checks every intermediate against its declared type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy
import torch

from .dims import evaluate, free_symbols
from .dtypes import to_torch
from .errors import KilnError
from .graph import Graph, Value, freeze_attr
from .printer import format_node
from .registry import get_op


class InterpreterError(KilnError, RuntimeError):
    """Inputs do not match the graph, or a node produced something its type does not allow."""


def bind_symbols(graph: Graph, feeds: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Solve the graph's symbols from the inputs' actual shapes (bare-symbol dims bind)."""
    bindings: dict[str, int] = {}
    for v in graph.inputs:
        for d, actual in zip(v.type.shape, feeds[v.name].shape):
            if isinstance(d, sympy.Symbol):
                if bindings.setdefault(d.name, actual) != actual:
                    raise InterpreterError(f"symbol {d.name} is {bindings[d.name]} and {actual} at once")
    for name, value in bindings.items():
        bound = graph.symbols.get(name)
        if bound and not bound.min <= value <= bound.max:
            raise InterpreterError(f"{name}={value} is outside its bounds [{bound.min}, {bound.max}]")
    return bindings


def concrete_shape(type_, bindings) -> tuple[int, ...]:
    return tuple(evaluate(d, bindings) for d in type_.shape)


def _concretize(attr, bindings):
    if isinstance(attr, tuple):
        return tuple(_concretize(a, bindings) for a in attr)
    if isinstance(attr, sympy.Expr):
        return evaluate(attr, bindings)
    return attr


def _check(value: Value, tensor: torch.Tensor, bindings, where: str) -> None:
    shape = concrete_shape(value.type, bindings)
    if tuple(tensor.shape) != shape or tensor.dtype != to_torch(value.type.dtype):
        raise InterpreterError(
            f"{where}: %{value.name} should be {value.type} = {value.type.dtype}{list(shape)}, "
            f"got {tensor.dtype} {list(tensor.shape)}"
        )


def run_graph(
    graph: Graph,
    feeds: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Run `graph` on `feeds` (by input name, or in input order); returns the outputs in order."""
    if not isinstance(feeds, Mapping):
        feeds = {v.name: t for v, t in zip(graph.inputs, feeds)}
    missing = [v.name for v in graph.inputs if v.name not in feeds]
    if missing:
        raise InterpreterError(f"missing graph inputs: {missing}")
    weights = graph.weights if weights is None else weights
    bindings = bind_symbols(graph, feeds)
    env: dict[int, torch.Tensor] = {}
    for v in graph.inputs:
        _check(v, feeds[v.name], bindings, "input")
        env[id(v)] = feeds[v.name]
    for name, v in graph.params.items():
        if name not in weights:
            raise InterpreterError(f"no weight for parameter %{name}")
        env[id(v)] = weights[name]
    with torch.no_grad():
        for node in graph.nodes:
            args = [None if v is None else env[id(v)] for v in node.inputs]
            attrs = {k: _concretize(a, bindings) for k, a in node.attrs.items()}
            result = get_op(node.op).reference(*args, **attrs)
            results = result if isinstance(result, (tuple, list)) else (result,)
            for v, t in zip(node.outputs, results):
                _check(v, t, bindings, f"node `{format_node(node)}`")
                env[id(v)] = t
    return [env[id(v)] for v in graph.outputs]


__all__ = ["InterpreterError", "bind_symbols", "free_symbols", "freeze_attr", "run_graph"]
