"""Canonicalization: remove no-op nodes and collapse chains of shape ops.

Capture emits many ops that do nothing (a reshape to the shape it already has, an identity
permute, a whole-dim slice, a same-dtype cast, `x * 1.0`, `x + 0`) and chains like
reshape(reshape(x)). Removing them gives the fusion passes one form of each pattern to match.
Rewrites:
- reshape/expand/cast whose result type is the input's type -> the input;
- permute by the identity, slice with start 0, step 1 covering the whole dim -> the input;
- reshape(reshape(x)) -> reshape(x); permute(permute(x)) -> one permute of x;
- mul by full(1), div by full(1), add of full(0), sub of full(0) -> the other operand, when the
  result type equals that operand's type (no broadcast or promotion hidden in the op).
The inner node of a collapsed chain is left for dead-code elimination.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Value, ops_with


def _is_full_of(value: Value | None, constant: float) -> bool:
    node = value.producer if value is not None else None
    return node is not None and node.op == "full" and node.attrs["value"] == constant


def _normalized_perm(node: Node) -> tuple[int, ...]:
    rank = node.inputs[0].type.rank
    return tuple(p % rank for p in node.attrs["perm"])


def _collapse_chain(graph: Graph, node: Node) -> None:
    """reshape(reshape(x)) and permute(permute(x)): make `node` read x directly."""
    inner = node.inputs[0].producer if node.op in ("reshape", "permute") else None
    if inner is None or inner.op != node.op:
        return
    if node.op == "permute":  # out[i] = mid[outer[i]] = x[inner[outer[i]]]
        inner_perm = _normalized_perm(inner)
        node.attrs["perm"] = tuple(inner_perm[p] for p in _normalized_perm(node))
    graph.set_input(node, 0, inner.inputs[0])


def _identity_operand(node: Node) -> Value | None:
    """The input `node` merely passes through, or None if it does real work."""
    if len(node.outputs) != 1:
        return None
    out, a = node.outputs[0], node.inputs[0] if node.inputs else None
    if node.op in ("reshape", "expand", "cast"):
        return a if a.type == out.type else None
    if node.op == "permute":
        return a if _normalized_perm(node) == tuple(range(a.type.rank)) else None
    if node.op == "slice":
        attrs = node.attrs
        return a if attrs["step"] == 1 and attrs["start"] == 0 and a.type == out.type else None
    neutral = {"mul": 1.0, "div": 1.0, "add": 0.0, "sub": 0.0}.get(node.op)
    if neutral is None:
        return None
    b = node.inputs[1]
    if _is_full_of(b, neutral) and a.type == out.type:
        return a
    if node.op in ops_with("commutative") and _is_full_of(a, neutral) and b.type == out.type:
        return b
    return None


def canonicalize(graph: Graph) -> Graph:
    """Apply the rewrites above in one forward sweep, in place."""
    removed = []
    for node in graph.nodes:  # producers come first, so each node sees its inputs' final form
        _collapse_chain(graph, node)
        passed_through = _identity_operand(node)
        if passed_through is not None:
            graph.replace_all_uses(node.outputs[0], passed_through)
            removed.append(node)
    graph.erase(*removed)
    return graph
