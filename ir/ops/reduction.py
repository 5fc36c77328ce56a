"""Reductions along axes, cumulative sums and softmax."""

import torch

from ..registry import REQUIRED, OpDef, register
from ..tensor_type import TensorType
from .shape_rules import norm_axis


def _reduce_shape(x, axes, keepdim):
    axes = {norm_axis(a, x.rank) for a in axes}
    return [1 if i in axes else d for i, d in enumerate(x.shape) if keepdim or i not in axes]


def _reduction(name, fn, dtype=None):
    def infer(x, axes, keepdim):
        return TensorType(dtype or x.dtype, _reduce_shape(x, axes, keepdim))

    register(OpDef(name, ("x",), infer, fn, attrs={"axes": REQUIRED, "keepdim": False}))


_reduction("sum", lambda x, axes, keepdim: torch.sum(x, dim=list(axes), keepdim=keepdim))
_reduction("mean", lambda x, axes, keepdim: torch.mean(x, dim=list(axes), keepdim=keepdim))
_reduction("max", lambda x, axes, keepdim: torch.amax(x, dim=list(axes), keepdim=keepdim))
_reduction("any", lambda x, axes, keepdim: torch.any(x.bool(), dim=list(axes), keepdim=keepdim), dtype="bool")

register(
    OpDef(
        "cumsum",
        ("x",),
        lambda x, axis: x.with_dtype("i64") if x.dtype in ("bool", "i8", "u8", "i16", "i32") else x,
        lambda x, axis: torch.cumsum(x, dim=axis),
        attrs={"axis": REQUIRED},
    )
)
register(
    OpDef(
        "softmax",
        ("x",),
        lambda x, axis: x,
        lambda x, axis: torch.softmax(x, dim=axis),
        attrs={"axis": -1},
    )
)
