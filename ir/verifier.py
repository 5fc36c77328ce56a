"""The verifier: SSA form, op schemas, types re-inferred, and every symbol declared."""

from __future__ import annotations

from .dims import dims_equal
from .errors import KilnError
from .graph import Graph, Value
from .printer import format_node
from .registry import OpError, get_op


class VerificationError(KilnError, ValueError):
    """The graph is malformed; the message names the offending node or value."""


def _same_type(a, b) -> bool:
    return a.dtype == b.dtype and a.rank == b.rank and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def verify(graph: Graph) -> None:
    """Raise VerificationError at the first problem found."""
    defined: set[int] = set()
    names: set[str] = set()

    def define(v: Value, where: str) -> None:
        if v.name in names:
            raise VerificationError(f"{where}: %{v.name} is defined twice")
        names.add(v.name)
        defined.add(id(v))
        unknown = v.type.symbols() - graph.symbols.keys()
        if unknown:
            raise VerificationError(f"{where}: type {v.type} uses undeclared symbols {sorted(unknown)}")

    for v in graph.inputs:
        define(v, f"input %{v.name}")
    for name, v in graph.params.items():
        define(v, f"param %{name}")
        w = graph.weights.get(name)
        if w is not None and tuple(w.shape) != v.type.shape:
            raise VerificationError(f"param %{name}: weight shape {tuple(w.shape)} does not match {v.type}")
    for node in graph.nodes:
        where = f"node `{format_node(node)}`"
        for v in node.inputs:
            if v is not None and id(v) not in defined:
                raise VerificationError(f"{where}: input %{v.name} is not defined before this node (dangling value)")
        try:
            op = get_op(node.op)
            attrs = op.complete_attrs(node.attrs)
            if attrs != node.attrs:
                raise OpError(f"attributes {sorted(node.attrs)} differ from the schema's {sorted(op.attrs)}")
            expected = op.infer_types([v.type if v is not None else None for v in node.inputs], attrs)
        except OpError as e:
            raise VerificationError(f"{where}: {e}") from None
        if len(expected) != len(node.outputs):
            raise VerificationError(f"{where}: op gives {len(expected)} outputs, node has {len(node.outputs)}")
        for v, t in zip(node.outputs, expected):
            if not _same_type(v.type, t):
                raise VerificationError(f"{where}: %{v.name} is typed {v.type} but the op gives {t}")
            define(v, where)
    for v in graph.outputs:
        if id(v) not in defined:
            raise VerificationError(f"graph output %{v.name} is not defined (dangling value)")
