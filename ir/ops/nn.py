"""Neural-network ops: linear, matmul, embedding, normalizations."""

import torch
import torch.nn.functional as F

from ..dims import dims_equal, format_dim
from ..registry import REQUIRED, OpDef, OpError, register
from .shape_rules import broadcast_shapes


def _linear_infer(x, weight, bias):
    if weight.rank != 2 or not dims_equal(x.shape[-1], weight.shape[1]):
        raise OpError(f"linear: input {x} does not match weight {weight} ([out, in])")
    return x.with_shape(x.shape[:-1] + (weight.shape[0],))


def _matmul_infer(a, b):
    if a.rank < 2 or b.rank < 2:
        raise OpError("matmul: both operands need rank >= 2")
    if not dims_equal(a.shape[-1], b.shape[-2]):
        raise OpError(f"matmul: {a} @ {b}: inner dims {format_dim(a.shape[-1])} != {format_dim(b.shape[-2])}")
    lead = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.with_shape(lead + (a.shape[-2], b.shape[-1]))


def _embedding_infer(weight, ids):
    if ids.dtype not in ("i64", "i32"):
        raise OpError(f"embedding: ids must be integers, got {ids.dtype}")
    return weight.with_shape(ids.shape + weight.shape[1:])


def _rms_norm_ref(x, weight, eps, offset):
    """In f32 whatever the input's precision (half inputs are upcast, the result cast back), as
    the models write it for f16/bf16 and as ONNX Runtime's fused norm kernels compute it."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * (weight.float() + offset) if weight is not None else y
    return y.to(x.dtype)


register(
    OpDef(
        "linear",
        ("x", "weight", "bias?"),
        _linear_infer,
        F.linear,
        doc="x @ weight.T + bias, weight [out, in]. The fusion passes make every projection one: "
        "matmul by a transposed weight, a following bias add, and q/k/v or gate/up projections "
        "merged into one linear whose output is sliced on its last axis",
    )
)
register(OpDef("matmul", ("a", "b"), _matmul_infer, torch.matmul))
register(OpDef("embedding", ("weight", "ids"), _embedding_infer, lambda w, ids: F.embedding(ids, w)))
register(
    OpDef(
        "layer_norm",
        ("x", "weight?", "bias?"),
        lambda x, w, b, eps: x,
        lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
        attrs={"eps": REQUIRED},
    )
)
register(
    OpDef(
        "rms_norm",
        ("x", "weight?"),
        lambda x, w, eps, offset: x,
        _rms_norm_ref,
        attrs={"eps": REQUIRED, "offset": 0.0},
        doc="x / rms(x) * (weight + offset); offset 1.0 is Gemma's form. Computed in f32 for f16/bf16 x "
        "(the weight may be either)",
    )
)
