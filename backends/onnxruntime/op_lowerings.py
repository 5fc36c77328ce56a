"""The one table from IR op to ONNX nodes: `ONNX_LOWERINGS`.

A lowering gets the builder and the IR node and returns the ONNX name of each output (a str for
one). Every op in the IR registry has an entry (`check_lowering_table` names those that lack
one). These are the plain forms; `contrib_patterns.py` replaces groups of nodes by ONNX Runtime's
fused kernels (GroupQueryAttention, SkipSimplifiedLayerNormalization, ...) before these run.

Types: IR binary ops promote like torch, ONNX ops want equal input types, so inputs are cast to
the IR's result type where they differ.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import helper

from kiln.ir import Node, all_ops
from kiln.ir.dims import dims_equal
from kiln.ir.ops.shape import BIG
from kiln.ir.ops.shape_rules import result_dtype

from . import paged_attention, plain_attention, quantized_lowerings
from .errors import OnnxLoweringError, UnsupportedOpError
from .onnx_builder import INT64_MAX, MS_DOMAIN, NUMPY_DTYPES, OnnxBuilder, elem_type

Lowering = Callable[[OnnxBuilder, Node], "str | list[str]"]


def _binary(onnx_op: str, compare: bool = False, negate: bool = False) -> Lowering:
    def lower(b, node):
        x, y = node.inputs
        dtype = (
            result_dtype((x.type.dtype, x.type.rank), (y.type.dtype, y.type.rank))
            if compare
            else node.output.type.dtype
        )
        out = b.op(onnx_op, b.typed(x, dtype), b.typed(y, dtype))
        return b.op("Not", out) if negate else out

    return lower


def _unary(onnx_op: str, **attrs) -> Lowering:
    return lambda b, node: b.op(onnx_op, b.value(node.inputs[0]), **attrs)


def _logical(onnx_op: str) -> Lowering:
    return lambda b, node: b.op(onnx_op, *(b.typed(v, "bool") for v in node.inputs))


def _silu(b, node):
    x = b.value(node.inputs[0])
    return b.op("Mul", x, b.op("Sigmoid", x))


def _gelu(b, node):
    return b.op("Gelu", b.value(node.inputs[0]), approximate=node.attrs["approximate"])


def _where(b, node):
    cond, x, y = node.inputs
    dtype = node.output.type.dtype
    return b.op("Where", b.typed(cond, "bool"), b.typed(x, dtype), b.typed(y, dtype))


def _reduction(onnx_op: str) -> Lowering:
    def lower(b, node):
        return b.op(
            onnx_op, b.value(node.inputs[0]), b.const(list(node.attrs["axes"])), keepdims=int(node.attrs["keepdim"])
        )

    return lower


def _any(b, node):
    as_int = b.typed(node.inputs[0], "i32")
    reduced = b.op("ReduceMax", as_int, b.const(list(node.attrs["axes"])), keepdims=int(node.attrs["keepdim"]))
    return b.cast(reduced, "i32", "bool")


def _cumsum(b, node):
    x = b.typed(node.inputs[0], node.output.type.dtype)
    return b.op("CumSum", x, b.const(node.attrs["axis"]))


def reshape_target(b: OnnxBuilder, in_shape, out_shape) -> str:
    """The shape tensor of a Reshape: dims kept in place become 0 (copy), one unknown becomes -1,
    so the common reshapes ([b, s, h*d] <-> [b, s, h, d]) need no run-time shape arithmetic."""
    target, unknown = [], []
    for i, d in enumerate(out_shape):
        if isinstance(d, int):
            target.append(d)
        elif i < len(in_shape) and dims_equal(in_shape[i], d):
            target.append(0)
        else:
            target.append(d)
            unknown.append(i)
    if len(unknown) == 1:
        target[unknown[0]] = -1
    return b.shape(target)


def _reshape(b, node):
    x = node.inputs[0]
    return b.op("Reshape", b.value(x), reshape_target(b, x.type.shape, node.output.type.shape))


def _permute(b, node):
    rank = node.inputs[0].type.rank
    return b.op("Transpose", b.value(node.inputs[0]), perm=[p % rank for p in node.attrs["perm"]])


def _slice_bound(b, bound, dim) -> str:
    if isinstance(bound, int):
        return b.const([INT64_MAX if bound >= BIG else bound])
    return b.const([INT64_MAX]) if dims_equal(bound, dim) else b.dim(bound)


def _slice(b, node):
    x = node.inputs[0]
    axis = node.attrs["axis"] % x.type.rank
    dim = x.type.shape[axis]
    return b.op(
        "Slice",
        b.value(x),
        _slice_bound(b, node.attrs["start"], dim),
        _slice_bound(b, node.attrs["end"], dim),
        b.const([axis]),
        b.const([node.attrs["step"]]),
    )


def _concat(b, node):
    dtype = node.output.type.dtype
    return b.op("Concat", *(b.typed(v, dtype) for v in node.inputs), axis=node.attrs["axis"])


def _expand(b, node):
    x = node.inputs[0]
    target = node.output.type.shape
    lead = len(target) - x.type.rank
    # Expand broadcasts both ways: a dim the input already has can stay 1 (no run-time arithmetic).
    dims = [1 if i >= lead and dims_equal(x.type.shape[i - lead], d) else d for i, d in enumerate(target)]
    return b.op("Expand", b.value(x), b.shape(dims))


def _index(b, node):
    x, *indices = node.inputs
    if len(indices) == 1:
        return b.op("Gather", b.value(x), b.value(indices[0]), axis=0)
    lead = node.output.type.shape[: node.output.type.rank - (x.type.rank - len(indices))]
    columns = [b.op("Unsqueeze", b.op("Expand", b.typed(i, "i64"), b.shape(lead)), b.const([-1])) for i in indices]
    return b.op("GatherND", b.value(x), b.op("Concat", *columns, axis=-1))


def _gathered_matmul(b, node):
    weights, ids, x = node.inputs
    gathered = b.op("Gather", b.value(weights), b.value(ids), axis=0)
    return b.op("MatMul", gathered, b.typed(x, weights.type.dtype))


def _arange(b, node):
    start, end, step, dtype = (node.attrs[k] for k in ("start", "end", "step", "dtype"))
    if all(isinstance(v, int) for v in (start, end, step)):
        return b.const(np.arange(start, end, step), NUMPY_DTYPES[dtype])
    values = b.op("Range", b.scalar_dim(start), b.scalar_dim(end), b.scalar_dim(step))
    return b.cast(values, "i64", dtype)


def _full(b, node):
    shape, value, dtype = node.attrs["shape"], node.attrs["value"], node.attrs["dtype"]
    if all(isinstance(d, int) for d in shape):
        return b.const(np.full(shape, value), NUMPY_DTYPES[dtype])
    fill = helper.make_tensor("value", elem_type(dtype), [1], np.array([value], NUMPY_DTYPES[dtype]).tolist())
    return b.op("ConstantOfShape", b.shape(shape), value=fill)


def transposed_weight(b: OnnxBuilder, weight) -> str:
    """W^T [in, out] for MatMul: a transposed initializer when W is a weight (ORT prepacks a
    constant right-hand side once), else a Transpose node."""
    array = b.weight(weight)
    if array is None:
        return b.op("Transpose", b.value(weight), perm=[1, 0])
    name = f"{weight.name}.T"
    if name not in b.initializers:
        b.initializer(name, np.ascontiguousarray(array.T))
    return name


def _linear(b, node):
    x, weight, bias = node.inputs
    y = b.op("MatMul", b.value(x), transposed_weight(b, weight))
    return b.op("Add", y, b.value(bias)) if bias is not None else y


def _matmul(b, node):
    dtype = node.output.type.dtype
    return b.op("MatMul", b.typed(node.inputs[0], dtype), b.typed(node.inputs[1], dtype))


def _embedding(b, node):
    weight, ids = node.inputs
    return b.op("Gather", b.value(weight), b.value(ids), axis=0)


def norm_scale(b: OnnxBuilder, weight, offset: float, hidden, dtype: str) -> str:
    """The scale a normalization multiplies by: weight + offset (folded when the weight is
    constant), or ones when the op has no weight."""
    if weight is None:
        if not isinstance(hidden, int):
            raise OnnxLoweringError("a normalization without weight needs a static last dim")
        return b.const(np.full([hidden], 1.0 + offset), NUMPY_DTYPES[dtype])
    if not offset:
        return b.value(weight)
    array = b.weight(weight)
    if array is not None:
        name = f"{weight.name}+{offset:g}"
        return name if name in b.initializers else b.initializer(name, (array + offset).astype(array.dtype))
    return b.op("Add", b.value(weight), b.const(offset, NUMPY_DTYPES[weight.type.dtype]))


def _layer_norm(b, node):
    x, weight, bias = node.inputs
    scale = norm_scale(b, weight, 0.0, x.type.shape[-1], x.type.dtype)
    inputs = [b.value(x), scale] + ([b.value(bias)] if bias is not None else [])
    return b.op("LayerNormalization", *inputs, axis=-1, epsilon=node.attrs["eps"])


def _rms_norm(b, node):
    x, weight = node.inputs
    scale = norm_scale(b, weight, node.attrs["offset"], x.type.shape[-1], x.type.dtype)
    return b.op("RMSNormalization", b.value(x), scale, axis=-1, epsilon=node.attrs["eps"])


def _add_rms_norm(b, node):
    """(normed, sum) of x + residual: ORT's SkipSimplifiedLayerNormalization, outputs 0 and 3."""
    x, residual, weight = node.inputs
    scale = norm_scale(b, weight, node.attrs["offset"], x.type.shape[-1], x.type.dtype)
    outputs = b.node(
        "SkipSimplifiedLayerNormalization",
        [b.value(x), b.value(residual), scale],
        4,
        domain=MS_DOMAIN,
        epsilon=node.attrs["eps"],
    )
    for name, v in zip((outputs[0], outputs[3]), node.outputs):
        b.declare(name, v.type.dtype, v.type.shape)
    return [outputs[0], outputs[3]]


def _rope(b, node):
    """The `rope` op (rotate-half form) is ORT's RotaryEmbedding on [batch, heads, seq, head_dim]."""
    x, positions, cos_table, sin_table = node.inputs
    heads, head_dim = x.type.shape[1], x.type.shape[3]
    rotary_dim = 2 * cos_table.type.shape[1]
    attrs = {"interleaved": 0}
    if rotary_dim != head_dim:
        attrs.update(rotary_embedding_dim=rotary_dim, num_heads=heads)
    out = b.op(
        "RotaryEmbedding",
        b.value(x),
        b.typed(positions, "i64"),
        b.value(cos_table),
        b.value(sin_table),
        domain=MS_DOMAIN,
        **attrs,
    )
    b.declare(out, node.output.type.dtype, node.output.type.shape)
    return out


def _topk(b, node):
    """ONNX TopK: sorted, ties to the lower index, as the IR's reference."""
    x = node.inputs[0]
    outputs = b.node(
        "TopK",
        [b.value(x), b.const([node.attrs["k"]])],
        2,
        axis=node.attrs["axis"],
        largest=int(node.attrs["largest"]),
        sorted=1,
    )
    return list(outputs)


def _cast(b, node):
    return b.op("Cast", b.value(node.inputs[0]), to=elem_type(node.attrs["dtype"]))


ONNX_LOWERINGS: dict[str, Lowering] = {
    "add": _binary("Add"),
    "sub": _binary("Sub"),
    "mul": _binary("Mul"),
    "div": _binary("Div"),
    "pow": _binary("Pow"),
    "maximum": _binary("Max"),
    "minimum": _binary("Min"),
    "eq": _binary("Equal", compare=True),
    "ne": _binary("Equal", compare=True, negate=True),
    "lt": _binary("Less", compare=True),
    "le": _binary("LessOrEqual", compare=True),
    "gt": _binary("Greater", compare=True),
    "ge": _binary("GreaterOrEqual", compare=True),
    "logical_and": _logical("And"),
    "logical_or": _logical("Or"),
    "logical_not": _logical("Not"),
    "neg": _unary("Neg"),
    "exp": _unary("Exp"),
    "log": _unary("Log"),
    "sqrt": _unary("Sqrt"),
    "rsqrt": lambda b, node: b.op("Reciprocal", b.op("Sqrt", b.value(node.inputs[0]))),
    "reciprocal": _unary("Reciprocal"),
    "abs": _unary("Abs"),
    "tanh": _unary("Tanh"),
    "sin": _unary("Sin"),
    "cos": _unary("Cos"),
    "erf": _unary("Erf"),
    "sigmoid": _unary("Sigmoid"),
    "relu": _unary("Relu"),
    "silu": _silu,
    "gelu": _gelu,
    "where": _where,
    "cast": _cast,
    "sum": _reduction("ReduceSum"),
    "mean": _reduction("ReduceMean"),
    "max": _reduction("ReduceMax"),
    "any": _any,
    "cumsum": _cumsum,
    "topk": _topk,
    "softmax": lambda b, node: b.op("Softmax", b.value(node.inputs[0]), axis=node.attrs["axis"]),
    "reshape": _reshape,
    "permute": _permute,
    "slice": _slice,
    "concat": _concat,
    "expand": _expand,
    "index": _index,
    "gathered_matmul": _gathered_matmul,
    "arange": _arange,
    "full": _full,
    "linear": _linear,
    "matmul": _matmul,
    "embedding": _embedding,
    "linear_q": quantized_lowerings.lower_linear_q,
    "embedding_q": quantized_lowerings.lower_embedding_q,
    "gathered_matmul_q": quantized_lowerings.lower_gathered_matmul_q,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rope": _rope,
    "attention": plain_attention.lower_attention,
    "kv_write": plain_attention.lower_kv_write,
    "kv_pages": paged_attention.lower_kv_pages,
}


def _refuse_collective(b, node):
    if node.attrs["world_size"] == 1:  # a world of one rank: the identity
        return b.op("Identity", b.value(node.inputs[0]))
    raise UnsupportedOpError(
        f"the onnxruntime backend cannot run a tensor-parallel graph (it has {node.op}). "
        "Fix: compile with --backend inductor (or reference), or without --tensor-parallel"
    )


ONNX_LOWERINGS.update(all_reduce=_refuse_collective, all_gather=_refuse_collective)


def _refuse_int8_kv(b, node):
    raise UnsupportedOpError(
        "the onnxruntime backend cannot run an int8 KV cache (it has kv_quantize): GroupQueryAttention's "
        "quantized cache takes fixed per-tensor or per-channel scales, not one per token and head. "
        "Fix: compile with --kv-cache f32, or --backend inductor for an int8 KV cache"
    )


ONNX_LOWERINGS["kv_quantize"] = _refuse_int8_kv


def check_lowering_table() -> None:
    """Raise UnsupportedOpError naming every registered IR op that ONNX_LOWERINGS lacks."""
    missing = sorted(set(all_ops()) - set(ONNX_LOWERINGS))
    if missing:
        raise UnsupportedOpError(
            f"the onnxruntime backend has no lowering for IR op(s) {missing}; "
            "add them to ONNX_LOWERINGS in backends/onnxruntime/op_lowerings.py"
        )
