"""fuse_bias_activation: a bias add into its `linear`, activations spelled out -> one op.

Bias:   add(linear(x, W), b)            -> linear(x, W, b)     b a vector over the output dim
SiLU:   mul(v, sigmoid(v))              -> silu(v)             (how Llama's MLP is captured)
GELU:   0.5 * v * (1 + tanh(sqrt(2/pi) * (v + 0.044715 * v ** 3)))   -> gelu(v) {approximate="tanh"}
        0.5 * v * (1 + erf(v / sqrt(2)))                           -> gelu(v) {approximate="none"}
(GPT-2's `gelu_new` is the tanh form.) The fused form of bias + activation is
`act(linear(x, W, b))`: no new op, because every backend already fuses an elementwise epilogue
into its matrix product (Inductor does; ONNX Runtime has BiasGelu/FastGelu), and a `linear`
with an activation attribute would be one more thing for every backend to lower. What this
pass gives them is the one-op form of each piece to recognize.
"""

from __future__ import annotations

import math

from kiln.ir import Graph, Node, Value

from .dce import eliminate_dead_code
from .match import is_constant, is_vector_over_last_dim, made_by, same_type, sole_reader, split_operands

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715


def _is_unbiased_linear(value: Value) -> bool:
    linear = made_by(value, "linear")
    return linear is not None and linear.inputs[2] is None


def _bias_fold(add: Node, graph: Graph) -> Node | None:
    """linear(x, W, b) for add(linear(x, W), b), else None."""
    split = split_operands(add, _is_unbiased_linear)
    if split is None:
        return None
    linear_out, bias = split
    linear = linear_out.producer
    if not is_vector_over_last_dim(bias, linear_out) or bias.type.dtype != linear_out.type.dtype:
        return None
    if not same_type(add.output, linear_out) or sole_reader(linear_out, graph) is not add:
        return None
    return graph.create("linear", [linear.inputs[0], linear.inputs[1], bias])


def _silu(mul: Node, graph: Graph) -> Node | None:
    split = split_operands(mul, lambda v: made_by(v, "sigmoid") is not None)
    if split is None or made_by(split[0], "sigmoid").inputs[0] is not split[1]:
        return None
    return graph.create("silu", [split[1]])


def _tanh_gelu_argument(value: Value, v: Value) -> bool:
    """value == sqrt(2/pi) * (v + 0.044715 * v ** 3)."""
    outer = made_by(value, "mul")
    split = split_operands(outer, lambda c: is_constant(c, SQRT_2_OVER_PI)) if outer else None
    inner = made_by(split[1], "add") if split else None
    split = split_operands(inner, lambda t: t is v) if inner else None
    cubic = made_by(split[1], "mul") if split else None
    split = split_operands(cubic, lambda c: is_constant(c, GELU_TANH_CUBIC)) if cubic else None
    power = made_by(split[1], "pow") if split else None
    return power is not None and power.inputs[0] is v and is_constant(power.inputs[1], 3.0)


def _erf_gelu_argument(value: Value, v: Value) -> bool:
    """value == v / sqrt(2) (or v * sqrt(1/2))."""
    node = made_by(value, "mul", "div")
    if node is None:
        return False
    if node.op == "div":
        return node.inputs[0] is v and is_constant(node.inputs[1], math.sqrt(2.0))
    split = split_operands(node, lambda t: t is v)
    return split is not None and is_constant(split[1], math.sqrt(0.5))


def _gelu(mul: Node, graph: Graph) -> Node | None:
    """gelu(v) for mul(0.5 * v, 1 + tanh(...) | 1 + erf(...)), else None."""
    half = split_operands(
        mul, lambda h: made_by(h, "mul") is not None and any(is_constant(c, 0.5) for c in made_by(h, "mul").inputs)
    )
    if half is None:
        return None
    half_node, one_plus = made_by(half[0], "mul"), made_by(half[1], "add")
    v = half_node.inputs[1] if is_constant(half_node.inputs[0], 0.5) else half_node.inputs[0]
    split = split_operands(one_plus, lambda c: is_constant(c, 1.0)) if one_plus else None
    curve = made_by(split[1], "tanh", "erf") if split else None
    if curve is None or not same_type(mul.output, v):
        return None
    if curve.op == "tanh" and _tanh_gelu_argument(curve.inputs[0], v):
        return graph.create("gelu", [v], {"approximate": "tanh"})
    if curve.op == "erf" and _erf_gelu_argument(curve.inputs[0], v):
        return graph.create("gelu", [v], {"approximate": "none"})
    return None


def fuse_bias_activation(graph: Graph) -> Graph:
    """Apply the rewrites above, in place; dead nodes are removed."""
    for node in list(graph.nodes):
        fused = None
        if node.op == "add":
            fused = _bias_fold(node, graph)
        elif node.op == "mul":
            fused = _silu(node, graph) or _gelu(node, graph)
        if fused is not None:
            graph.insert_before(node, fused)
            graph.replace_all_uses(node.output, fused.output)
    return eliminate_dead_code(graph)
