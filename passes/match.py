"""Pattern matching for the fusion passes: small questions about a value's producer.

Each fusion pass matches its pattern by hand, producer by producer from an anchor node, so
that the matcher reads like the formula it recognizes. These are the questions they share:
which op made this value, is it a constant and which, which operand of a commutative op is
the one we look for, is an axis the last one, is a value read by exactly one node (its `users`,
which the graph keeps current).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kiln.ir import Graph, Node, Value, ops_with
from kiln.ir.dims import dims_equal


def made_by(value: Value | None, *ops: str) -> Node | None:
    """The node that produced `value` if its op is one of `ops`, else None."""
    node = value.producer if value is not None else None
    return node if node is not None and node.op in ops else None


def constant(value: Value | None):
    """The scalar a `full` node fills `value` with, else None."""
    node = made_by(value, "full")
    return node.attrs["value"] if node is not None else None


def is_constant(value: Value | None, expected: float, rel: float = 1e-6) -> bool:
    """`value` is a `full` of `expected` (to a relative tolerance: captured constants are rounded)."""
    c = constant(value)
    return c is not None and not isinstance(c, bool) and math.isclose(c, expected, rel_tol=rel)


def split_operands(node: Node, wanted: Callable[[Value], bool]) -> tuple[Value, Value] | None:
    """(the operand for which `wanted` holds, the other one); both orders tried for a commutative op."""
    a, b = node.inputs[0], node.inputs[1]
    if wanted(a):
        return a, b
    if node.op in ops_with("commutative") and wanted(b):
        return b, a
    return None


def is_last_axis(axis: int, rank: int) -> bool:
    return axis in (-1, rank - 1)


def reduces_last_axis(node: Node | None) -> bool:
    """A reduction over the last axis only, keeping it as a dim of size 1."""
    if node is None or not node.attrs.get("keepdim"):
        return False
    axes = node.attrs["axes"]
    return len(axes) == 1 and is_last_axis(axes[0], node.inputs[0].type.rank)


def sole_reader(value: Value, graph: Graph | None = None) -> Node | None:
    """The one node reading `value`, or None if several (or none) do, or it is an output of `graph`."""
    if len(value.users) != 1 or (graph is not None and graph.is_output(value)):
        return None
    return value.users[0]


def has_shape(value: Value, shape: tuple) -> bool:
    return value.type.rank == len(shape) and all(dims_equal(a, b) for a, b in zip(value.type.shape, shape))


def same_shape(a: Value, b: Value) -> bool:
    return has_shape(a, b.type.shape)


def same_type(a: Value, b: Value) -> bool:
    return a.type.dtype == b.type.dtype and same_shape(a, b)


def is_vector_over_last_dim(value: Value, x: Value) -> bool:
    """`value` is rank 1 with x's last dim (a per-channel weight or bias for x)."""
    return value.type.rank == 1 and dims_equal(value.type.shape[0], x.type.shape[-1])
