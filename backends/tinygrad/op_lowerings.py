"""Kiln IR ops as tinygrad `Tensor` operations: the one table `TENSOR_LOWERINGS`.

A lowering gets the lowering context (symbol bindings, the KV-cache state), the IR node, its
inputs as tinygrad Tensors (None where omitted) and its attributes with dims made tinygrad sizes;
it returns a Tensor (or a tuple for an op with several outputs). Nothing is computed here:
the Tensors are lazy, and tinygrad schedules and fuses them into kernels when the jitted
function realizes its outputs.

Dtypes follow the IR, not tinygrad's promotion: a binary op computes in the dtype the IR
inferred for its output (torch's rules), and `graph_to_tensors` casts any result whose dtype
tinygrad chose differently. `kv_write` and `attention` live in cache_attention.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tinygrad import Tensor, dtypes

from kiln.ir import Node, all_ops
from kiln.ir.dims import dims_equal
from kiln.ir.errors import UnsupportedOpError
from kiln.ir.ops.shape import BIG

from . import cache_attention, quantized_lowerings

TINYGRAD_DTYPES = {
    "f64": dtypes.float64,
    "f32": dtypes.float32,
    "f16": dtypes.float16,
    "bf16": dtypes.bfloat16,
    "i64": dtypes.int64,
    "i32": dtypes.int32,
    "i16": dtypes.int16,
    "i8": dtypes.int8,
    "u8": dtypes.uint8,
    "bool": dtypes.bool,
}


def tiny_dtype(name: str):
    """The tinygrad dtype of an IR dtype name."""
    return TINYGRAD_DTYPES[name]


Lowering = Callable[..., "Tensor | tuple[Tensor, ...]"]


def _in_output_dtype(fn: Callable) -> Lowering:
    """Binary arithmetic computed in the IR's output dtype (torch promotion, not tinygrad's)."""

    def lower(ctx, node, args, attrs):
        dtype = tiny_dtype(node.outputs[0].type.dtype)
        return fn(*(a.cast(dtype) for a in args))

    return lower


def _compare(fn: Callable) -> Lowering:
    """A comparison of both operands in their promoted IR dtype; the result is bool."""

    def lower(ctx, node, args, attrs):
        from kiln.ir.dtypes import promote

        dtype = tiny_dtype(promote(node.inputs[0].type.dtype, node.inputs[1].type.dtype))
        return fn(args[0].cast(dtype), args[1].cast(dtype))

    return lower


def _unary(fn: Callable) -> Lowering:
    return lambda ctx, node, args, attrs: fn(args[0])


def constant_value(value) -> float | None:
    """The scalar a `full` node of shape () holds, else None (e.g. pow's exponent 2.0)."""
    node = value.producer if value is not None else None
    if node is not None and node.op == "full" and tuple(node.attrs["shape"]) == ():
        return node.attrs["value"]
    return None


def _pow(ctx, node, args, attrs):
    base = args[0].cast(tiny_dtype(node.outputs[0].type.dtype))
    exponent = constant_value(node.inputs[1])
    if exponent in (1, 1.0):
        return base
    if exponent in (2, 2.0):  # as torch: x*x exactly, where exp(2*log x) would not be
        return base * base
    if exponent in (3, 3.0):
        return base * base * base
    if exponent == 0.5:
        return base.sqrt()
    return base.pow(args[1].cast(base.dtype))


def _gelu(ctx, node, args, attrs):
    x = args[0]
    if attrs["approximate"] == "tanh":
        return 0.5 * x * (1 + (math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
    return 0.5 * x * (1 + (x * (1 / math.sqrt(2))).erf())


def _axes(attrs) -> tuple[int, ...]:
    return tuple(attrs["axes"])


def _slice(ctx, node, args, attrs):
    x = args[0]
    axis = attrs["axis"] % x.ndim
    size = x.shape[axis]
    start, end, step = attrs["start"], attrs["end"], attrs["step"]
    if isinstance(start, int) and start < 0:
        start += size
    if isinstance(end, int) and end >= BIG:
        end = size
    elif isinstance(end, int) and end < 0:
        end += size
    elif isinstance(end, int) and isinstance(size, int):
        end = min(end, size)
    index = (slice(None),) * axis + (slice(start, end, step),)
    return x[index]


def _index(ctx, node, args, attrs):
    x, *indices = args
    return x[tuple(i.cast(dtypes.int32) for i in indices)]


def _gathered_matmul(ctx, node, args, attrs):
    weights, ids, x = args
    return weights[ids.cast(dtypes.int32)] @ x


def _full(ctx, node, args, attrs):
    return Tensor.full(tuple(attrs["shape"]), attrs["value"], dtype=tiny_dtype(attrs["dtype"]))


def _arange(ctx, node, args, attrs):
    return Tensor.arange(attrs["start"], attrs["end"], attrs["step"], dtype=tiny_dtype(attrs["dtype"]))


def _linear(ctx, node, args, attrs):
    x, weight, bias = args
    return ctx.linear(node, x, weight, bias)


def _embedding(ctx, node, args, attrs):
    weight, ids = args
    return ctx.embedding(node, weight, ids)


def _layer_norm(ctx, node, args, attrs):
    x, weight, bias = args
    y = x.layernorm(axis=-1, eps=attrs["eps"])
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, offset: float) -> Tensor:
    """x / rms(x) * (weight + offset), as `kiln.ir` defines it."""
    y = x * ((x * x).mean(axis=-1, keepdim=True) + eps).rsqrt()
    if weight is None:
        return y
    return y * (weight + offset) if offset else y * weight


def _expand(ctx, node, args, attrs):
    """Dims the expand keeps are -1: a kept symbolic size (batch*seq) may be another UOp than the
    input's own, which tinygrad would refuse to broadcast to."""
    source = node.inputs[0].type.shape
    lead = len(attrs["shape"]) - len(source)
    kept = [i >= lead and dims_equal(source[i - lead], d) for i, d in enumerate(node.attrs["shape"])]
    return args[0].expand(tuple(-1 if keep else d for keep, d in zip(kept, attrs["shape"])))


def _topk(ctx, node, args, attrs):
    values, indices = args[0].topk(attrs["k"], dim=attrs["axis"], largest=attrs["largest"], sorted_=True)
    return values, indices.cast(dtypes.int64)


def _add_rms_norm(ctx, node, args, attrs):
    x, residual, weight = args
    total = x + residual
    return rms_norm(total, weight, attrs["eps"], attrs["offset"]), total


def _rope(ctx, node, args, attrs):
    x, positions, cos_table, sin_table = args
    half = cos_table.shape[-1]
    c = ctx.embedding(node, cos_table, positions).unsqueeze(1)  # [batch, 1, seq, half]
    s = ctx.embedding(node, sin_table, positions).unsqueeze(1)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s] + ([rest] if x.shape[-1] > 2 * half else [])
    return parts[0].cat(*parts[1:], dim=-1)


TENSOR_LOWERINGS: dict[str, Lowering] = {
    "add": _in_output_dtype(lambda a, b: a + b),
    "sub": _in_output_dtype(lambda a, b: a - b),
    "mul": _in_output_dtype(lambda a, b: a * b),
    "div": _in_output_dtype(lambda a, b: a / b),
    "maximum": _in_output_dtype(Tensor.maximum),
    "minimum": _in_output_dtype(Tensor.minimum),
    "pow": _pow,
    "eq": _compare(Tensor.eq),
    "ne": _compare(Tensor.ne),
    "lt": _compare(lambda a, b: a < b),
    "le": _compare(lambda a, b: a <= b),
    "gt": _compare(lambda a, b: a > b),
    "ge": _compare(lambda a, b: a >= b),
    "logical_and": lambda ctx, node, args, attrs: args[0].cast(dtypes.bool) & args[1].cast(dtypes.bool),
    "logical_or": lambda ctx, node, args, attrs: args[0].cast(dtypes.bool) | args[1].cast(dtypes.bool),
    "logical_not": lambda ctx, node, args, attrs: args[0].cast(dtypes.bool).logical_not(),
    "neg": _unary(Tensor.neg),
    "exp": _unary(Tensor.exp),
    "log": _unary(Tensor.log),
    "sqrt": _unary(Tensor.sqrt),
    "rsqrt": _unary(Tensor.rsqrt),
    "reciprocal": _unary(Tensor.reciprocal),
    "abs": _unary(Tensor.abs),
    "tanh": _unary(Tensor.tanh),
    "sin": _unary(Tensor.sin),
    "cos": _unary(Tensor.cos),
    "erf": _unary(Tensor.erf),
    "sigmoid": _unary(Tensor.sigmoid),
    "relu": _unary(Tensor.relu),
    "silu": _unary(lambda x: x * x.sigmoid()),
    "gelu": _gelu,
    "where": lambda ctx, node, args, attrs: (
        args[0].cast(dtypes.bool).where(*(a.cast(tiny_dtype(node.outputs[0].type.dtype)) for a in args[1:]))
    ),
    "cast": lambda ctx, node, args, attrs: args[0].cast(tiny_dtype(attrs["dtype"])),
    "sum": lambda ctx, node, args, attrs: args[0].sum(axis=_axes(attrs), keepdim=attrs["keepdim"]),
    "mean": lambda ctx, node, args, attrs: args[0].mean(axis=_axes(attrs), keepdim=attrs["keepdim"]),
    "max": lambda ctx, node, args, attrs: args[0].max(axis=_axes(attrs), keepdim=attrs["keepdim"]),
    "any": lambda ctx, node, args, attrs: args[0].cast(dtypes.bool).any(axis=_axes(attrs), keepdim=attrs["keepdim"]),
    "cumsum": lambda ctx, node, args, attrs: args[0].cumsum(attrs["axis"]),
    "softmax": lambda ctx, node, args, attrs: args[0].softmax(attrs["axis"]),
    "topk": _topk,
    "reshape": lambda ctx, node, args, attrs: args[0].reshape(tuple(attrs["shape"])),
    "permute": lambda ctx, node, args, attrs: args[0].permute(tuple(attrs["perm"])),
    "expand": _expand,
    "slice": _slice,
    "concat": lambda ctx, node, args, attrs: args[0].cat(*args[1:], dim=attrs["axis"]),
    "index": _index,
    "gathered_matmul": _gathered_matmul,
    "arange": _arange,
    "full": _full,
    "linear": _linear,
    "matmul": lambda ctx, node, args, attrs: ctx.matmul(node, args[0], args[1]),
    "embedding": _embedding,
    "layer_norm": _layer_norm,
    "rms_norm": lambda ctx, node, args, attrs: rms_norm(args[0], args[1], attrs["eps"], attrs["offset"]),
    "add_rms_norm": _add_rms_norm,
    "rope": _rope,
    "linear_q": quantized_lowerings.lower_linear_q,
    "embedding_q": quantized_lowerings.lower_embedding_q,
    "gathered_matmul_q": quantized_lowerings.lower_gathered_matmul_q,
    "kv_write": cache_attention.lower_kv_write,
    "attention": cache_attention.lower_attention,
}


def _refuse_collective(ctx, node, args, attrs):
    if attrs["world_size"] == 1:  # a world of one rank: the identity
        return args[0]
    raise UnsupportedOpError(
        f"the tinygrad backend cannot run a tensor-parallel graph (it has {node.op}). "
        "Fix: compile with --backend inductor (or reference), or without --tensor-parallel"
    )


TENSOR_LOWERINGS.update(all_reduce=_refuse_collective, all_gather=_refuse_collective)


def _refuse_int8_kv(ctx, node, args, attrs):
    raise UnsupportedOpError(
        "the tinygrad backend cannot run an int8 KV cache (it has kv_quantize): its attention reads f32 "
        "caches only. Fix: compile with --kv-cache f32, or --backend inductor for an int8 KV cache"
    )


TENSOR_LOWERINGS["kv_quantize"] = _refuse_int8_kv


def _kv_pages(ctx, node, args, attrs):
    """The rows' slots gathered from a pool by their blocks (a paged graph as a whole is refused
    at lower(): kv_write does not write through a block table here)."""
    pool, table = args
    batch, blocks = table.shape
    _, kv_heads, block_size, last = pool.shape
    rows = pool[table.cast(dtypes.int32)]
    return rows.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, blocks * block_size, last)


TENSOR_LOWERINGS["kv_pages"] = _kv_pages


def check_lowering_table() -> None:
    """Raise UnsupportedOpError naming every registered IR op that TENSOR_LOWERINGS lacks."""
    missing = sorted(set(all_ops()) - set(TENSOR_LOWERINGS))
    if missing:
        raise UnsupportedOpError(
            f"the tinygrad backend has no lowering for IR op(s) {missing}; add them to "
            "TENSOR_LOWERINGS in backends/tinygrad/op_lowerings.py"
        )


def lower_node(ctx, node: Node, args: list, attrs: dict):
    """Apply the table's lowering of `node`; UnsupportedOpError for an op it lacks."""
    if node.op not in TENSOR_LOWERINGS:
        raise UnsupportedOpError(
            f"IR op {node.op!r} has no tinygrad lowering; add it to TENSOR_LOWERINGS "
            "in backends/tinygrad/op_lowerings.py"
        )
    return TENSOR_LOWERINGS[node.op](ctx, node, args, attrs)
