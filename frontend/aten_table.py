"""The one table from ATen ops to Kiln IR ops.

It covers core ATen (what `run_decompositions` leaves) and the handful of non-core ops that
torch.export's training IR holds for common models (`to.dtype`, `type_as`, `layer_norm`, `diff`,
`__and__`, the grad/autocast wrappers), so most models convert without a decomposition retrace.

Each handler receives the conversion state and the FX node's args/kwargs and returns the IR
value (or a tuple for multi-output ops, or None for ops that vanish, like metadata asserts).
Output shapes of pure shape ops are taken from what torch.export recorded, so `-1`s and
SymInt arithmetic arrive already resolved.
"""

from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled

from kiln.ir import from_torch
from kiln.ir.ops.shape_rules import numel

aten = torch.ops.aten
ATEN_TO_IR: dict = {}


def handles(*targets):
    def register(fn):
        for t in targets:
            ATEN_TO_IR[t] = fn
        return fn

    return register


def _meta(cx):
    return cx.current.meta["val"]


def _out_shape(cx):
    return tuple(cx.dim(d) for d in _meta(cx).shape)


def _like(arg):
    return arg.meta["val"] if isinstance(arg, torch.fx.Node) else torch.tensor(arg)


# -- things that disappear ----------------------------------------------------------------
@handles(
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
)
def _drop(cx, *args, **kwargs):
    return None


@handles(
    aten.clone.default,
    aten.alias.default,
    aten.contiguous.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.dropout.default,
)
def _identity(cx, x, *args, **kwargs):
    return cx.value(x)


@handles(wrap_with_set_grad_enabled)
def _grad_mode_region(cx, enabled, body, *args):
    return cx.inline(body, args)  # inference has no grad: the region is just its ops


@handles(wrap_with_autocast)
def _autocast_region(cx, device_type, dtype, enabled, cache_enabled, body, *args):
    if enabled:
        raise NotImplementedError("an enabled autocast region (it changes dtypes op by op)")
    return cx.inline(body, args)


@handles(operator.getitem)
def _getitem(cx, tup, index):
    item = cx.env[tup][index]
    if item is None:
        raise NotImplementedError(f"output {index} of {tup.target} is not supported by Kiln")
    return item


# -- elementwise --------------------------------------------------------------------------
def _binary(op):
    def handler(cx, a, b, **kwargs):
        if kwargs.get("alpha", 1) != 1:
            b_val = cx.call("mul", cx.operand(b, _like(a)), cx.constant(kwargs["alpha"], from_torch(_meta(cx).dtype)))
            return cx.call(op, cx.operand(a, _like(b)), b_val)
        if kwargs.get("rounding_mode"):
            raise NotImplementedError("div with rounding_mode")
        return cx.call(op, cx.operand(a, _like(b)), cx.operand(b, _like(a)))

    return handler


for _name, _ir in {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "eq": "eq",
    "ne": "ne",
    "lt": "lt",
    "le": "le",
    "gt": "gt",
    "ge": "ge",
    "maximum": "maximum",
    "minimum": "minimum",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "bitwise_and": "logical_and",
    "bitwise_or": "logical_or",
    "__and__": "logical_and",
    "__or__": "logical_or",
}.items():
    _packet = getattr(aten, _name)
    handles(*[getattr(_packet, o) for o in ("Tensor", "Scalar", "default") if hasattr(_packet, o)])(_binary(_ir))

VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.alias.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.numpy_T.default,
}


def _in_place(op):
    """x.add_(y) where nothing else views x (Falcon's `mlp_output += attention_output`): the sum
    becomes x's value for the ops after it. Views would need aliasing, which the decomposed (and
    functionalized) program has resolved: they are left to it."""
    out_of_place = _binary(op)

    def handler(cx, x, *args, **kwargs):
        if x.op == "placeholder" or x.target in VIEW_OPS or any(u.target in VIEW_OPS for u in x.users):
            raise NotImplementedError("an in-place op on a view or an input")
        result = out_of_place(cx, x, *args, **kwargs)
        cx.env[x] = result
        return result

    return handler


for _name in ("add_", "sub_", "mul_", "div_"):
    handles(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_in_place(_name[:-1]))

handles(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)(_binary("pow"))
handles(aten.rsub.Scalar, aten.rsub.Tensor)(lambda cx, a, b, alpha=1: _binary("sub")(cx, b, a))

for _name in (
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "abs",
    "tanh",
    "sin",
    "cos",
    "erf",
    "sigmoid",
    "relu",
    "silu",
    "logical_not",
):
    handles(getattr(aten, _name).default)(lambda cx, x, _op=_name: cx.call(_op, cx.value(x)))
handles(aten.bitwise_not.default)(lambda cx, x: cx.call("logical_not", cx.value(x)))


@handles(aten.gelu.default)
def _gelu(cx, x, approximate="none"):
    return cx.call("gelu", cx.value(x), approximate=approximate)


@handles(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default)
def _to_copy(cx, x, *args, **kwargs):
    v = cx.value(x)
    target = from_torch(_meta(cx).dtype)
    return v if target == v.type.dtype else cx.call("cast", v, dtype=target)


@handles(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def _where(cx, cond, a, b):
    dtype = _meta(cx).dtype

    def operand(t):
        return cx.value(t) if isinstance(t, torch.fx.Node) else cx.constant(t, from_torch(dtype))

    return cx.call("where", cx.value(cond), operand(a), operand(b))


@handles(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(cx, x, mask, value):
    fill = cx.value(value) if isinstance(value, torch.fx.Node) else cx.constant(value, cx.value(x).type.dtype)
    return cx.call("where", cx.value(mask), fill, cx.value(x))


@handles(aten.clamp.default)
def _clamp(cx, x, min=None, max=None):
    v = cx.value(x)
    if min is not None:
        v = cx.call("maximum", v, cx.constant(min, v.type.dtype))
    if max is not None:
        v = cx.call("minimum", v, cx.constant(max, v.type.dtype))
    return v


# -- reductions ---------------------------------------------------------------------------
def _reduction(op):
    def handler(cx, x, dims=None, keepdim=False, dtype=None):
        v = cx.value(x)
        axes = tuple(range(v.type.rank)) if dims is None else ((dims,) if isinstance(dims, int) else tuple(dims))
        return cx.call(op, v, axes=axes, keepdim=keepdim)

    return handler


handles(aten.mean.dim, aten.mean.default)(_reduction("mean"))
handles(aten.sum.dim_IntList, aten.sum.default)(_reduction("sum"))
handles(aten.amax.default)(_reduction("max"))
handles(aten.any.dim, aten.any.dims, aten.any.default)(_reduction("any"))


@handles(aten.topk.default)
def _topk(cx, x, k, dim=-1, largest=True, sorted=True):
    """A mixture-of-experts router's choice; values come sorted either way (Kiln's `topk` sorts)."""
    return cx.call("topk", cx.value(x), k=int(k), axis=dim, largest=bool(largest))


@handles(aten.cumsum.default)
def _cumsum(cx, x, dim, dtype=None):
    return cx.call("cumsum", cx.value(x), axis=dim)


@handles(aten._softmax.default, aten.softmax.int)
def _softmax(cx, x, dim, *rest, **kwargs):
    return cx.call("softmax", cx.value(x), axis=dim)


# -- shapes -------------------------------------------------------------------------------
@handles(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
)
def _reshape(cx, x, *args):
    return cx.call("reshape", cx.value(x), shape=_out_shape(cx))


@handles(aten.expand.default)
def _expand(cx, x, size, *args, **kwargs):
    return cx.call("expand", cx.value(x), shape=_out_shape(cx))


@handles(aten.repeat.default)
def _repeat(cx, x, repeats):
    """Tile: each dim d becomes [r, d] by a broadcast, then r*d (BLOOM repeats its ALiBi rows)."""
    v = cx.value(x)
    shape = (1,) * (len(repeats) - v.type.rank) + v.type.shape
    counts = [cx.dim(r) for r in repeats]
    spread = cx.call("reshape", v, shape=tuple(d for size in shape for d in (1, size)))
    tiled = cx.call("expand", spread, shape=tuple(d for r, size in zip(counts, shape) for d in (r, size)))
    return cx.call("reshape", tiled, shape=_out_shape(cx))


@handles(aten.repeat_interleave.self_int)
def _repeat_interleave(cx, x, repeats, dim=None, output_size=None):
    """Each entry along `dim` `repeats` times in a row (a MoE token, once per chosen expert)."""
    v = cx.value(x)
    if dim is None:
        v, dim = cx.call("reshape", v, shape=(numel(v.type.shape),)), 0
    dim = dim % v.type.rank
    shape = v.type.shape
    spread = cx.call("reshape", v, shape=shape[: dim + 1] + (1,) + shape[dim + 1 :])
    tiled = cx.call("expand", spread, shape=shape[: dim + 1] + (cx.dim(repeats),) + shape[dim + 1 :])
    return cx.call("reshape", tiled, shape=_out_shape(cx))


@handles(aten.permute.default)
def _permute(cx, x, dims):
    return cx.call("permute", cx.value(x), perm=tuple(dims))


@handles(aten.transpose.int)
def _transpose(cx, x, a, b):
    rank = cx.value(x).type.rank
    perm = list(range(rank))
    perm[a % rank], perm[b % rank] = perm[b % rank], perm[a % rank]
    return cx.call("permute", cx.value(x), perm=tuple(perm))


@handles(aten.t.default)
def _t(cx, x):
    return cx.call("permute", cx.value(x), perm=(1, 0))


@handles(aten.numpy_T.default)
def _numpy_t(cx, x):
    rank = cx.value(x).type.rank
    return cx.call("permute", cx.value(x), perm=tuple(reversed(range(rank))))


@handles(aten.slice.Tensor)
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    return cx.call(
        "slice",
        cx.value(x),
        axis=dim,
        start=cx.dim(start) if start is not None else 0,
        end=cx.dim(end) if end is not None else 2**62,
        step=step,
    )


@handles(aten.select.int)
def _select(cx, x, dim, index):
    index = cx.dim(index)
    end = 2**62 if index == -1 else index + 1
    sliced = cx.call("slice", cx.value(x), axis=dim, start=index, end=end)
    return cx.call("reshape", sliced, shape=_out_shape(cx))


@handles(aten.split_with_sizes.default, aten.split.Tensor)
def _split(cx, x, sizes, dim=0):
    v = cx.value(x)
    if not isinstance(sizes, (list, tuple)):  # split.Tensor: equal chunks of `sizes`
        total = v.type.shape[dim]
        sizes = [sizes] * (total // sizes) + ([total % sizes] if total % sizes else [])
    parts, start = [], 0
    for size in sizes:
        end = cx.dim(start) + cx.dim(size)
        parts.append(cx.call("slice", v, axis=dim, start=start, end=end))
        start = end
    return tuple(parts)


@handles(aten.chunk.default)
def _chunk(cx, x, chunks, dim=0):
    total = cx.value(x).type.shape[dim]
    if not isinstance(total, int):
        raise NotImplementedError("chunk of a symbolic dim")
    return _split(cx, x, -(-total // chunks), dim)


@handles(aten.diff.default)
def _diff(cx, x, n=1, dim=-1, prepend=None, append=None):
    if n != 1:
        raise NotImplementedError("diff with n != 1")
    v = cx.value(x)
    parts = [cx.value(p) for p in (prepend,) if p is not None] + [v] + [cx.value(a) for a in (append,) if a is not None]
    v = cx.call("concat", *parts, axis=dim) if len(parts) > 1 else v
    later = cx.call("slice", v, axis=dim, start=1, end=2**62)
    earlier = cx.call("slice", v, axis=dim, start=0, end=-1)
    return cx.call("sub", later, earlier)


@handles(aten.cat.default)
def _cat(cx, tensors, dim=0):
    return cx.call("concat", *[cx.value(t) for t in tensors], axis=dim)


@handles(aten.index.Tensor)
def _index(cx, x, indices):
    if all(i is not None for i in indices):
        return cx.call("index", cx.value(x), *[cx.value(i) for i in indices])
    tensors = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if len(tensors) != 1:
        raise NotImplementedError("index with None (slice) entries around several index tensors")
    return _index_one_axis(cx, cx.value(x), *tensors[0])


def _index_one_axis(cx, v, axis: int, index):
    """x[:, ..., index] (Falcon's multi-query fused_qkv[..., [-2], :]): a `slice` when the index
    is a constant run such as [-2] or [0, 2, 4], else `index` on the axis moved to the front."""
    idx = cx.value(index)
    run = _constant_run(cx, idx, v.type.shape[axis])
    if run is not None:
        start, end, step = run
        return cx.call("slice", v, axis=axis, start=start, end=end, step=step)
    rank, index_rank = v.type.rank, idx.type.rank
    front = cx.call("permute", v, perm=(axis, *[d for d in range(rank) if d != axis]))
    taken = cx.call("index", front, idx)  # index dims, then the other axes in order
    back = (*range(index_rank, index_rank + axis), *range(index_rank), *range(index_rank + axis, index_rank + rank - 1))
    return taken if back == tuple(range(len(back))) else cx.call("permute", taken, perm=back)


def _constant_run(cx, idx, size) -> tuple[int, int, int] | None:
    """(start, end, step) when `idx` is a constant 1-D list of positions start, start+step, ..."""
    tensor = cx.graph.weights.get(idx.name) if idx.producer is None else None
    if tensor is None or tensor.dim() != 1 or not isinstance(size, int) or tensor.dtype.is_floating_point:
        return None
    positions = [p + size if p < 0 else p for p in tensor.tolist()]
    if not positions or not all(0 <= p < size for p in positions):
        return None
    step = positions[1] - positions[0] if len(positions) > 1 else 1
    if step < 1 or positions != list(range(positions[0], positions[-1] + 1, step)):
        return None
    return positions[0], positions[-1] + 1, step


@handles(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(cx, *args, dtype=None, **kwargs):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    return cx.call("arange", start=cx.dim(start), end=cx.dim(end), step=step, dtype=from_torch(_meta(cx).dtype))


@handles(
    aten.full.default,
    aten.scalar_tensor.default,
    aten.zeros.default,
    aten.ones.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
)
def _full(cx, *args, **kwargs):
    name = cx.current.target.__name__
    value = {"zeros": 0, "ones": 1, "new_zeros": 0, "new_ones": 1, "zeros_like": 0, "ones_like": 1}.get(
        name.split(".")[0]
    )
    if value is None:
        value = args[0] if name.startswith("scalar_tensor") else args[1]
    dtype = from_torch(_meta(cx).dtype)
    value = bool(value) if dtype == "bool" else (float(value) if dtype.startswith(("f", "bf")) else int(value))
    return cx.call("full", shape=_out_shape(cx), value=value, dtype=dtype)


# -- neural-network ops --------------------------------------------------------------------
@handles(aten.embedding.default)
def _embedding(cx, weight, indices, *args):
    return cx.call("embedding", cx.value(weight), cx.value(indices))


@handles(aten.linear.default)
def _linear(cx, x, weight, bias=None):
    return cx.call("linear", cx.value(x), cx.value(weight), cx.value(bias) if bias is not None else None)


@handles(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(cx, a, b):
    return cx.call("matmul", cx.value(a), cx.value(b))


@handles(aten.addmm.default)
def _addmm(cx, bias, a, b, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise NotImplementedError("addmm with beta/alpha")
    return cx.call("add", cx.call("matmul", cx.value(a), cx.value(b)), cx.value(bias))


@handles(aten.baddbmm.default)
def _baddbmm(cx, bias, a, b, beta=1, alpha=1):
    """beta * bias + alpha * (a @ b): BLOOM's scores with their ALiBi bias."""
    product = cx.call("matmul", cx.value(a), cx.value(b))
    dtype = product.type.dtype
    if alpha != 1:
        product = cx.call("mul", product, cx.constant(alpha, dtype))
    added = cx.value(bias) if beta == 1 else cx.call("mul", cx.value(bias), cx.constant(beta, dtype))
    return cx.call("add", added, product) if beta != 0 else product


@handles(aten.layer_norm.default)
def _layer_norm_one_output(cx, x, shape, weight=None, bias=None, eps=1e-5, *args):
    return _layer_norm(cx, x, shape, weight, bias, eps)[0]


@handles(aten.native_layer_norm.default)
def _layer_norm(cx, x, shape, weight, bias, eps):
    if len(shape) != 1:
        raise NotImplementedError("layer_norm over more than the last dim")
    out = cx.call(
        "layer_norm",
        cx.value(x),
        cx.value(weight) if weight is not None else None,
        cx.value(bias) if bias is not None else None,
        eps=eps,
    )
    return (out, None, None)


@handles(aten.scaled_dot_product_attention.default)
def _sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    mask = cx.value(attn_mask) if attn_mask is not None else None
    return cx.call("attention", cx.value(q), cx.value(k), cx.value(v), mask, None, scale=scale, causal=bool(is_causal))
