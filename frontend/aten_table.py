"""The one table from ATen ops to Kiln IR ops.

It covers core ATen (what `run_decompositions` leaves) and the handful of non-core ops that
torch.export's training IR holds for common models (`to.dtype`, `type_as`, `layer_norm`, `diff`,
`__and__`, the grad/autocast wrappers), so most models convert without a decomposition retrace.

Each handler receives the conversion state and the FX node's args/kwargs and returns the IR
value (or a tuple for multi-output ops, or None for ops that vanish, like metadata asserts).
The shape, indexing and tensor-creation ops are in aten_shapes.py, imported here so the
table is complete whenever this module is imported; both register through aten_registry.py.
"""

from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled

from kiln.ir import from_torch

from . import aten_shapes  # registers the shape ops, so the table is complete on import
from .aten_registry import ATEN_TO_IR, aten, current_meta, handles

__all__ = ["ATEN_TO_IR", "handles"]


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
            b_val = cx.call(
                "mul", cx.operand(b, _like(a)), cx.constant(kwargs["alpha"], from_torch(current_meta(cx).dtype))
            )
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
    *aten_shapes.RESHAPE_OPS,
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
    target = from_torch(current_meta(cx).dtype)
    return v if target == v.type.dtype else cx.call("cast", v, dtype=target)


@handles(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def _where(cx, cond, a, b):
    dtype = current_meta(cx).dtype

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
