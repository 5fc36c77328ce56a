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


class _Where:
    """`node `...``, formatted only when an error message needs it: verify runs after every pass,
    and printing each node (its symbolic dims through sympy) was most of a pipeline's time."""

    def __init__(self, node):
        self.node = node

    def __str__(self) -> str:
        return f"node `{format_node(self.node)}`"


def _memo_key(node, input_types: tuple):
    """A hashable (op, input types, attrs), or None when an attribute is not hashable."""
    key = (node.op, input_types, tuple((k, type(v), v) for k, v in node.attrs.items()))  # 1 and 1.0 apart
    try:
        hash(key)
    except TypeError:
        return None
    return key


def verify(graph: Graph) -> None:
    """Raise VerificationError at the first problem found."""
    defined: set[int] = set()
    names: set[str] = set()
    # (op, input types, attrs) -> the op's output types: a model's layers repeat the same nodes,
    # so each is inferred once per call; the symbols of each type are looked up once as well
    inferred: dict = {}
    checked_types: set = set()

    def define(v: Value, where: object) -> None:
        if v.name in names:
            raise VerificationError(f"{where}: %{v.name} is defined twice")
        names.add(v.name)
        defined.add(id(v))
        if v.type in checked_types:
            return
        unknown = v.type.symbols() - graph.symbols.keys()
        checked_types.add(v.type)
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
        where = _Where(node)
        for v in node.inputs:
            if v is not None and id(v) not in defined:
                raise VerificationError(f"{where}: input %{v.name} is not defined before this node (dangling value)")
        input_types = tuple(v.type if v is not None else None for v in node.inputs)
        key = _memo_key(node, input_types)
        expected = inferred.get(key) if key is not None else None
        if expected is None:
            try:
                op = get_op(node.op)
                attrs = op.complete_attrs(node.attrs)
                if attrs != node.attrs:
                    raise OpError(f"attributes {sorted(node.attrs)} differ from the schema's {sorted(op.attrs)}")
                expected = op.infer_types(list(input_types), attrs)
            except OpError as e:
                raise VerificationError(f"{where}: {e}") from None
            if key is not None:
                inferred[key] = expected
        if len(expected) != len(node.outputs):
            raise VerificationError(f"{where}: op gives {len(expected)} outputs, node has {len(node.outputs)}")
        for v, t in zip(node.outputs, expected):
            if v.type != t and not _same_type(v.type, t):
                raise VerificationError(f"{where}: %{v.name} is typed {v.type} but the op gives {t}")
            define(v, where)
    for v in graph.outputs:
        if id(v) not in defined:
            raise VerificationError(f"graph output %{v.name} is not defined (dangling value)")
