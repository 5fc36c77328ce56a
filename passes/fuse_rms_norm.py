"""fuse_rms_norm: the RMSNorm formula spelled out in elementwise ops -> one `rms_norm`.

Captured (Llama, Qwen2, Mistral, Gemma, their q/k norms):
    y = x * rsqrt(mean(x ** 2, axes=[-1], keepdim) + eps)         (x * x for x ** 2 too)
    out = weight * y                      -> rms_norm(x, weight) {eps, offset=0}
    out = y * (weight + c)                -> rms_norm(x, weight) {eps, offset=c}   (Gemma: c = 1)
    out = y (no weight)                   -> rms_norm(x) {eps}
Both operand orders of each add and mul match. The op's reference kernel computes the same
expression in the same order, so the rewrite is exact.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Value

from .dce import eliminate_dead_code
from .match import (
    constant,
    is_constant,
    is_vector_over_last_dim,
    made_by,
    reduces_last_axis,
    same_type,
    sole_reader,
    split_operands,
)


def _squared(value: Value) -> Value | None:
    """x if `value` is x ** 2 or x * x."""
    node = made_by(value, "pow", "mul")
    if node is None:
        return None
    a, b = node.inputs
    if node.op == "pow":
        return a if is_constant(b, 2.0) else None
    return a if a is b else None


def _normalized(rsqrt: Node) -> tuple[Value, float, Node] | None:
    """(x, eps, the node computing x * rsqrt(...)) if `rsqrt` is the root of x's mean square + eps."""
    total = made_by(rsqrt.inputs[0], "add")
    split = split_operands(total, lambda v: constant(v) is not None) if total is not None else None
    if split is None:
        return None
    eps, mean_value = constant(split[0]), split[1]
    mean = made_by(mean_value, "mean")
    x = _squared(mean.inputs[0]) if reduces_last_axis(mean) else None
    if x is None:
        return None
    for user in rsqrt.output.users:
        if user.op == "mul" and split_operands(user, lambda v: v is x) and same_type(user.output, x):
            return x, float(eps), user
    return None


def _weight_of(scale: Value, x: Value) -> tuple[Value, float] | None:
    """(weight, offset) if `scale` is weight or weight + offset, a vector over x's last dim."""
    shifted = made_by(scale, "add")
    if shifted is not None:
        split = split_operands(shifted, lambda v: constant(v) is not None)
        if split is not None and is_vector_over_last_dim(split[1], x):
            return split[1], float(constant(split[0]))
    return (scale, 0.0) if is_vector_over_last_dim(scale, x) else None


def _weighted(y: Node, x: Value, graph: Graph) -> tuple[Value | None, float, Node]:
    """(weight, offset, last node of the norm): the weight multiply after y, if there is one."""
    user = sole_reader(y.output, graph)
    if user is not None and user.op == "mul":
        split = split_operands(user, lambda v: v is y.output)
        weight = _weight_of(split[1], x) if split else None
        if weight is not None and same_type(user.output, x):
            return weight[0], weight[1], user
    return None, 0.0, y


def fuse_rms_norm(graph: Graph) -> Graph:
    """Rewrite every RMSNorm pattern above into `rms_norm`, in place; dead nodes are removed."""
    for rsqrt in [n for n in graph.nodes if n.op == "rsqrt"]:
        match = _normalized(rsqrt)
        if match is None:
            continue
        x, eps, y = match
        weight, offset, last = _weighted(y, x, graph)
        norm = graph.create("rms_norm", [x, weight], {"eps": eps, "offset": offset})
        graph.insert_before(last, norm)
        graph.replace_all_uses(last.output, norm.output)
    return eliminate_dead_code(graph)
