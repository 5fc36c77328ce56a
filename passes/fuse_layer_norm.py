"""fuse_layer_norm: LayerNorm spelled out in elementwise ops -> one `layer_norm`.

    d = x - mean(x, axes=[-1], keepdim)
    y = d * rsqrt(mean(d ** 2, axes=[-1], keepdim) + eps)      (or d / sqrt(...); d * d for d ** 2)
    out = y * weight + bias                                     (weight, bias optional)
 -> layer_norm(x, weight, bias) {eps}
torch.export keeps `nn.LayerNorm` whole (GPT-2's norms arrive as `layer_norm` already); this
catches models that write the formula by hand. `layer_norm`'s kernel computes the variance its
own way, so the result moves within float rounding, not bit for bit.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Value

from .dce import eliminate_dead_code
from .match import constant, is_vector_over_last_dim, made_by, reduces_last_axis, same_type, sole_reader, split_operands


def _centered(value: Value) -> Value | None:
    """x if value = x - mean(x) over the last axis."""
    sub = made_by(value, "sub")
    mean = made_by(sub.inputs[1], "mean") if sub is not None else None
    return sub.inputs[0] if reduces_last_axis(mean) and mean.inputs[0] is sub.inputs[0] else None


def _variance_of(value: Value) -> Value | None:
    """d if value = mean(d ** 2) (or mean(d * d)) over the last axis."""
    mean = made_by(value, "mean")
    square = made_by(mean.inputs[0], "pow", "mul") if reduces_last_axis(mean) else None
    if square is None:
        return None
    d, other = square.inputs
    if square.op == "pow":
        return d if constant(other) == 2 else None
    return d if d is other else None


def _normalized(root: Node) -> tuple[Value, float, Node] | None:
    """(x, eps, the node giving y) for root = rsqrt(var + eps) or sqrt(var + eps)."""
    total = made_by(root.inputs[0], "add")
    split = split_operands(total, lambda v: constant(v) is not None) if total is not None else None
    d = _variance_of(split[1]) if split else None
    x = _centered(d) if d is not None else None
    if x is None:
        return None
    op = "mul" if root.op == "rsqrt" else "div"
    for user in root.output.users:
        operands = split_operands(user, lambda v: v is d) if user.op == op else None
        if operands is not None and (op == "mul" or user.inputs[0] is d) and same_type(user.output, x):
            return x, float(constant(split[0])), user
    return None


def _affine(y: Node, x: Value, graph: Graph) -> tuple[Value | None, Value | None, Node]:
    """(weight, bias, last node) of the `* weight + bias` after y; each part optional."""
    weight = bias = None
    last = y
    for op in ("mul", "add"):
        user = sole_reader(last.output, graph)
        applies = user is not None and user.op == op
        split = split_operands(user, lambda v, out=last.output: v is out) if applies else None
        if split is None or not is_vector_over_last_dim(split[1], x) or not same_type(user.output, x):
            continue
        if op == "mul":
            weight = split[1]
        else:
            bias = split[1]
        last = user
    return weight, bias, last


def fuse_layer_norm(graph: Graph) -> Graph:
    """Rewrite every LayerNorm pattern above into `layer_norm`, in place; dead nodes are removed."""
    for root in [n for n in graph.nodes if n.op in ("rsqrt", "sqrt")]:
        match = _normalized(root)
        if match is None:
            continue
        x, eps, y = match
        weight, bias, last = _affine(y, x, graph)
        norm = graph.create("layer_norm", [x, weight, bias], {"eps": eps})
        graph.insert_before(last, norm)
        graph.replace_all_uses(last.output, norm.output)
    return eliminate_dead_code(graph)
