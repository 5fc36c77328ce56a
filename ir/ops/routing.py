"""Routing ops of mixture-of-experts models: `topk` picks each token's experts."""

import torch

from ..registry import REQUIRED, OpDef, OpError, register
from .shape_rules import norm_axis


def _topk_infer(x, k, axis, largest):
    axis = norm_axis(axis, x.rank)
    size = x.shape[axis]
    if isinstance(size, int) and not 0 < k <= size:
        raise OpError(f"topk: k={k} is not in 1..{size} (the size of axis {axis})")
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
    return x.with_shape(shape), x.with_shape(shape).with_dtype("i64")


def _topk_reference(x, k, axis, largest):
    values, indices = torch.topk(x, k, dim=axis, largest=largest, sorted=True)
    return values, indices


register(
    OpDef(
        "topk",
        ("x",),
        _topk_infer,
        _topk_reference,
        attrs={"k": REQUIRED, "axis": -1, "largest": True},
        doc="(values, i64 indices) of the k largest (or smallest) entries along axis, sorted, ties to the lower index",
    )
)
